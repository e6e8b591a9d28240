"""Where a module's body lives, and how to swap it without breaking the wrapper around it.

A module's call runs ``module.__dict__["forward"]`` when there is one, else the class's forward.
Three wrappers can already hold that slot; a bridge swaps the *body* they call, not the wrapper:

- nnsight 0.8.x: ``__dict__["forward"]`` is a ``Controller`` that runs
  ``__dict__["__nnsight__"].body(module, *args, **kwargs)``;
- accelerate: ``__dict__["forward"]`` is ``new_forward`` calling ``module._old_forward`` between
  its hook's ``pre_forward``/``post_forward`` (``_hf_hook``);
- anything else (a plain instance ``forward``, or none): the slot itself.
"""

from __future__ import annotations

import enum
import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.fx import _symbolic_trace
from torch.nn.modules import module as _module_impl

from ..nnsight.source import NNSIGHT_STATE, install, uninstall

_MISSING = object()


class BodyKind(enum.Enum):
    """Where :func:`swap_body` put the new body (and where :func:`restore_body` puts the old one)."""

    NNSIGHT = "nnsight"  # nnsight's per-module ``State.body`` (nnsight 0.8.x wraps the module)
    ACCELERATE = "accelerate"  # accelerate's ``_old_forward`` (an ``_hf_hook`` wraps the forward)
    SLOT = "slot"  # the module's instance ``forward``


@dataclass
class SwappedBody:
    """What :func:`swap_body` replaced, for :func:`restore_body`."""

    module: torch.nn.Module
    kind: BodyKind
    #: what the slot held: a body or forward, None, or the missing-slot marker
    previous: object


def swap_body(module: torch.nn.Module, body: Callable[..., Any]) -> SwappedBody:
    """Make ``module``'s call run ``body(module, *args, **kwargs)`` inside whatever wraps it."""
    state = module.__dict__.get(NNSIGHT_STATE)
    if state is not None:  # nnsight's slot keeps its own body (``.source`` rewrites it): see nnsight_source

        return SwappedBody(module, BodyKind.NNSIGHT, install(module, body))
    bound = _Bound(module, body, module.__dict__.get("forward"))
    if "_hf_hook" in module.__dict__ and "_old_forward" in module.__dict__:
        swapped = SwappedBody(module, BodyKind.ACCELERATE, module.__dict__["_old_forward"])
        module.__dict__["_old_forward"] = bound
        return swapped
    swapped = SwappedBody(module, BodyKind.SLOT, module.__dict__.get("forward", _MISSING))
    module.__dict__["forward"] = bound
    return swapped


def instance_forward(module: torch.nn.Module) -> Callable[..., Any] | None:
    """The ``forward`` user code set on ``module`` itself (``module.forward = f``), or None when
    its call runs its class's forward: no instance ``forward``, or only nnsight's, accelerate's or
    a bridge's wrapper around the class's (accelerate's ``_old_forward`` is the class's bound
    forward unless user code replaced it)."""
    state = module.__dict__
    if NNSIGHT_STATE in state:
        return None
    slot = state.get("forward")
    if "_hf_hook" in state and "_old_forward" in state:
        slot = state["_old_forward"]
        if isinstance(slot, types.MethodType) and slot.__func__ is type(module).forward and slot.__self__ is module:
            return None
    if slot is None or isinstance(slot, _Bound):
        return None
    return cast("Callable[..., Any]", slot)


def restore_body(swapped: SwappedBody) -> None:
    """Undo :func:`swap_body`."""
    module = swapped.module
    if swapped.kind is BodyKind.NNSIGHT:

        uninstall(module, cast("Callable[..., Any] | None", swapped.previous))  # what install returned
    elif swapped.kind is BodyKind.ACCELERATE:
        module.__dict__["_old_forward"] = swapped.previous
    elif swapped.previous is _MISSING:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = swapped.previous


class _Bound:
    """``body`` bound to a module by weak reference (the module owns this object)."""

    def __init__(self, module: torch.nn.Module, body: Callable[..., Any], previous: Callable[..., Any] | None = None):
        import weakref

        self.module_ref = weakref.ref(module)
        self.body = body
        self._previous_signature = None if previous is None else inspect.signature(previous)

    @property
    def __signature__(self) -> inspect.Signature:
        """The signature of the forward it stands in for: transformers reads
        ``inspect.signature(model.forward)`` to decide which arguments to pass (``generate`` passes
        ``logits_to_keep`` only to a forward that declares it)."""
        if self._previous_signature is not None:
            return self._previous_signature
        module = self.module_ref()
        if module is None:
            return inspect.Signature()
        return inspect.signature(type(module).forward.__get__(module))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.body(self.module_ref(), *args, **kwargs)


