"""Eager recording: runs of the user's module on copies of the inputs, with temporary hooks.

Extraction needs what each submodule was called with (:func:`record_calls`), stand-in outputs for
children that export may not trace (:func:`stub_output`) and copies of example inputs that a run
may mutate (:func:`copy_inputs`; a ``DynamicCache`` is updated in place). Example::

    calls = record_calls(model, {"transformer.h.0"}, (ids,), {})
    args, kwargs, output = calls["transformer.h.0"][0]
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..compat.torch.pytree import pytree
from ..compat.torch.sibling_zeros import sibling_zeros
from ..errors import NNBridgeError
from ..graph.kinds import HookKind
from ..guards.preservation import preserved_state

def copy_inputs(value: Any) -> Any:
    """A copy of example inputs that extraction may run or trace without touching the caller's
    objects (a cache is mutated by the run). ``deepcopy`` when it works; else (tensors with autograd
    history cannot be deep-copied) a pytree copy with detached clones, which also rebuilds
    registered objects such as transformers' caches. Copies keep their originals' strides (a call's
    memory layouts are part of its structure): ``clone`` makes an expanded tensor contiguous, so
    such a tensor is deep-copied detached (its storage with it)."""
    try:
        return copy.deepcopy(value)
    except Exception:
        def clone(t: torch.Tensor) -> torch.Tensor:
            copied = t.detach().clone()
            if copied.stride() != t.stride():  # overlapping (an expand): clone is contiguous
                copied = copy.deepcopy(t.detach())
            return copied.requires_grad_() if t.requires_grad and copied.is_floating_point() else copied
        return pytree.tree_map_only(torch.Tensor, clone, value)


def observed_run(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 *, hooks: list[tuple[torch.nn.Module, HookKind, Callable[..., None]]], grad: bool = False,
                 around: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
                 reset: Callable[[], None] = lambda: None) -> Any:
    """One eager run of ``module`` on copies of the inputs (a cache would be mutated), with
    temporary hooks: ``(submodule, HookKind, fn)``, both with kwargs. No grad unless ``grad``
    (then the hooks see the ``requires_grad`` of the values a real call in grad mode passes).
    A run without grad that raises while grad is enabled outside it is made again with grad, after
    ``reset()`` (which drops what the hooks kept): code may need grad (``h.register_hook(f)`` or
    ``h.retain_grad()`` on a tensor the call computes raise without it).
    ``around()`` is entered just around the call (after the state to restore is taken).
    The run leaves no trace (:func:`~.preservation.preserved_state`): the next run or export
    starts from the module's state before it, as the user's call will (a forward that unmerges an
    adapter and clears its flag unmerges again in each). Returns what the module returned.

    Raises:
        ExtractionError: the run changed a parameter in place other than through ``.data``.
        Exception: what the module's code raised (in grad mode, when the call is in grad mode).
    """
    from ..graph.module_tree import named_real_modules

    handles = []
    try:
        for sub, kind, fn in hooks:
            register = sub.register_forward_pre_hook if kind == HookKind.PRE else sub.register_forward_hook
            handles.append(register(fn, with_kwargs=True))
        try:
            with torch.set_grad_enabled(grad), preserved_state(list(named_real_modules(module))), around():
                return module(*copy_inputs(args), **copy_inputs(kwargs))
        except Exception as error:
            if grad or not torch.is_grad_enabled() or isinstance(error, NNBridgeError):
                raise
            reset()
            with preserved_state(list(named_real_modules(module))), around():
                return module(*copy_inputs(args), **copy_inputs(kwargs))
    finally:
        for handle in handles:
            handle.remove()


#: how a call of a module only compared is recorded (see :func:`record_calls`)
Outline = Callable[[tuple[Any, ...], dict[str, Any]], Callable[[Any], Any]]


def record_calls(module: torch.nn.Module, fqns: set[str], args: tuple[Any, ...],
                 *, kwargs: dict[str, Any], outlined: Mapping[str, Outline] | None = None,
                 output: list[Any] | None = None) -> dict[str, list[Any]]:
    """One eager run recording ``(args, kwargs, output)`` of every call of the named submodules;
    the inputs are copied before the call (a cache argument is updated by it). A call of a module
    named in ``outlined`` is recorded as ``outlined[fqn](args, kwargs)(output)`` instead, the first
    part taken before the call, the second after it, on the values themselves (for modules whose
    calls are only compared, see :func:`.reuse_plan.compared_call`: copies of every decoder layer's
    inputs and outputs would be held until the run ends). The run's own output is appended to
    ``output``."""
    calls: dict[str, list[Any]] = defaultdict(list)
    pending: dict[str, list[Any]] = defaultdict(list)
    outlined = outlined or {}

    def before(fqn: str) -> Callable[..., None]:
        if fqn in outlined:
            outline = outlined[fqn]
            return lambda mod, a, k: pending[fqn].append(outline(a, k))
        return lambda mod, a, k: pending[fqn].append((copy_inputs(a), copy_inputs(k)))

    def after(fqn: str) -> Callable[..., None]:
        if fqn in outlined:
            return lambda mod, a, k, out: calls[fqn].append(pending[fqn].pop()(out))
        return lambda mod, a, k, out: calls[fqn].append((*pending[fqn].pop(), copy_inputs(out)))

    def reset() -> None:
        calls.clear()
        pending.clear()
    hooks = [(module.get_submodule(fqn), kind, hook(fqn))
             for fqn in fqns for kind, hook in ((HookKind.PRE, before), (HookKind.POST, after))]
    returned = observed_run(module, args, kwargs, hooks=hooks, reset=reset)
    if output is not None:
        output.append(returned)
    return calls


def stub_output(args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    """The recorded output as zeros that still depend on every tensor input (else export drops
    whatever computed the inputs, e.g. the integer ``position_ids`` a stubbed rotary embedding
    receives): one :func:`~nnbridge.compat.torch.sibling_zeros.sibling_zeros` node per output tensor, so a decoder stack
    stubbed with its cache and attention maps as output stays small to export.
    Floating outputs require grad when an input does, as the module's would; integer ones do not."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]

    def stub(t: torch.Tensor) -> torch.Tensor:
        if not tensors or not t.is_floating_point():
            return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
        zeros = sibling_zeros(tensors, list(t.shape), t.dtype)
        return zeros if zeros.device == t.device else zeros.to(t.device)
    return pytree.tree_map_only(torch.Tensor, stub, output)
