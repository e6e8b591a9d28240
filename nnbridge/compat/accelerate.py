"""accelerate offloading (``device_map`` with ``"cpu"``/``"disk"``) during extraction.

accelerate keeps offloaded weights on the ``meta`` device and loads them in its hook's
``pre_forward`` (``AlignDevicesHook`` with ``offload=True``, accelerate 1.x), putting them back on
``meta`` in ``post_forward``. Extraction clears every module's wrappers, so it loads the weights
itself for its duration, through the same hook methods, and offloads them again afterwards.
:class:`Pickler` writes such a model for ``pg.save`` (hooks kept, disk-offloaded weights included).
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: The attributes accelerate sets on a module it wraps (its hook and the wrapped forward).
ACCELERATE_ATTRIBUTES = frozenset({"_hf_hook", "_old_forward"})


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
               body: Callable[[tuple[Any, ...], dict[str, Any]], Any]) -> Any:
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


# -- pickling a dispatched model (pg.save) -------------------------------------------------------
def _new_module(cls: type[torch.nn.Module]) -> torch.nn.Module:
    return cls.__new__(cls)


def _hooked_state_set(module: torch.nn.Module, state: tuple[dict[str, Any], Any]) -> None:
    """Unpickling a module :class:`Pickler` wrote: its state, then its hook added again by
    ``accelerate.hooks.add_hook_to_module`` (which wraps ``forward`` anew and runs ``init_hook``)."""
    from accelerate.hooks import add_hook_to_module

    plain, hook = state
    module.__setstate__(plain)
    add_hook_to_module(module, hook)


class Pickler(pickle.Pickler):
    """A pickler (for ``torch.save(..., pickle_module=PICKLE_MODULE)``) that writes models
    dispatched by accelerate, whose ``forward`` wrappers (``add_hook_to_module``'s local
    ``new_forward``, accelerate 1.x) cannot be pickled:

    - a module holding an accelerate hook is written without its wrappers (``forward``,
      ``_old_forward``, ``_hf_hook``) and rebuilt with ``add_hook_to_module(module, hook)``;
    - the wrappers ``dispatch_model`` puts on an offloaded model's ``to``/``cuda``/... (warning
      that a dispatched model should not be moved; ``accelerate.hooks._accelerate_added_attributes``)
      are left out: the unpickled model has torch's own methods;
    - an ``accelerate.utils.OffloadedWeightsLoader`` (weights offloaded to disk: memory-mapped
      files in the offload folder) is written as a dict of its tensors, so the file holds the
      weights and does not depend on the offload folder (they load into memory: CPU offload).
    """

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.nn.Module) and _WRAPPERS.intersection(obj.__dict__):
            plain = {k: v for k, v in obj.__dict__.items() if k not in _WRAPPERS}
            if "_hf_hook" not in obj.__dict__:
                return _new_module, (type(obj),), plain
            return _new_module, (type(obj),), (plain, obj.__dict__["_hf_hook"]), None, None, _hooked_state_set
        loader = _offloaded_loader_type()
        if loader is not None and isinstance(obj, loader):
            return dict, ({key: obj[key] for key in obj},)
        return NotImplemented


def _offloaded_loader_type() -> type | None:
    module = sys.modules.get("accelerate.utils.offload")  # imported with accelerate's dispatching
    return getattr(module, "OffloadedWeightsLoader", None)


#: Instance attributes accelerate adds to a module (the hook, the forward wrappers, ``dispatch_model``'s
#: warning wrappers of ``to``/``cuda``/...: ``accelerate.hooks._accelerate_added_attributes``).
_WRAPPERS = ACCELERATE_ATTRIBUTES | {"forward", "to", "cuda", "npu", "xpu", "mlu", "sdaa", "musa", "neuron"}
#: ``pickle_module`` for ``torch.save`` (its ``Pickler`` is :class:`Pickler`).
PICKLE_MODULE = types.SimpleNamespace(__name__="pickle", Pickler=Pickler)
