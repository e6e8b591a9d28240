"""accelerate offloading (``device_map`` with ``"cpu"``/``"disk"``) during extraction.

accelerate keeps offloaded weights on the ``meta`` device and loads them in its hook's
``pre_forward`` (``AlignDevicesHook`` with ``offload=True``, accelerate 1.x), putting them back on
``meta`` in ``post_forward``. Extraction clears every module's wrappers, so it loads the weights
itself for its duration, through the same hook methods, and offloads them again afterwards.
:class:`~nnbridge.compat.pickling.Pickler` writes such a model for ``pg.save``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: The attributes accelerate sets on a module it wraps (its hook and the wrapped forward).
ACCELERATE_ATTRIBUTES = frozenset({"_hf_hook", "_old_forward"})
#: Instance attributes accelerate adds to a module: the hook, the forward wrappers, and
#: ``dispatch_model``'s warning wrappers of ``to``/``cuda``/... (accelerate 1.x's
#: ``accelerate.hooks._accelerate_added_attributes``).
ADDED_ATTRIBUTES = ACCELERATE_ATTRIBUTES | {"forward", "to", "cuda", "npu", "xpu", "mlu", "sdaa", "musa", "neuron"}


def offloaded_loader_type() -> type | None:
    """``accelerate.utils.offload.OffloadedWeightsLoader`` (the weights map of disk offload), or
    None when accelerate's offloading was not imported."""
    module = sys.modules.get("accelerate.utils.offload")
    return getattr(module, "OffloadedWeightsLoader", None)


def hook_added(module: torch.nn.Module, hook: Any) -> None:
    """``accelerate.hooks.add_hook_to_module(module, hook)``: wraps ``forward`` anew, runs ``init_hook``."""
    from accelerate.hooks import add_hook_to_module

    add_hook_to_module(module, hook)


def _offload_hooks(hook: Any) -> list[Any]:
    if hook is None:
        return []
    if hasattr(hook, "hooks"):  # SequentialHook
        return [h for inner in hook.hooks for h in _offload_hooks(inner)]
    return [hook] if getattr(hook, "offload", False) else []


@contextlib.contextmanager
def offloaded_weights_loaded(model: torch.nn.Module) -> Iterator[None]:
    """Load accelerate-offloaded weights onto their execution devices for the body's duration."""
    loaded: list[tuple[Any, torch.nn.Module]] = []
    try:
        for module in model.modules():
            for hook in _offload_hooks(module.__dict__.get("_hf_hook")):
                hook.pre_forward(module)
                loaded.append((hook, module))
        yield
    finally:
        for hook, module in reversed(loaded):
            hook.post_forward(module, None)


# -> Any: accelerate ships no types (its ``ModelHook``, or None)
def accelerate_hook(module: torch.nn.Module) -> Any:
    """The accelerate hook wrapping ``module``'s forward (``_hf_hook``, accelerate 1.x), or None."""
    return module.__dict__.get("_hf_hook")


def run_hooked(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
               *, body: Callable[[tuple[Any, ...], dict[str, Any]], Any]) -> Any:
    """Run ``body(args, kwargs)`` as accelerate's wrapper (``add_hook_to_module``'s ``new_forward``,
    accelerate 1.x) runs ``module._old_forward``: ``pre_forward`` first (loads offloaded weights
    onto the execution device, moves the inputs), ``post_forward`` on the output (offloads the
    weights again, moves the output), under ``torch.no_grad`` when the hook asks for it. A module
    without a hook runs ``body`` alone. ``post_forward`` also runs when ``body`` raises, so no
    weights stay loaded after an error."""
    hook = accelerate_hook(module)
    if hook is None:
        return body(args, kwargs)
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    try:
        if getattr(hook, "no_grad", False):
            with torch.no_grad():
                output = body(args, kwargs)
        else:
            output = body(args, kwargs)
    except BaseException:
        hook.post_forward(module, None)
        raise
    return hook.post_forward(module, output)

