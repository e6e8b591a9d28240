"""Sibling roots: the layers an opaque module calls, exported once per group of identical siblings.

A module that runs its own code (opaque: transformers' output capturing with
``output_attentions=True``, a grad-mode change, ...) has each child it calls extracted on its own,
as the root of its own export, through its own dispatcher (see :mod:`.opaque`). Layer reuse inside
one export (:mod:`.reuse_plan`) cannot pair them, so 30 decoder layers meant 30 exports. Here the same
pairing is made across their dispatchers (``ExtractionOptions.reuse_layers``):

- :func:`plan_siblings` pairs the entries of one ``ModuleList`` the opaque module called once each,
  as :func:`.reuse_plan.plan` does (same classes, shapes and attributes except those that differ between
  all of them, such as ``layer_idx``);
- the representative (the first entry) is exported with those attributes watched
  (:class:`RootWatch`, :func:`.watched_attributes.reads_watched`; its cache layer index read as a
  :class:`~nnbridge.compat.transformers.cache_updates.CacheIndex`): reading one other than as
  ``Cache.update``'s layer index, or touching another cache layer, makes the export unshareable (recorded in
  :attr:`.programs.ProgramRecord.watched`), never different;
- a sibling called the same way as the representative (:class:`CallShape`: the same structure,
  non-tensor values and tensor dtypes and ranks; a transformers ``Cache`` whose own layer is in the
  state the representative's own layer was) builds its graphs from the representative's program
  (copies of its built graphs, :meth:`.building.GraphBuilder.from_shared`)
  over its own module (its parameters, buffers and op points) and reads and writes its own cache
  layer (:func:`.cache_rebinding.rebind_cache_state`); its shape guard is the representative's for the
  tensors the graphs read (:func:`sibling_guard`).

Anything else means the sibling is exported itself. Example::

    model(ids, output_attentions=True)   # model.model opaque: layers 1..29 built from layer 0's export
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ..guards.call_structure import (
    DimRule,
    ShapeGuard,
    alias_pattern,
    autocast_state,
    global_flags,
    memory_layout,
)
from ..guards.code_objects import is_plumbing
from .reuse_plan import CacheRebinding, cache_index, plan as reuse_plan
from .sibling_compare import entry_attributes, entry_structure, is_cache, layer_key, same
from ..graph.state import UntouchedLayers, state_keys
from ..compat.torch.pytree import pytree


@dataclass(frozen=True)
class RootWatch:
    """What a representative's export watches.

    Attributes:
        watched: ``[(module of its subtree, attribute)]`` whose values differ between the siblings.
        indices: ``(id(module), attribute)`` of those holding its cache layer index.
        index: its cache layer index (its one differing int value; None when there is not one).
    """

    watched: tuple[tuple[torch.nn.Module, str], ...]
    indices: frozenset[tuple[int, str]]
    index: int | None


@dataclass(frozen=True)
class SiblingLink:
    """How a sibling's dispatcher finds its representative.

    Attributes:
        representative: the representative's dispatcher (a ``GraphDispatcher``).
        index: the sibling's cache layer index (None when there is not one).
        distinct: ``(subtree path, attribute)`` of the attributes that may differ between them
            (``layer_idx``; the representative's export watched them).
    """

    representative: Any
    index: int | None
    distinct: frozenset[tuple[str, str]] = frozenset()

    def alike(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` is still its representative's sibling, as :func:`plan_siblings` found
        (checked again at each extraction: either module may have been changed since): the same
        classes, parameter and buffer shapes, and attribute values but for :attr:`distinct`."""
        (mine, structure), (theirs, rep_structure) = _profile(module), _profile(self.representative.module)
        if structure is None or structure != rep_structure or mine.keys() != theirs.keys():
            return False
        return all(same(mine[k], theirs[k]) for k in mine if k not in self.distinct)


def _profile(module: torch.nn.Module) -> tuple[dict[tuple[str, str], Any], Any]:
    """``module``'s attributes and structure as :func:`.reuse_plan.plan` compares them, without what a
    bridge or nnsight set on it (an in-place bridge overrides ``forward`` on the modules it linked,
    the representative's first)."""
    attributes = {k: v for k, v in entry_attributes(module).items() if not is_plumbing(v)}
    structure = entry_structure(module)
    if structure is None:
        return attributes, None
    own = {path: {name for (p, name) in attributes if p == path} for path, *_ in structure}
    return attributes, tuple((path, kind, params, buffers, tuple(n for n in names if n in own[path]), *rest)
                             for path, kind, params, buffers, names, *rest in structure)


@dataclass(frozen=True)
class CallShape:
    """What a call must share with the representative's for a sibling's graphs to be built from it.

    Attributes:
        key: the position or keyword of its one transformers ``Cache`` argument (None: no state).
        spec: the pytree spec of the call with the cache replaced by None.
        leaves: its leaves: tensors as ``(rank, dtype, device, requires_grad, layout)`` keys (their
            sizes are the shape guard's, see :func:`sibling_guard`), other values as themselves
            (compared with :func:`.sibling_compare.same`).
        cache: ``(type, settings, number of layers, own layer's state)`` of the cache, or None; the
            own layer's state is :func:`.sibling_compare.layer_key`'s with its tensors' sizes left out (its
            layer must be in the state the representative's was; the sizes are the shape guard's,
            so a decode step's longer layers are accepted as the representative's own would be).
        cache_spec: the cache's pytree spec (None without a cache).
        plain: positions, among the call's tensors in pytree order, of those outside the cache.
        own: positions of its own cache layer's tensors.
        own_keys: their keys among the cache's flattened children (how export's guard code
            addresses them: ``L['kwargs']['past_key_values'][4]``).
        count: how many tensors the call has (in the cache or not).
        aliases: :func:`~.call_structure.alias_pattern` of the tensors outside the cache followed by
            its own layer's (a graph bakes in which of its inputs are one tensor).
        sizes: every tensor's sizes, in the order of the call's tensors.
    """

    key: Any
    spec: Any
    leaves: tuple[Any, ...]
    cache: tuple[Any, ...] | None
    cache_spec: Any
    plain: tuple[int, ...]
    own: tuple[int, ...]
    count: int
    sizes: tuple[tuple[int, ...], ...]
    own_keys: tuple[Any, ...] = ()
    aliases: tuple[Any, ...] = ()

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any], index: int | None) -> CallShape | None:
        """The shape of ``module(*args, **kwargs)`` for cache layer ``index``; None when it has state
        other than one transformers ``Cache`` (with a list of layers, ``index`` among them)."""
        keys = state_keys(args, kwargs)
        if len(keys) > 1:
            return None
        key = keys[0] if keys else None
        cache = None
        if key is not None:
            cache = args[key] if isinstance(key, int) else kwargs[key]
            if not is_cache(cache) or index is None or index >= len(vars(cache)["layers"]):
                return None
            if isinstance(key, int):
                args = (*args[:key], None, *args[key + 1:])
            else:
                kwargs = {**kwargs, key: None}
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        described = tuple(("tensor", _sizeless(leaf)) if isinstance(leaf, torch.Tensor) else ("value", leaf)
                          for leaf in leaves)
        if cache is None:
            return cls(None, spec, described, None, None, tuple(range(len(tensors))), (), len(tensors),
                       tuple(tuple(t.shape) for t in tensors), aliases=alias_pattern(tensors))
        layers = vars(cache)["layers"]
        cache_leaves, cache_spec = pytree.tree_flatten(cache)
        cache_ids = {id(leaf) for leaf in cache_leaves if isinstance(leaf, torch.Tensor)}
        own_ids = [id(v) for v in vars(layers[index]).values() if isinstance(v, torch.Tensor)]
        # positions in the whole call's tensors (the order of its shape guard): the cache's
        # tensors are where the cache argument is, in its own flattening order
        whole = [leaf for leaf in pytree.tree_leaves(_put(args, kwargs, key, value=cache)) if isinstance(leaf,
                                                                                                         torch.Tensor)]
        plain = tuple(i for i, t in enumerate(whole) if id(t) not in cache_ids)
        own = tuple(i for i, t in enumerate(whole) if id(t) in own_ids)
        if len(plain) != len(tensors) or len(own) != len(own_ids):
            return None  # a tensor both in and outside the cache: no position mapping
        settings = tuple(sorted((n, v) for n, v in vars(cache).items() if n != "layers"))
        own_keys = tuple(_first_key(path) for path, leaf in pytree.tree_flatten_with_path(cache)[0]
                         if isinstance(leaf, torch.Tensor) and id(leaf) in own_ids)
        own_tensors = [v for v in vars(layers[index]).values() if isinstance(v, torch.Tensor)]
        return cls(key, spec, described, (type(cache), settings, len(layers), _sizeless_layer(layers[index])),
                   cache_spec, plain, own, len(whole), tuple(tuple(t.shape) for t in whole), own_keys,
                   alias_pattern(tensors + own_tensors))

    def matches(self, rep: CallShape) -> bool:
        """Whether a sibling called with this shape may take graphs built for ``rep``'s call."""
        if (self.key, self.spec, len(self.leaves), len(self.plain), len(self.own)) != \
                (rep.key, rep.spec, len(rep.leaves), len(rep.plain), len(rep.own)) or self.aliases != rep.aliases:
            return False
        for (kind, value), (rep_kind, rep_value) in zip(self.leaves, rep.leaves):
            if kind != rep_kind or (kind == "tensor" and value != rep_value) or (kind == "value" and not same(value, rep_value)):
                return False
        if (self.cache is None) != (rep.cache is None):
            return False
        if self.cache is None or rep.cache is None:
            return True
        kind, settings, layers, own = self.cache
        rep_kind, rep_settings, rep_layers, rep_own = rep.cache
        return (kind is rep_kind and layers == rep_layers and own == rep_own
                and [n for n, _ in settings] == [n for n, _ in rep_settings]
                and all(same(v, rv) for (_, v), (_, rv) in zip(settings, rep_settings)))


