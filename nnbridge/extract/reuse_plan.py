"""Layer reuse (``ExtractionOptions.reuse_layers``): which sibling layers are built from a
representative's graph instead of being exported.

Its one job: the plan. Entries of one ``ModuleList`` (decoder layers) of the same classes,
parameter and buffer shapes and non-tensor attributes give the same graph up to parameter
binding, provided they are called the same way. This module decides which entries qualify
(:func:`plan`, compared by :mod:`.sibling_compare`; :func:`confirm` against their recorded calls)
and says so in a :class:`ReusePlan`; :class:`ReuseFallback` makes the extraction start again
without reuse. The rest of layer reuse, in the order extraction uses it:

- while exporting, the siblings are stubbed (:mod:`.sibling_stubs`: only the representative is
  traced), and an attribute whose value differs between entries of one class (``layer_idx``) is
  watched on the representatives (:mod:`.watched_attributes`, :func:`cache_indices`): any read of
  it makes the extraction start again without reuse;
- after exporting, :mod:`.reuse_export_check` checks that the export kept the siblings
  interchangeable;
- a sibling's graph is then a copy of its representative's built graph, made by
  :class:`~.building.GraphBuilder` over the sibling's own module (its parameters, buffers,
  children, lifted constants, op points; :meth:`~.building.GraphBuilder.from_template`), or, when
  no built graph fits (other state keys), a copy of its representative's unflattened graph built
  again (:mod:`.sibling_graphs`); either way its node names and NodePaths are those a full
  extraction gives.

Covered: siblings called once each, with the same call structure (equal non-tensor values, tensor
leaves of equal shape, dtype, device and ``requires_grad``, the same aliasing between them
(:func:`~.call_structure.alias_pattern`), the same symbolic shapes while
exporting), and either no stateful argument or one transformers ``Cache`` (``DynamicCache``,
``use_cache=True``) of which each sibling writes its own layer. For a cache, the differing int
attribute (``layer_idx``) is read as a :class:`~nnbridge.compat.transformers.cache_updates.CacheIndex`,
allowed only as ``Cache.update``'s layer index
(:func:`~nnbridge.compat.transformers.cache_updates.cache_updates_traced`); the sibling's stub
makes the same cache update on its own layer (:func:`~.sibling_stubs.sibling_stub`), and the
sibling's graphs read and write their own layer with their own cache spec (:class:`CacheRebinding`,
:func:`~.cache_rebinding.rebind_cache_state`). Any doubt means per-layer export. Example::

    extract(model, (ids,), {}, ExtractionOptions(reuse_layers=True), ...)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..graph.module_tree import named_real_modules
from ..graph.node_path import ModulePath
from ..graph.state import Path, UntouchedLayers, state_keys
from ..compat.torch.pytree import pytree
from .sibling_compare import Outline, entry_attributes, entry_structure, is_cache, layer_key, outline, same, same_outline


class ReuseFallback(Exception):
    """Reuse turned out unsafe for this call: extraction starts again with per-layer export."""


@dataclass(frozen=True)
class CacheRebinding:
    """How a sibling's graphs differ from its representative's when both are called with a
    transformers ``Cache`` (``past_key_values``, ``cache`` from 5.24) and each writes its own
    cache layer.

    Attributes:
        rep_index, index: the cache layer index (``layer_idx``) of the representative and of the
            sibling: state paths ``("layers", (rep_index,), ...)`` become ``("layers", (index,), ...)``.
        rep_spec, spec: the cache's pytree spec when the representative, and when the sibling, is
            called (in prefill, earlier layers are initialized): a graph's state spec ``rep_spec``
            becomes ``spec``.
    """

    rep_index: int
    index: int
    rep_spec: Any
    spec: Any

    def untouched(self, layers: UntouchedLayers) -> frozenset[Path]:
        """The cache layers the sibling's graph never touches, from its representative's
        (:class:`~.state.UntouchedLayers`): the one the representative's layer index selected is
        untouched by the sibling, whose own is untouched only if the representative's own was."""
        own, rep_own = ("layers", (self.index,)), ("layers", (self.rep_index,))
        paths = layers.paths | layers.by_index
        return paths if rep_own in layers.paths else paths - {own}


