"""transformers' hook-based output capturing (``output_attentions=True``, ``output_hidden_states=True``).

transformers 5.x (``transformers.utils.output_capturing``, verified on 5.23 and 5.24) collects
attention weights and hidden states with forward hooks it installs lazily on the attention and decoder-layer
modules; a model's decorated ``forward`` activates a collector (a ``ContextVar`` holding
``{"attentions": [], ...}``) for the duration of its body, and the hooks append to it. The hooks
are part of the model's behaviour, not the user's: extraction keeps them in place, and a module
whose body collects values from submodules' hooks cannot be one graph (the values cross module
boundaries that ``torch.export``'s preserved call signatures cannot express).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import CodeType, ModuleType
from typing import Any

_capturing: ModuleType | None
try:  # transformers >= 5.0
    from transformers.utils import output_capturing as _capturing
except ImportError:  # pragma: no cover - older transformers, or none
    _capturing = None


def _hook_code() -> CodeType | None:
    if _capturing is None:
        return None
    install = getattr(_capturing, "install_output_capuring_hook", None)  # sic, transformers 5.23's spelling
    for const in getattr(getattr(install, "__code__", None), "co_consts", ()):
        if getattr(const, "co_name", None) == "output_capturing_hook":
            return const
    return None


_HOOK_CODE = _hook_code()

#: Attributes transformers sets on a model the first time it captures outputs (together with
#: installing the hooks): model state that is neither a side effect of the forward nor an input
#: a graph depends on.
MODEL_STATE_ATTRIBUTES = frozenset({"_output_capturing_hooks_installed"})


def is_output_capturing_hook(hook: object) -> bool:
    """Whether ``hook`` is a forward hook transformers installed to capture outputs."""
    return _HOOK_CODE is not None and getattr(hook, "__code__", None) is _HOOK_CODE


def active_collector() -> dict[str, Any] | None:
    """The collector transformers' capturing hooks currently append to: a dict such as
    ``{"attentions": [], "hidden_states": []}``, or None (no decorated forward is running, or it
    requested nothing)."""
    if _capturing is None:
        return None
    collector = _capturing._active_collector.get()
    if not collector or not any(not str(key).startswith("_") for key in collector):
        return None
    return collector


@contextlib.contextmanager
def collector_suspended() -> Iterator[None]:
    """No collector in the body (transformers' ``_active_collector``, a ``ContextVar`` wrapper,
    set to None and reset on exit): an extraction made while a decorated forward is collecting
    (a child extracted for a new call structure inside a model called with
    ``output_hidden_states=True``) must not append its traced (fake) or recording runs' values to
    the caller's collector."""
    if _capturing is None:
        yield
        return
    token = _capturing._active_collector.context_var.set(None)
    try:
        yield
    finally:
        _capturing._active_collector.context_var.reset(token)
