"""A reused sibling layer exported with a cache that holds only its own layer.

A decoder layer called with a transformers ``Cache`` keeps its call signature in the export (see
:mod:`nnbridge.graph.state`), and export flattens that signature's arguments and outputs at every
call: with the whole cache, each of ``L`` layers would carry all ``2 L`` keys and values in and
out, ``O(L^2)`` traced values for one forward. A sibling of layer reuse (see :mod:`.reuse_plan`)
writes only its own cache layer (its graph is its representative's, rebound to that layer, see
:mod:`.cache_rebinding`), so while exporting it is passed a stand-in: a shallow copy of the cache
whose other layers are None, marked with the layer it holds (:data:`MARK`). Its new state is
written back into the real cache (:func:`narrowing`); the parent graph's calls are widened back to
the whole cache afterwards (:mod:`.cache_widening`). Example::

    states_returned(threaded, untouched, narrow=narrowing({"layers.1": 1}))
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from ..compat.torch.pytree import pytree
from ..graph.state import Narrowing, assign_state
from .reuse_plan import ReuseFallback

#: The attribute of a stand-in cache that holds the index of the one layer it keeps.
MARK = "_nnbridge_narrowed_to"


def _layers(value: Any) -> list[Any] | None:
    state = getattr(value, "__dict__", None)
    layers = state.get("layers") if isinstance(state, dict) and not isinstance(value, type) else None
    return layers if type(layers) is list else None


def stand_in(cache: Any, index: int) -> Any | None:
    """A shallow copy of ``cache`` whose ``layers`` list keeps only item ``index`` (the others are
    None), marked with ``index``; None when ``cache`` has no such list or is a stand-in already."""
    layers = _layers(cache)
    if layers is None or not 0 <= index < len(layers) or MARK in vars(cache):
        return None
    narrow = copy.copy(cache)
    vars(narrow)["layers"] = [layer if k == index else None for k, layer in enumerate(layers)]
    vars(narrow)[MARK] = index
    return narrow


def narrowing(indices: dict[str, int]) -> Narrowing:
    """The :data:`~nnbridge.graph.state.Narrowing` that passes each module ``path`` of ``indices``
    a :func:`stand_in` of its cache holding layer ``indices[path]``.

    Its write-back raises :class:`~.reuse_plan.ReuseFallback` when the module set another layer,
    or changed the list of layers: only a full extraction would then be exact."""
    def narrow(path: str, cache: Any) -> tuple[Any, Callable[[Any], None]] | None:
        index = indices.get(path)
        replacement = stand_in(cache, index) if index is not None else None
        if replacement is None:
            return None

        def write_back(new: Any) -> None:
            layers, full = _layers(new), _layers(cache)
            if type(new) is not type(cache) or layers is None or full is None or len(layers) != len(full) \
                    or vars(new).pop(MARK, None) != index \
                    or any(layer is not None for k, layer in enumerate(layers) if k != index):
                raise ReuseFallback(f"'{path}' changed cache layers other than its own")
            for k, layer in enumerate(full):
                if k != index:
                    layers[k] = layer
            assign_state(cache, new)
        return replacement, write_back
    return narrow


def _markers(spec: pytree.TreeSpec) -> tuple[Any, list[torch.Tensor]]:
    """``spec`` unflattened with a distinct empty tensor per leaf, and those tensors."""
    leaves = [torch.empty(0) for _ in range(spec.num_leaves)]
    return pytree.tree_unflatten(leaves, spec), leaves


def narrowed_index(spec: pytree.TreeSpec) -> int | None:
    """The layer a stand-in cache's spec keeps (its :data:`MARK`); None for any other spec."""
    if spec.is_leaf() or spec.type in (tuple, list, dict, type(None)):
        return None
    try:
        value, _ = _markers(spec)
    except Exception:  # noqa: BLE001 - a custom unflatten that computes on its leaves
        return None
    index = vars(value).get(MARK) if hasattr(value, "__dict__") and not isinstance(value, type) else None
    return index if isinstance(index, int) else None


def narrowed_spec(spec: pytree.TreeSpec, index: int) -> pytree.TreeSpec | None:
    """The spec of a :func:`stand_in` holding layer ``index`` of a cache of spec ``spec``; None
    when such a cache has no stand-in."""
    found = narrowed_leaves(spec, index)
    return None if found is None else found[0]


def narrowed_leaves(spec: pytree.TreeSpec, index: int) -> tuple[pytree.TreeSpec, list[int]] | None:
    """:func:`narrowed_spec`, and for each of its leaves the index of the leaf of ``spec`` it is."""
    try:
        value, leaves = _markers(spec)
    except Exception:  # noqa: BLE001 - a custom unflatten that computes on its leaves
        return None
    narrow = stand_in(value, index)
    if narrow is None:
        return None
    kept, narrow_spec = pytree.tree_flatten(narrow)
    where = {id(t): k for k, t in enumerate(leaves)}
    return narrow_spec, [where[id(t)] for t in kept]


def widened_spec(full: pytree.TreeSpec, narrowed: pytree.TreeSpec) -> tuple[pytree.TreeSpec, list[tuple[bool, int]]]:
    """The spec of the whole cache (of spec ``full`` before the call) once a stand-in's new state
    (spec ``narrowed``) is written back, as :func:`narrowing`'s write-back does; and, for each of
    its leaves, ``(from the stand-in, index)``: the leaf of the stand-in's new state, or of the
    cache before the call, it is.

    Raises:
        ReuseFallback: ``narrowed`` is not a stand-in's spec, or its other layers are not None.
    """
    index = narrowed_index(narrowed)
    before, before_leaves = _markers(full)
    new, new_leaves = _markers(narrowed)
    layers, full_layers = _layers(new), _layers(before)
    if index is None or type(new) is not type(before) or layers is None or full_layers is None \
            or len(layers) != len(full_layers) or any(layer is not None for k, layer in enumerate(layers) if k != index):
        raise ReuseFallback("a layer's cache stand-in changed other layers")
    del vars(new)[MARK]
    for k, layer in enumerate(full_layers):
        if k != index:
            layers[k] = layer
    leaves, spec = pytree.tree_flatten(new)
    where = {id(t): (False, k) for k, t in enumerate(before_leaves)}
    where.update({id(t): (True, k) for k, t in enumerate(new_leaves)})
    if any(id(t) not in where for t in leaves):
        raise ReuseFallback("a layer's cache stand-in does not flatten to its leaves")
    return spec, [where[id(t)] for t in leaves]