@dataclass
class ReusePlan:
    """Siblings and their representatives.

    Attributes:
        siblings: ``{sibling path: representative path}`` (paths from the extracted module).
        watched: ``[(module, attribute)]`` of the representatives' subtrees whose values differ
            between siblings: export must not read them.
    """

    siblings: dict[str, str] = field(default_factory=dict)
    watched: list[tuple[torch.nn.Module, str]] = field(default_factory=list)
    #: ``{sibling: CacheRebinding}`` for siblings called with a transformers ``Cache``
    caches: dict[str, CacheRebinding] = field(default_factory=dict)
    #: ``{entry path: {(subtree path, attribute): value}}`` of the attributes that differ between siblings
    distinct: dict[str, dict[tuple[str, str], Any]] = field(default_factory=dict)

    def representatives(self) -> set[str]:
        return set(self.siblings.values())

    def source(self, fqn: ModulePath) -> ModulePath:
        """The path whose graph ``fqn``'s is built from (``fqn`` itself outside siblings)."""
        for sibling, rep in self.siblings.items():
            if fqn == sibling or fqn.startswith(f"{sibling}."):
                return ModulePath(rep + fqn[len(sibling):])
        return fqn

    def sibling_of(self, fqn: ModulePath) -> ModulePath | None:
        """The sibling whose subtree holds ``fqn`` (None outside siblings)."""
        return next((ModulePath(s) for s in self.siblings if fqn == s or fqn.startswith(f"{s}.")), None)

    def outside(self, stubs: dict[str, str]) -> ReusePlan:
        """The plan without the siblings inside (or equal to) a stubbed module: no graph of theirs
        is built from this export (an opaque module's children are extracted through their own
        dispatchers; a stubbed module is opaque), and their call signatures are missing from it
        (kept, they made extraction start again without reuse). A sibling whose representative
        alone is stubbed stays: its graph would be the stub's (see
        :func:`~.reuse_export_check.check_reused_export`)."""
        def inside(path: str) -> bool:
            return any(path == s or path.startswith(f"{s}.") for s in stubs)
        kept = {s: r for s, r in self.siblings.items() if not inside(s)}
        if kept == self.siblings:
            return self
        return ReusePlan(kept, self.watched, {s: c for s, c in self.caches.items() if s in kept}, self.distinct)

    def covers(self, fqn: str) -> bool:
        """Whether ``fqn`` is in (or is) a representative's or a sibling's subtree."""
        return any(fqn == root or fqn.startswith(f"{root}.")
                   for root in (*self.siblings, *self.siblings.values()))


def plan(module: torch.nn.Module, excluded: set[str]) -> ReusePlan:
    """Candidate siblings: entries of one ``ModuleList`` with the same structure and the same
    attributes, except attributes whose values differ between all of them (``layer_idx``), which
    are watched. Entries containing or inside an ``excluded`` path (skipped, custom, shared) are
    left out."""
    result = ReusePlan()
    for fqn, container in named_real_modules(module):
        if not isinstance(container, torch.nn.ModuleList) or len(container) < 2:
            continue
        entries = [(f"{fqn}.{name}" if fqn else name, child) for name, child in container.named_children()]
        entries = [(path, child) for path, child in entries
                   if not any(e == path or e.startswith(f"{path}.") or path.startswith(f"{e}.") for e in excluded)]
        by_structure: dict[Any, list[tuple[str, torch.nn.Module]]] = {}
        ids = [id(child) for _, child in entries]
        for path, child in entries:
            if ids.count(id(child)) > 1:
                continue  # a shared entry
            key = entry_structure(child)
            if key is not None:
                by_structure.setdefault(key, []).append((path, child))
        for group in by_structure.values():
            if len(group) < 2:
                continue
            values = [entry_attributes(child) for _, child in group]
            distinct = {k for k in values[0]
                        if all(not same(values[i][k], values[j][k])
                               for i in range(len(group)) for j in range(i + 1, len(group)))}
            classes: list[list[int]] = []
            for i in range(len(group)):
                for members in classes:
                    if all(same(values[i][k], values[members[0]][k]) for k in values[i] if k not in distinct):
                        members.append(i)
                        break
                else:
                    classes.append([i])
            for members in classes:
                if len(members) < 2:
                    continue
                rep_path, rep = group[members[0]]
                for i in members[1:]:
                    result.siblings[group[i][0]] = rep_path
                for i in members:
                    result.distinct[group[i][0]] = {k: values[i][k] for k in distinct}
                for path, name in sorted(distinct):
                    result.watched.append((rep.get_submodule(path) if path else rep, name))
    return result


