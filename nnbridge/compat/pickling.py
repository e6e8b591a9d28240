"""Pickling a model for ``pg.save`` (``torch.save(..., pickle_module=PICKLE_MODULE)``).

A model is pickled as ``torch.save(model)`` pickles it, except for what other libraries attached
to it that cannot be pickled and that they attach again themselves:

- accelerate (1.x): a module holding a hook (``_hf_hook``) is written without its wrappers
  (``forward``, ``_old_forward``: ``add_hook_to_module``'s local ``new_forward``) and rebuilt with
  ``accelerate.hooks.add_hook_to_module(module, hook)``; ``dispatch_model``'s warning wrappers of
  ``to``/``cuda``/... (wrappers of the module's own methods) are left out (the unpickled model has its class's own methods); an
  ``OffloadedWeightsLoader`` (disk offload: memory-mapped files in the offload folder) is written
  as a dict of its tensors, so the file holds the weights and does not need the folder (they load
  into memory, as CPU offload);
- transformers (5.x): the forward hooks it installs to capture ``output_attentions`` /
  ``output_hidden_states`` (local functions) are left out, with the model's
  ``_output_capturing_hooks_installed`` flag, so transformers installs them again on the first
  call that captures outputs.
"""

from __future__ import annotations

import pickle
import types
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, cast

import torch

from .accelerate import ADDED_ATTRIBUTES, hook_added, offloaded_loader_type
from .transformers.output_capturing import MODEL_STATE_ATTRIBUTES, is_output_capturing_hook

_HOOK_TABLES = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _new_module(cls: type[torch.nn.Module]) -> torch.nn.Module:
    return cls.__new__(cls)


def _hooked_state_set(module: torch.nn.Module, state: tuple[dict[str, Any], Any]) -> None:
    """Unpickling a module with an accelerate hook: its state, then the hook added again."""
    plain, hook = state
    module.__setstate__(plain)
    hook_added(module, hook)


def _capturing_ids(module: torch.nn.Module) -> set[int]:
    return {key for key, hook in module.__dict__.get("_forward_hooks", {}).items() if is_output_capturing_hook(hook)}


class Pickler(pickle.Pickler):
    """The pickler of :data:`PICKLE_MODULE` (see module docstring)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.nn.Module):
            own = obj.__dict__
            left_out = MODEL_STATE_ATTRIBUTES.intersection(own) | {
                name for name in ADDED_ATTRIBUTES.intersection(own)
                if "_hf_hook" in own or getattr(getattr(own[name], "__wrapped__", None), "__self__", None) is obj}
            capturing = _capturing_ids(obj)
            if not left_out and not capturing:
                return NotImplemented
            plain = {k: v for k, v in own.items() if k not in left_out}
            for table in _HOOK_TABLES:
                if capturing and table in own:
                    plain[table] = OrderedDict((k, v) for k, v in own[table].items() if k not in capturing)
            if "_hf_hook" not in own:
                return _new_module, (type(obj),), plain
            return _new_module, (type(obj),), (plain, own["_hf_hook"]), None, None, _hooked_state_set
        loader = offloaded_loader_type()
        if loader is not None and isinstance(obj, loader):
            weights = cast(Mapping[str, torch.Tensor], obj)
            return dict, ({key: weights[key] for key in weights},)
        return NotImplemented


#: ``pickle_module`` for ``torch.save`` (its ``Pickler`` is :class:`Pickler`).
PICKLE_MODULE = types.SimpleNamespace(__name__="pickle", Pickler=Pickler)
