"""accelerate offloading (``device_map`` with ``"cpu"``/``"disk"``) during extraction.

accelerate keeps offloaded weights on the ``meta`` device and loads them in its hook's
``pre_forward`` (``AlignDevicesHook`` with ``offload=True``, accelerate 1.x), putting them back on
``meta`` in ``post_forward``. Extraction clears every module's wrappers, so it loads the weights
itself for its duration, through the same hook methods, and offloads them again afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


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