def cache_index(plan: ReusePlan, entry: str) -> int | None:
    """The one int value of ``entry``'s attributes that differ between siblings (``layer_idx`` of
    the layer and of its attention), or None when there is not exactly one, or it is negative (a
    cache index names a layer from the front: ``cache.layers[-1]`` would be another layer)."""
    values = {v for v in plan.distinct.get(entry, {}).values() if type(v) is int}
    kinds = {type(v) for v in plan.distinct.get(entry, {}).values()}
    return next(iter(values)) if len(values) == 1 and kinds == {int} and min(values) >= 0 else None


@dataclass(frozen=True)
class CacheOutline:
    """The one stateful argument of a recorded call (see :class:`ComparedCall`) at the call.

    Attributes:
        key: its position in the args (int) or its keyword (str).
        kind: its type.
        layers: its number of cache layers; None when it is no transformers ``Cache`` with a
            list of layers.
        layer: :func:`~.sibling_compare.layer_key` of its layer at the call's cache index (see
            :func:`compared_call`); None when there is no such layer.
        settings: the :class:`~.sibling_compare.Outline` of its other attributes.
        spec: its pytree spec.
    """

    key: int | str
    kind: type
    layers: int | None
    layer: Any
    settings: Outline
    spec: Any


@dataclass(frozen=True)
class ComparedCall:
    """What :func:`confirm` compares of one call of a layer, taken while the layer runs (see
    :func:`compared_call`) and holding none of its tensors: a decoder layer's recorded inputs and
    outputs, kept for 30 layers, would hold every layer's hidden states until the run ends.

    Attributes:
        state: the call's stateful argument keys (:func:`~.state.state_keys`).
        inputs: the :class:`~.sibling_compare.Outline` of ``(args, kwargs)``, its one stateful
            argument (if one) replaced by None.
        cache: that stateful argument's :class:`CacheOutline`; None unless there is exactly one.
        output: the outline of the call's output.
    """

    state: tuple[Any, ...]
    inputs: Outline
    cache: CacheOutline | None
    output: Outline | None = None


def compared_call(index: int | None) -> Callable[[tuple[Any, ...], dict[str, Any]], Callable[[Any], ComparedCall]]:
    """For :func:`~.recording.record_calls`'s ``outlined``: a function taking ``args`` and
    ``kwargs`` as they are before a call (a cache is updated by it) and returning the function that
    completes the call's :class:`ComparedCall` with its output. ``index`` is the layer's cache index
    (:func:`cache_index`), the one cache layer whose state is compared; None for none."""
    def before(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[Any], ComparedCall]:
        keys = tuple(state_keys(args, kwargs))
        cache: CacheOutline | None = None
        inputs: Any = (args, kwargs)
        if len(keys) == 1:
            key = keys[0]
            value = args[key] if isinstance(key, int) else kwargs[key]
            layers = vars(value)["layers"] if is_cache(value) else None
            layer = None
            if layers is not None and index is not None and 0 <= index < len(layers):
                layer = layer_key(layers[index])
            settings = {n: v for n, v in getattr(value, "__dict__", {}).items() if n != "layers"}
            cache = CacheOutline(key, type(value), None if layers is None else len(layers), layer, outline(settings),
                                 pytree.tree_flatten(value)[1])
            inputs = ((*args[:key], None, *args[key + 1:]), kwargs) if isinstance(key, int) else (args, {**kwargs, key: None})
        call = ComparedCall(keys, outline(inputs), cache)
        return lambda output: replace(call, output=outline(output))
    return before


