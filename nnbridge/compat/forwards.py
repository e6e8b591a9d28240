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

from .nnsight_source import NNSIGHT_STATE, install, uninstall

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