def call_overridden(module: torch.nn.Module, around: Callable[..., Any] | None) -> None:
    """Make ``module(*args, **kwargs)`` run ``around(run, *args, **kwargs)``, where ``run`` is the
    normal call (hooks and forward); ``around=None`` removes the override.

    Uses the instance attribute ``_call_impl`` that ``nn.Module.__call__`` looks up (torch 2.0 -
    2.13), so the override sits outside every hook, including ones registered later.
    """
    if around is None:
        module.__dict__.pop("_call_impl", None)
        return
    run = types.MethodType(type(module)._call_impl, module)
    module.__dict__["_call_impl"] = functools.partial(around, run)


def call_override(module: torch.nn.Module) -> Callable[..., Any] | None:
    """The override :func:`call_overridden` (or another library) installed on ``module``, or None."""
    return module.__dict__.get("_call_impl")


def restore_call_override(module: torch.nn.Module, override: Callable[..., Any]) -> None:
    """Put back an override :func:`call_override` returned earlier."""
    module.__dict__["_call_impl"] = override


_CALL_IMPL = torch.nn.Module._call_impl
_HOOK_NAMES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def runs_only_forward(module: torch.nn.Module) -> bool:
    """Whether ``nn.Module.__call__(module, *args, **kwargs)`` would, right now, do nothing but
    ``type(module).forward(module, *args, **kwargs)`` (torch 2.13's ``_wrapped_call_impl``/
    ``_call_impl``): the module is not ``module.compile()``'d and sets neither ``forward`` nor
    ``_call_impl`` on itself (an nnsight or accelerate wrapper); no forward, pre-forward, backward
    or backward-pre hook is registered on it or globally; and no TorchScript trace, fx symbolic
    trace (``torch.fx._symbolic_trace.is_fx_symbolic_tracing``, torch 2.13 - 2.14), Dynamo or export
    trace runs. Checked on every call: a hook registered later makes the normal call run."""
    state = module.__dict__
    return "forward" not in state and "_call_impl" not in state and _unhooked(state) \
        and not (torch.compiler.is_compiling() or _symbolic_trace.is_fx_symbolic_tracing())


def _unhooked(state: dict[str, Any]) -> bool:
    """Whether the module whose ``__dict__`` is ``state`` is not ``module.compile()``'d, no forward,
    pre-forward, backward or backward-pre hook is registered on it or globally, and no TorchScript
    trace runs: what :func:`runs_only_forward` and :class:`DirectCall` both ask."""
    if any(map(state.get, _HOOK_NAMES)) or state.get("_compiled_call_impl") is not None:
        return False
    hooks = _module_impl
    return not (hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks
                or hooks._global_backward_pre_hooks or torch._C._get_tracing_state())


class DirectCall:
    """Whether ``nn.Module.__call__(module, *args, **kwargs)`` would, right now, do nothing but run
    ``around(run, ...)`` and then the swapped body ``body(module, *args, **kwargs)``: so a caller
    that holds what ``around`` takes (a lock) may call the body itself and skip five Python frames
    of ``nn.Module.__call__`` (the larger part of what a bridged module call costs).

    That is the case (torch 2.13's ``_wrapped_call_impl``/``_call_impl``) when the module is not
    ``module.compile()``'d, no TorchScript trace runs, no
    forward, pre-forward, backward or backward-pre hook is registered on it or globally, its
    ``_call_impl`` override is ``around`` bound to the class's ``_call_impl`` (see
    :func:`call_overridden`) and its ``forward`` slot is the :class:`_Bound` of ``body`` that
    :func:`swap_body` installed. Each is checked on every call (a hook registered later, an
    nnsight or accelerate wrapper, a replaced ``forward``: the normal call runs).

    Example::

        direct = DirectCall(module, bridge.body, locked_call)
        if direct():
            bridge.body(module, x)      # what nn.Module.__call__(module, x) would run
    (A class's own ``__call__`` around ``nn.Module``'s is not asked about: a bridged parent's graph
    holds what it adds, see :class:`~nnbridge.inplace.bridging._CallSite`.)
    """

    __slots__ = ("module", "body", "around", "_impl", "_forward")

    def __init__(self, module: torch.nn.Module, body: Callable[..., Any], around: Callable[..., Any]):
        self.module, self.body, self.around = module, body, around
        # the ``_call_impl`` override and ``forward`` slot last verified (none yet: no module holds
        # this marker, so the first call verifies)
        self._impl: object = _MISSING
        self._forward: object = _MISSING

    def __call__(self) -> bool:
        module = self.module
        state = module.__dict__
        if (state.get("_call_impl") is not self._impl or state.get("forward") is not self._forward) \
                and not self._verify(state):
            return False
        return _unhooked(state)

    def _verify(self, state: dict[str, Any]) -> bool:
        impl, forward = state.get("_call_impl"), state.get("forward")
        if not (isinstance(impl, functools.partial) and impl.func is self.around and len(impl.args) == 1
                and not impl.keywords and getattr(impl.args[0], "__func__", None) is _CALL_IMPL
                and getattr(impl.args[0], "__self__", None) is self.module):
            return False
        if not (type(forward) is _Bound and forward.module_ref() is self.module and forward.body == self.body):
            return False
        self._impl, self._forward = impl, forward
        return True