def call_mode() -> tuple[Any, ...]:
    """Grad mode, autocast state, default dtype, inference mode and deterministic algorithms now:
    graphs bake in what they were exported under (as in :func:`~.call_structure.structure_key`)."""
    return torch.is_grad_enabled(), autocast_state(), torch.get_default_dtype(), global_flags()


def _sizeless(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (tensor.dim(), tensor.dtype, tensor.device, tensor.requires_grad, memory_layout(tensor))


def _sizeless_layer(layer: Any) -> Any:
    """:func:`.sibling_compare.layer_key` of a cache layer, its tensors without their sizes."""
    key = layer_key(layer)
    if key is None:
        return None
    kind, entries = key
    tensors = {name: value for name, value in vars(layer).items() if isinstance(value, torch.Tensor)}
    return kind, tuple((name, ("tensor", _sizeless(tensors[name])) if name in tensors else value)
                       for name, value in entries)


def _first_key(path: tuple[Any, ...]) -> Any:
    """The first key of a pytree key path (the child of the flattened object holding the leaf)."""
    entry = path[0] if path else None
    return getattr(entry, "idx", getattr(entry, "key", getattr(entry, "name", None)))


def _put(args: tuple[Any, ...], kwargs: dict[str, Any], key: Any, *, value: Any) -> tuple[Any, Any]:
    if isinstance(key, int):
        return (*args[:key], value, *args[key + 1:]), kwargs
    return args, {**kwargs, key: value}


@dataclass
class SharedRoot:
    """A representative's extraction that siblings may build their graphs from.

    Attributes:
        record: its program record (:class:`~.programs.ProgramRecord`).
        shape: the :class:`CallShape` of the call it was extracted for.
        index: its cache layer index (None when it has none).
        path: its NodePath (shown as ``graph_meta.reused_from`` of the siblings' roots).
        mode: grad mode, autocast state, default dtype, inference mode and deterministic
            algorithms of its export (see :func:`call_mode`).
        input_spec: the pytree spec of its call: a sibling's graphs are built with it, so their
            inputs are cleaned as the representative's were (the root graph takes its module's
            arguments; flattened with the sibling's spec, the cache's other layers would shift
            the positions of later leaves).
        templates: ``{(submodule path, invocation): BuiltTemplate}``, its graphs as built; a
            sibling's are copies of them (see :meth:`.building.GraphBuilder.from_shared`).
    """

    record: Any
    shape: CallShape
    index: int | None
    path: str
    mode: Any
    input_spec: Any
    templates: dict[tuple[str, int], Any]


@dataclass
class SiblingPlan:
    """:func:`plan_siblings`' answer: ``{representative name: RootWatch}`` and ``{sibling name:
    (representative name, cache layer index, attributes that differ)}`` (names as the opaque
    module's callees; see :class:`SiblingLink`)."""

    watches: dict[str, RootWatch] = field(default_factory=dict)
    siblings: dict[str, tuple[str, int | None, frozenset[tuple[str, str]]]] = field(default_factory=dict)


def plan_siblings(module: torch.nn.Module, called_once: set[str]) -> SiblingPlan:
    """Pair the ``ModuleList`` entries among ``module``'s callees that its code called once each
    (``called_once``: paths such as ``layers.3``), as :func:`.reuse_plan.plan` pairs them in one export."""
    candidates = reuse_plan(module, set())
    result = SiblingPlan()
    pairs = {s: r for s, r in candidates.siblings.items() if s in called_once and r in called_once}
    for rep in set(pairs.values()):
        rep_module = module.get_submodule(rep)
        subtree = {id(sub) for sub in rep_module.modules()}
        index = cache_index(candidates, rep)
        indices = frozenset((id(rep_module.get_submodule(path) if path else rep_module), name)
                            for (path, name), value in candidates.distinct.get(rep, {}).items()
                            if type(value) is int and value == index)
        result.watches[rep] = RootWatch(tuple((m, n) for m, n in candidates.watched if id(m) in subtree), indices, index)
    for sibling, rep in pairs.items():
        result.siblings[sibling] = (rep, cache_index(candidates, sibling),
                                    frozenset(candidates.distinct.get(sibling, {})))
    return result


def rebinding(shape: CallShape, rep: SharedRoot, index: int | None) -> CacheRebinding | None:
    """How a sibling's graphs differ from the representative's (None without a cache)."""
    if shape.cache is None or rep.index is None or index is None:
        return None
    return CacheRebinding(rep.index, index, rep.shape.cache_spec, shape.cache_spec)


def sibling_guard(rep_guard: ShapeGuard, rep: CallShape, shape: CallShape, *, tensors: list[torch.Tensor],
                  call: tuple[tuple[Any, ...], dict[str, Any]]) -> ShapeGuard | None:
    """The sizes a sibling's graphs accept, or None when they do not accept its call's: the
    representative's guard for the tensors they read (those outside the cache, and its own cache
    layer's, in place of the representative's own), any size for the cache's other layers, which
    they do not read (see :func:`.cache_rebinding.rebind_cache_state`), and export's own guards (they address
    the call by argument, as alike for both). When those guards address the cache, whose layers
    differ, they are rewritten to address the sibling's own layer where they address the
    representative's (its other layers are left as they are: conditions on the call the sibling's
    graphs do not read); when that cannot be done, only the representative's own sizes are
    accepted, and only when the sibling's call has them (exactly its call's sizes)."""
    mapped: dict[int, int] = {**dict(zip(shape.plain, rep.plain)), **dict(zip(shape.own, rep.own))}
    if len(rep_guard.dims) != rep.count or len(tensors) != shape.count:
        return None
    code = rep_guard.code
    if shape.key is not None and any(_mentions_argument(line, shape.key) for line in code):
        remapped = _own_layer_guards(code, shape.key, rep.own_keys, keys=shape.own_keys)
        if remapped is None:
            same_sizes = all(tuple(tensors[mine].shape) == rep.sizes[theirs] for mine, theirs in mapped.items())
            return ShapeGuard.static(tensors) if same_sizes else None
        code = remapped
    free = itertools.count()
    dims: list[list[DimRule]] = []
    for position, tensor in enumerate(tensors):
        if position in mapped:
            dims.append(list(rep_guard.dims[mapped[position]]))
        else:
            dims.append([(f"_other_layer_{next(free)}", 0, None) for _ in range(tensor.dim())])
    guard = ShapeGuard(dims, code)
    return guard if guard.matches(tensors, call) else None


def _own_layer_guards(code: list[str], key: Any, rep_keys: tuple[Any, ...], *, keys: tuple[Any,
                                                                                           ...]) -> list[str] | None:
    """Export's guard code with the representative's own cache layer's children (``rep_keys``,
    under argument ``key``) replaced by the sibling's (``keys``); None when the keys are not ints
    of equal number."""
    if len(rep_keys) != len(keys) or not all(type(k) is int for k in (*rep_keys, *keys)):
        return None
    prefix = re.escape(f"L['args'][{key}]" if isinstance(key, int) else f"L['kwargs'][{key!r}]")
    renamed = dict(zip(rep_keys, keys))
    child = re.compile("(" + prefix + r"\[)(\d+)(\])")

    def replace(match: re.Match[str]) -> str:
        index = int(match.group(2))
        return f"{match.group(1)}{renamed.get(index, index)}{match.group(3)}"
    return [child.sub(replace, line) for line in code]


def _mentions_argument(code: str, key: Any) -> bool:
    """Whether an export guard expression (over ``L['args']`` and ``L['kwargs']``) reads argument ``key``."""
    return f"L['args'][{key}]" in code if isinstance(key, int) else f"['{key}']" in code


def untouched_rebound(untouched: dict[str, list[UntouchedLayers | None]], rebound: CacheRebinding | None
                      ) -> dict[str, list[UntouchedLayers | None]]:
    """The representative's untouched cache layers (see :func:`~.state.states_returned`) as the
    sibling's: the layer its index selected is untouched by the sibling, whose own is not (unless
    the representative's own was; see :meth:`.reuse_plan.CacheRebinding.untouched`)."""
    if rebound is None:
        return untouched
    return {path: [UntouchedLayers(rebound.untouched(layers)) if layers is not None else None for layers in per]
            for path, per in untouched.items()}

