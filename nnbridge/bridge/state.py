"""Stateful call arguments: objects a module mutates in place, such as transformers' ``Cache``.

A decoder layer called with ``past_key_values=cache`` appends to ``cache`` and returns only its
hidden states. ``torch.export`` with a preserved call signature hands the module a *rebuilt* copy
of each pytree argument, so the update would never reach the caller, and
``torch.export.unflatten`` cannot thread it either. While exporting, each such call is therefore
rewritten (see :func:`states_returned`) so that the module returns ``(output, [new states])``
and its caller copies the new states into its own objects. The extracted graphs keep eager's
contract: a state module's graph takes the cache object, writes its new state into that same
object (an :func:`assign_state` node) and returns only the module's output; a parent graph reads
the state back from the object it passed in (the graph rewrites are in :mod:`.state_graphs`). Hooks and nnsight envoys thus see the module's real
signature (``hidden_states, attention_mask=..., past_key_values=cache, ...``) and real output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from ..compat.pytree import pytree

from ..compat import call_overridden
from .cleanup import plain_value
from .locking import CALL_LOCK

#: A top-level argument of a call: its position, or its keyword.
Key = int | str


def state_keys(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Key]:
    """Positions and keywords of the call's arguments that are not plain pytrees of leaves (tuples,
    lists, dicts, None, tensors, scalars): the objects a module may mutate, in call order."""
    return [i for i, a in enumerate(args) if not plain_value(a)] + [k for k, v in kwargs.items() if not plain_value(v)]


def argument(args: tuple[Any, ...], kwargs: dict[str, Any], key: Key) -> Any:
    """The argument at ``key`` (a position or a keyword)."""
    return args[key] if isinstance(key, int) else kwargs[key]


def _fresh(value: Any) -> Any:
    """A new object with the same state (a pytree round trip; tensors are shared)."""
    leaves, spec = pytree.tree_flatten(value)
    return pytree.tree_unflatten(leaves, spec)


@torch.fx.node.has_side_effect
def assign_state(target: Any, source: Any) -> None:
    """Give ``target`` the state of ``source`` (same type), keeping ``target``'s identity and, where
    the structure matches, the identity of the objects it holds (a cache's layer objects).

    Raises:
        TypeError: ``target`` and ``source`` are of different types.
    """
    if type(target) is not type(source):
        raise TypeError(f"cannot copy the state of a {type(source).__name__} into a {type(target).__name__}")
    if isinstance(target, list):
        if len(target) == len(source):
            for i, (old, new) in enumerate(zip(target, source)):
                if _assignable(old, new):
                    assign_state(old, new)
                else:
                    target[i] = new
        else:
            target[:] = source
        return
    # a dict's items, or an object's attributes
    state, new_state = (target, source) if isinstance(target, dict) else (vars(target), vars(source))
    for name in [n for n in state if n not in new_state]:
        del state[name]
    for name, new in new_state.items():
        if name in state and _assignable(state[name], new):
            assign_state(state[name], new)
        else:
            state[name] = new


#: Plumbing, not an op: op points skip nodes calling it.
assign_state.nnbridge_plumbing = True  # type: ignore[attr-defined]


def _assignable(old: Any, new: Any) -> bool:
    if old is new or type(old) is not type(new) or isinstance(old, torch.Tensor):
        return False
    return isinstance(old, (list, dict)) or (hasattr(old, "__dict__") and not isinstance(old, type))


@contextlib.contextmanager
def states_returned(modules: dict[str, torch.nn.Module]) -> Iterator[dict[str, list[list[Key]]]]:
    """While exporting, make each call of ``modules`` with stateful arguments return its new states.

    Inside (after export's signature-preserving pre-hook rebuilt the arguments) the module's
    forward runs on fresh copies of its stateful arguments and returns ``(output, [copies])``, so
    the preserved signature records the arguments as they were before the call and an output that
    carries the new state. Outside (around the whole call, hooks included), the copies' state is
    assigned to the caller's objects and only ``output`` is returned, as the eager call would.
    Calls without stateful arguments are untouched.

    Args:
        modules: ``{path: module}``; each module's forward is the class's or an instance override.

    Yields:
        ``{path: [state keys of each invocation, in call order]}`` (``[]`` for a call without
        stateful arguments), filled while the body runs.
    """
    calls: dict[str, list[list[Key]]] = {}
    installed: list[tuple[torch.nn.Module, Any]] = []

    def wrap(path: str, module: torch.nn.Module) -> None:
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            keys = state_keys(args, kwargs)
            if not keys:
                return inner(*args, **kwargs)
            args, kwargs = list(args), dict(kwargs)
            copies = []
            for key in keys:
                copy = _fresh(argument(args, kwargs, key))  # type: ignore[arg-type]
                if isinstance(key, int):
                    args[key] = copy
                else:
                    kwargs[key] = copy
                copies.append(copy)
            return inner(*args, **kwargs), copies

        def call(run: Any, *args: Any, **kwargs: Any) -> Any:
            with CALL_LOCK:  # replaces a locked call for the extraction's duration (see .locking)
                return threaded_call(run, *args, **kwargs)

        def threaded_call(run: Any, *args: Any, **kwargs: Any) -> Any:
            keys = state_keys(args, kwargs)
            calls.setdefault(path, []).append(keys)
            if not keys:
                return run(*args, **kwargs)
            output, copies = run(*args, **kwargs)
            for key, copy in zip(keys, copies):
                assign_state(argument(args, kwargs, key), copy)
            return output

        installed.append((module, module.__dict__.get("forward"), module.__dict__.get("_call_impl")))
        module.__dict__["forward"] = forward
        call_overridden(module, call)

    try:
        for path, module in modules.items():
            wrap(path, module)
        yield calls
    finally:
        for module, previous, call_impl in installed:
            call_overridden(module, None)
            if call_impl is not None:  # a bridged model's locked call (see .locking)
                module.__dict__["_call_impl"] = call_impl
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous
