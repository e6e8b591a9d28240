"""Whether sibling layers, their calls and their cache layers are interchangeable for layer reuse.

Its one job: the comparisons :mod:`.reuse_plan` and :mod:`.sibling_roots` group siblings by and
:mod:`.sibling_stubs` checks a sibling's call with. Entries of a ``ModuleList`` are compared by
their structure (:func:`entry_structure`: classes, train/eval flags, parameter and buffer shapes)
and their instance attributes (:func:`entry_attributes`, values compared by :func:`same`, which
is conservative); recorded calls by their outlines (:func:`outline`: pytree structure, aliasing,
tensors by :func:`leaf_key`, not the tensors themselves; compared by :func:`same_outline`);
transformers cache layers by their state (:func:`layer_key`, and while exporting
:func:`same_traced_layer`). Example::

    entry_structure(model.layers[0]) == entry_structure(model.layers[1])
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..guards.call_structure import alias_pattern, memory_layout
from ..guards.code_objects import PLAIN_READ_TYPES
from ..graph.module_tree import named_real_modules
from ..compat.torch.module_dicts import MODULE_SLOTS, non_persistent_buffers_of
from ..compat.nnsight.source import NNSIGHT_STATE
from ..compat.torch.pytree import pytree
from ..compat.torch.symbolic import sizes_unified
from .recording import copy_inputs

_PRIMITIVES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
#: nn.Module's own bookkeeping, the call wrapper extraction installs on every module while it
#: runs (``_call_impl``, see :mod:`.locking`), a bridged module's copy hook (see :mod:`.copies`)
#: and nnsight's per-module wrapping state (one object per module, not read by the module's code:
#: counted as an attribute that differs, it made every nnsight-wrapped model's layers unshareable)
_MODULE_INTERNALS = MODULE_SLOTS | {"_call_impl", "__reduce_ex__", NNSIGHT_STATE}


def same(a: Any, b: Any) -> bool:
    """Whether two attribute values are certainly interchangeable (conservative: unknown types are
    the same only when they are the same object)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, _PRIMITIVES):
        return bool(a == b)
    if isinstance(a, _OwnMethod):
        return a[0] is b[0]
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, functools.partial):  # transformers' activations: partial(gelu, approximate=...)
        return same(a.func, b.func) and same(a.args, b.args) and same(a.keywords, b.keywords)
    to_dict = getattr(a, "to_dict", None)  # a transformers config
    if callable(to_dict) and type(a).__module__.startswith("transformers."):
        return same(to_dict(), b.to_dict())
    return False


def entry_structure(entry: torch.nn.Module) -> tuple[Any, ...] | None:
    """Module classes, train/eval flags, parameters and buffers of ``entry``'s subtree; None when it
    holds a plain tensor attribute (export would bake it in). (The flags are not among the
    attributes compared, so they are here: without them, one layer in train mode among layers in
    eval mode would keep its representative's graph, without dropout and without an error.)"""
    parts: list[Any] = []
    for path, sub in named_real_modules(entry):
        params = tuple((n, tuple(p.shape), p.dtype, p.device, p.requires_grad, type(p))
                       for n, p in sub.named_parameters(recurse=False))
        buffers = tuple((n, tuple(b.shape), b.dtype, b.device, type(b)) for n, b in sub.named_buffers(recurse=False))
        names = tuple(sorted(k for k in vars(sub) if k not in _MODULE_INTERNALS))
        if any(isinstance(vars(sub)[k], torch.Tensor) for k in names):
            return None
        parts.append((path, type(sub), params, buffers, names, tuple(non_persistent_buffers_of(sub)),
                      sub.training))
    return tuple(parts)


class _OwnMethod(tuple):
    """A method bound to the module that holds it (torch's per-instance ``_call_impl``): the same
    for siblings whose functions are the same."""


def _value(sub: torch.nn.Module, value: Any) -> Any:
    if getattr(value, "__self__", None) is sub and hasattr(value, "__func__"):
        return _OwnMethod((value.__func__,))
    return value


def entry_attributes(entry: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """The instance attributes of ``entry``'s subtree (nn.Module's bookkeeping and the extraction's
    own left out): ``{(subtree path, name): value}``, methods bound to their own module compared by function."""
    return {(path, k): _value(sub, v) for path, sub in named_real_modules(entry) for k, v in vars(sub).items()
            if k not in _MODULE_INTERNALS}


def leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad, memory_layout(leaf))
    return ("value", leaf)