def _same_cache_call(call: ComparedCall, rep_call: ComparedCall, index: int, *, rep_index: int
                     ) -> tuple[Any, Any] | None:
    """``(representative's cache spec, sibling's cache spec)`` when the two calls differ only in
    their cache argument's other layers: one ``Cache`` argument at the same key, of the same type
    and settings, layer ``index`` of the sibling's in the state of layer ``rep_index`` of the
    representative's; else None."""
    cache, rep_cache = call.cache, rep_call.cache
    if call.state != rep_call.state or cache is None or rep_cache is None or cache.key != rep_cache.key:
        return None
    if cache.kind is not rep_cache.kind or cache.layers is None or rep_cache.layers is None:
        return None
    if cache.layers != rep_cache.layers or not (0 <= index < cache.layers and 0 <= rep_index < rep_cache.layers):
        return None
    if not same_outline(cache.settings, rep_cache.settings) or cache.layer is None or cache.layer != rep_cache.layer:
        return None
    if not same_outline(call.inputs, rep_call.inputs):
        return None
    return rep_cache.spec, cache.spec


def confirm(module: torch.nn.Module, candidates: ReusePlan, calls: dict[str, list[ComparedCall]]) -> ReusePlan:
    """The candidates whose recorded calls (:func:`compared_call`) allow reuse: the representative
    and the sibling called once each, with the same call structure and output structure, and either
    no stateful argument or one transformers ``Cache`` whose layer at the sibling's index (its one
    differing int attribute, ``layer_idx``) is in the state of the representative's layer at its
    own index (see :class:`CacheRebinding`)."""
    result = ReusePlan(distinct=candidates.distinct)
    for sibling, rep in candidates.siblings.items():
        mine, theirs = calls.get(sibling, []), calls.get(rep, [])
        if len(mine) != 1 or len(theirs) != 1:
            continue
        call, rep_call = mine[0], theirs[0]
        if call.output is None or rep_call.output is None or not same_outline(call.output, rep_call.output):
            continue
        if call.state or rep_call.state:
            index, rep_index = cache_index(candidates, sibling), cache_index(candidates, rep)
            if index is None or rep_index is None:
                continue
            specs = _same_cache_call(call, rep_call, index, rep_index=rep_index)
            if specs is None:
                continue
            result.caches[sibling] = CacheRebinding(rep_index, index, *specs)
            result.siblings[sibling] = rep
        elif same_outline(call.inputs, rep_call.inputs):
            result.siblings[sibling] = rep
    kept = [id(sub) for rep in result.representatives() for _, sub in named_real_modules(module.get_submodule(rep))]
    result.watched = [(m, n) for m, n in candidates.watched if id(m) in kept]
    return result


def cache_indices(plan: ReusePlan, module: torch.nn.Module) -> frozenset[tuple[int, str]]:
    """``(id(submodule), attribute)`` of the representatives' attributes that hold their cache
    layer index (the attributes that differ between siblings, all of the index's value, of
    representatives whose siblings are called with a cache)."""
    found = set()
    for sibling, rebinding in plan.caches.items():
        rep = plan.siblings[sibling]
        root = module.get_submodule(rep)
        for (path, name), value in plan.distinct.get(rep, {}).items():
            if type(value) is int and value == rebinding.rep_index:
                found.add((id(root.get_submodule(path) if path else root), name))
    return frozenset(found)
