"""Clear, then restore, what makes a module's call differ from its class ``forward``.

Extraction must trace the model's own code: torch module hooks (per module and global) would be
baked into the graphs, and instance-level ``forward`` overrides (nnsight 0.8's ``Controller`` in
``module.__dict__["forward"]``, hand-written wrappers) would be traced instead of the class code.
The context manager below removes both for its duration and puts the very same objects back, so
``RemovableHandle``s the user holds stay valid and hook order is unchanged.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.modules import module as _module_impl

from ..transformers.output_capturing import is_output_capturing_hook

# Per-module hook dicts of torch 2.13 ``nn.Module`` (all OrderedDicts keyed by handle id).
_MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
# Global module hooks (``torch.nn.modules.module.register_module_forward_hook`` and friends).
_GLOBAL_HOOK_DICTS = (
    "_global_forward_hooks",
    "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


@contextlib.contextmanager
def cleared_module_state(model: torch.nn.Module) -> Iterator[None]:
    """Run the body with no torch hooks and no instance ``forward`` override on ``model``'s tree.

    Everything is restored on exit, also when the body raises. transformers' output-capturing
    hooks are the model's own behaviour (see :mod:`.output_capturing`): they stay in place, and
    those the model installs while the body runs are kept afterwards.
    """
    saved_hooks: list[tuple[torch.nn.Module, str, OrderedDict]] = []
    saved_forwards: list[tuple[torch.nn.Module, object]] = []
    saved_globals: list[tuple[str, OrderedDict]] = []
    try:
        for module in model.modules():
            for name in _MODULE_HOOK_DICTS:
                hooks = module.__dict__.get(name)
                if hooks:
                    saved_hooks.append((module, name, hooks))
                    module.__dict__[name] = _model_hooks(module, hooks)
            if "forward" in module.__dict__:
                saved_forwards.append((module, module.__dict__.pop("forward")))
        for name in _GLOBAL_HOOK_DICTS:
            hooks = getattr(_module_impl, name, None)
            if hooks:
                saved_globals.append((name, OrderedDict(hooks)))
                hooks.clear()
        yield
    finally:
        for module, name, hooks in saved_hooks:
            added = _model_hooks(module, module.__dict__[name])
            module.__dict__[name] = hooks
            for key, hook in added.items():
                hooks.setdefault(key, hook)
        for module, forward in saved_forwards:
            module.__dict__["forward"] = forward
        for name, hooks in saved_globals:
            getattr(_module_impl, name).update(hooks)


def _model_hooks(module: torch.nn.Module, hooks: OrderedDict) -> OrderedDict:
    """The entries of a hook dict that belong to transformers' output capturing (kept during
    extraction); for the companion dicts (``_forward_hooks_with_kwargs``...), the entries of
    those hooks' ids."""
    forward_hooks = module.__dict__.get("_forward_hooks") or {}
    return OrderedDict((key, value) for key, value in hooks.items()
                       if is_output_capturing_hook(forward_hooks.get(key, value)))


def has_module_hooks(module: torch.nn.Module) -> bool:
    """Whether any torch forward, pre-forward or backward hook is registered on ``module``."""
    d = module.__dict__
    return any(d.get(name) for name in _MODULE_HOOK_DICTS)


_USER_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def has_user_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a torch forward, pre-forward or backward hook other than transformers'
    output-capturing ones (which are the model's own computation, see :mod:`.output_capturing`)."""
    d = module.__dict__
    for name in _USER_HOOK_DICTS:
        hooks = d.get(name)
        if hooks and any(not is_output_capturing_hook(h) for h in hooks.values()):
            return True
    return False


def capturing_hooks(module: torch.nn.Module) -> list[Callable[[torch.nn.Module, tuple[Any, ...], Any], Any]]:
    """transformers' output-capturing forward hooks on ``module`` (``hook(module, args, output)``,
    registered without kwargs), in registration order; empty when none are installed (yet)."""
    hooks = module.__dict__.get("_forward_hooks") or {}
    return [hook for hook in hooks.values() if is_output_capturing_hook(hook)]


def value_hooks(module: torch.nn.Module) -> list[Callable[..., Any]]:
    """The torch forward and pre-forward hooks on ``module`` that may replace its input or output
    (all but transformers' output-capturing ones), pre-forward hooks first, each in registration order."""
    d = module.__dict__
    return [hook for name in ("_forward_pre_hooks", "_forward_hooks")
            for hook in (d.get(name) or {}).values() if not is_output_capturing_hook(hook)]


def hook_registrations() -> int:
    """How many torch hook handles this process has made so far, for any module, tensor or
    ``torch.utils.hooks`` user: ``torch.utils.hooks.RemovableHandle.next_id`` (torch 2.0 - 2.14: every
    ``register_*hook`` makes a handle with the next id). Equal at two moments: no hook was
    registered in between (hooks put back without a new handle, as :func:`cleared_module_state`
    does, are not counted)."""
    return torch.utils.hooks.RemovableHandle.next_id