class TensorLeaf(tuple):
    """A tensor of an :class:`Outline`, by its :func:`leaf_key`."""


@dataclass(frozen=True)
class Outline:
    """What :func:`same_outline` compares of a recorded call or output, without holding its tensors:
    its pytree spec, the alias pattern of its tensors, and its leaves (each tensor as a
    :class:`TensorLeaf`). Made by :func:`outline`; compared by :func:`same_outline`."""
    spec: Any
    aliases: tuple[Any, ...]
    leaves: tuple[Any, ...]


def outline(value: Any) -> Outline:
    """The :class:`Outline` of ``value`` as it is now. Other leaves than tensors and plain values
    (ints, strings, dtypes, ...) are kept as deep copies (see :func:`.recording.copy_inputs`): an
    object passed to two calls may be changed between them, and compares as its state at each."""
    leaves, spec = pytree.tree_flatten(value)
    if any(not isinstance(leaf, (torch.Tensor, *PLAIN_READ_TYPES)) for leaf in leaves):
        leaves, spec = pytree.tree_flatten(copy_inputs(value))
    return Outline(spec, alias_pattern([x for x in leaves if isinstance(x, torch.Tensor)]),
                   tuple(TensorLeaf(leaf_key(x)) if isinstance(x, torch.Tensor) else x for x in leaves))


def same_outline(a: Outline, b: Outline) -> bool:
    """Whether two outlines have the same pytree structure, the same aliasing between their
    tensors, tensors of equal :func:`leaf_key` and other leaves that are :func:`same`."""
    if a.spec != b.spec or len(a.leaves) != len(b.leaves):
        return False
    if a.aliases != b.aliases:
        return False  # the representative's graph bakes in its call's aliasing (one placeholder for a repeated tensor)
    for x, y in zip(a.leaves, b.leaves):
        if isinstance(x, TensorLeaf) != isinstance(y, TensorLeaf):
            return False
        if isinstance(x, TensorLeaf):
            if x != y:
                return False
        elif not same(x, y):
            return False
    return True


def layer_key(layer: Any) -> Any:
    """A cache layer's state, tensors as their shape, dtype and device (two layers with equal keys
    flatten to equal specs and leaves of equal shapes)."""
    state = getattr(layer, "__dict__", None)
    if state is None:
        return None
    return (type(layer), tuple((k, leaf_key(v) if isinstance(v, torch.Tensor) else ("value", _state_value(v)))
                               for k, v in sorted(state.items())))


def _state_value(value: Any) -> Any:
    if isinstance(value, (list, tuple, dict)) or not isinstance(value, _PRIMITIVES):
        return ("object", id(value)) if not isinstance(value, (list, tuple)) or value else ()
    return value


def is_cache(value: Any) -> bool:
    """A transformers ``Cache`` whose layers are a list of layer objects (``DynamicCache``)."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(value, Cache) and isinstance(vars(value).get("layers"), list)


def same_traced_layer(layer: Any, rep_layer: Any) -> bool:
    """Whether a sibling's cache layer is in the state of its representative's while exporting:
    the same type and non-tensor state, tensors of the same dtype, device and sizes. Symbolic
    sizes that are different symbols with the same example value (each cache tensor gets its own
    dynamic dimensions) are unified (see :func:`~nnbridge.compat.torch.symbolic.sizes_unified`): in a
    full extraction the sibling's attention would combine them with the inputs as the
    representative's did."""
    if type(layer) is not type(rep_layer):
        return False
    state, rep_state = vars(layer), vars(rep_layer)
    if state.keys() != rep_state.keys():
        return False
    for name, value in state.items():
        rep_value = rep_state[name]
        if isinstance(value, torch.Tensor) != isinstance(rep_value, torch.Tensor):
            return False
        if not isinstance(value, torch.Tensor):
            if _state_value(value) != _state_value(rep_value):
                return False
            continue
        if (value.dtype, value.device, value.dim()) != (rep_value.dtype, rep_value.device, rep_value.dim()):
            return False
        for size, rep_size in zip(value.shape, rep_value.shape):
            if str(size) != str(rep_size) and not sizes_unified(size, rep_size):
                return False
    return True
