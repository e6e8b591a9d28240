"""Layer reuse (``ExtractionOptions.reuse_layers``): export one representative of identical sibling
layers and build every sibling's graph from the representative's.

Entries of one ``ModuleList`` (decoder layers) of the same classes, parameter and buffer shapes and
non-tensor attributes give the same graph up to parameter binding, provided they are called the
same way. This module decides which entries qualify (:func:`plan`, :func:`confirm`), stubs the
siblings while exporting (:func:`sibling_stub`: only the representative is traced), and makes sure
the trace could not depend on what differs between them: an attribute whose value differs between
entries of one class (``layer_idx``) is watched while exporting (:func:`reads_watched`) and any
read of it on a representative makes the extraction start again without reuse
(:class:`ReuseFallback`). A sibling's graph is then a copy of its representative's built graph,
made by :class:`~.building.GraphBuilder` over the sibling's own module (its parameters, buffers,
children, lifted constants, op points; :meth:`~.building.GraphBuilder.from_template`), or, when
no built graph fits (other state keys), a copy of its representative's unflattened graph built
again; either way its node names and NodePaths are those a full extraction gives.

Covered: siblings called once each, with the same call structure (equal non-tensor values, tensor
leaves of equal shape, dtype, device and ``requires_grad``, the same aliasing between them
(:func:`~.call_structure.alias_pattern`), the same symbolic shapes while
exporting), and either no stateful argument or one transformers ``Cache`` (``DynamicCache``,
``use_cache=True``) of which each sibling writes its own layer. For a cache, the differing int
attribute (``layer_idx``) is read as a :class:`CacheIndex`, allowed only as ``Cache.update``'s
layer index (:func:`cache_updates_traced`); the sibling's stub makes the same cache update on its
own layer (:func:`sibling_stub`), and the sibling's graphs read and write their own layer with
their own cache spec (:class:`CacheRebinding`, :func:`rebind_cache_state`). Any doubt means
per-layer export. Example::

    extract(model, (ids,), {}, ExtractionOptions(reuse_layers=True), ...)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.fx import Graph, Node

from ..guards.call_structure import alias_pattern, memory_layout
from ..graph.module_tree import named_real_modules
from ..graph.state import Path, UntouchedLayers, read_state, state_keys, write_state
from ..compat.transformers import cache_layers
from ..compat import registry
from ..compat.torch.module_dicts import MODULE_SLOTS, non_persistent_buffers_of
from ..compat.nnsight.source import NNSIGHT_STATE
from ..compat.torch.pytree import pytree
from ..compat.torch.symbolic import sizes_unified

_PRIMITIVES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
#: nn.Module's own bookkeeping, the call wrapper extraction installs on every module while it
#: runs (``_call_impl``, see :mod:`.locking`), a bridged module's copy hook (see :mod:`.copies`)
#: and nnsight's per-module wrapping state (one object per module, not read by the module's code:
#: counted as an attribute that differs, it made every nnsight-wrapped model's layers unshareable)
_MODULE_INTERNALS = MODULE_SLOTS | {"_call_impl", "__reduce_ex__", NNSIGHT_STATE}
_MISSING = object()


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

    def source(self, fqn: str) -> str:
        """The path whose graph ``fqn``'s is built from (``fqn`` itself outside siblings)."""
        for sibling, rep in self.siblings.items():
            if fqn == sibling or fqn.startswith(f"{sibling}."):
                return rep + fqn[len(sibling):]
        return fqn

    def sibling_of(self, fqn: str) -> str | None:
        """The sibling whose subtree holds ``fqn`` (None outside siblings)."""
        return next((s for s in self.siblings if fqn == s or fqn.startswith(f"{s}.")), None)

    def outside(self, stubs: dict[str, str]) -> ReusePlan:
        """The plan without the siblings inside (or equal to) a stubbed module: no graph of theirs
        is built from this export (an opaque module's children are extracted through their own
        dispatchers; a stubbed module is opaque), and their call signatures are missing from it
        (kept, they made extraction start again without reuse). A sibling whose representative
        alone is stubbed stays: its graph would be the stub's (see :func:`check_reused_export`)."""
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


def leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad, memory_layout(leaf))
    return ("value", leaf)


def _same_call(a: Any, b: Any) -> bool:
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    if spec_a != spec_b or len(leaves_a) != len(leaves_b):
        return False
    if alias_pattern([x for x in leaves_a if isinstance(x, torch.Tensor)]) != \
            alias_pattern([y for y in leaves_b if isinstance(y, torch.Tensor)]):
        return False  # the representative's graph bakes in its call's aliasing (one placeholder for a repeated tensor)
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if leaf_key(x) != leaf_key(y):
                return False
        elif not same(x, y):
            return False
    return True


def cache_index(plan: ReusePlan, entry: str) -> int | None:
    """The one int value of ``entry``'s attributes that differ between siblings (``layer_idx`` of
    the layer and of its attention), or None when there is not exactly one."""
    values = {v for v in plan.distinct.get(entry, {}).values() if type(v) is int}
    kinds = {type(v) for v in plan.distinct.get(entry, {}).values()}
    return next(iter(values)) if len(values) == 1 and kinds == {int} else None


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


def _same_cache_call(call: tuple[Any, Any], rep_call: tuple[Any, Any], index: int, rep_index: int
                     ) -> tuple[Any, Any] | None:
    """``(representative's cache spec, sibling's cache spec)`` when the two calls differ only in
    their cache argument's other layers: one ``Cache`` argument at the same key, of the same type
    and settings, layer ``index`` of the sibling's in the state of layer ``rep_index`` of the
    representative's; else None."""
    (a, k), (ra, rk) = call, rep_call
    keys, rep_keys = state_keys(a, k), state_keys(ra, rk)
    if keys != rep_keys or len(keys) != 1:
        return None
    key = keys[0]
    cache, rep_cache = (a[key], ra[key]) if isinstance(key, int) else (k[key], rk[key])
    if type(cache) is not type(rep_cache) or not is_cache(cache):
        return None
    layers, rep_layers = vars(cache)["layers"], vars(rep_cache)["layers"]
    if len(layers) != len(rep_layers) or index >= len(layers) or rep_index >= len(rep_layers):
        return None
    settings = {n: v for n, v in vars(cache).items() if n != "layers"}
    rep_settings = {n: v for n, v in vars(rep_cache).items() if n != "layers"}
    if settings.keys() != rep_settings.keys() or not all(same(settings[n], rep_settings[n]) for n in settings):
        return None
    if layer_key(layers[index]) != layer_key(rep_layers[rep_index]):
        return None

    def without(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if isinstance(key, int):
            return (*args[:key], None, *args[key + 1:]), kwargs
        return args, {**kwargs, key: None}
    if not _same_call(without(a, k), without(ra, rk)):
        return None
    return pytree.tree_flatten(rep_cache)[1], pytree.tree_flatten(cache)[1]


def confirm(module: torch.nn.Module, candidates: ReusePlan, calls: dict[str, list]) -> ReusePlan:
    """The candidates whose recorded calls allow reuse: the representative and the sibling called
    once each, with the same call structure and output structure, and either no stateful argument
    or one transformers ``Cache`` whose layer at the sibling's index (its one differing int
    attribute, ``layer_idx``) is in the state of the representative's layer at its own index
    (see :class:`CacheRebinding`)."""
    result = ReusePlan(distinct=candidates.distinct)
    for sibling, rep in candidates.siblings.items():
        mine, theirs = calls.get(sibling, []), calls.get(rep, [])
        if len(mine) != 1 or len(theirs) != 1:
            continue
        (a, k, out), (ra, rk, rout) = mine[0], theirs[0]
        if not _same_call(out, rout):
            continue
        if state_keys(a, k) or state_keys(ra, rk):
            index, rep_index = cache_index(candidates, sibling), cache_index(candidates, rep)
            if index is None or rep_index is None:
                continue
            specs = _same_cache_call((a, k), (ra, rk), index, rep_index)
            if specs is None:
                continue
            result.caches[sibling] = CacheRebinding(rep_index, index, *specs)
            result.siblings[sibling] = rep
        elif _same_call((a, k), (ra, rk)):
            result.siblings[sibling] = rep
    kept = [id(sub) for rep in result.representatives() for _, sub in named_real_modules(module.get_submodule(rep))]
    result.watched = [(m, n) for m, n in candidates.watched if id(m) in kept]
    return result


class CacheIndex:
    """What reading a watched int attribute (``layer_idx``) gives while exporting a representative.

    Its only silent use is as the ``layer_idx`` argument of transformers' ``Cache.update`` (see
    :func:`cache_updates_traced`), which selects the cache layer a graph reads and writes, so a
    sibling's graph is its representative's with the layer rebound (:class:`CacheRebinding`). Any
    other use (arithmetic, comparison, hashing, formatting, indexing, passing it to a torch op) is
    recorded in ``uses`` and makes extraction fall back to per-layer export; the value used is the
    real one, so export still finishes.
    """

    __slots__ = ("value", "owner", "name", "uses")

    def __init__(self, value: int, owner: torch.nn.Module, name: str, uses: list[str]):
        self.value, self.owner, self.name, self.uses = value, owner, name, uses

    def used(self, how: str) -> int:
        self.uses.append(f"{type(self.owner).__name__}.{self.name} ({how})")
        return self.value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.used(name), name)


def _forwarding(name: str) -> Callable[..., Any]:
    def method(self: CacheIndex, *args: Any) -> Any:
        args = tuple(a.used(name) if isinstance(a, CacheIndex) else a for a in args)
        return getattr(self.used(name), name)(*args)
    method.__name__ = name
    return method


for _name in ("__index__", "__int__", "__float__", "__complex__", "__bool__", "__hash__", "__str__", "__repr__",
              "__format__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__neg__", "__pos__",
              "__abs__", "__invert__", "__round__", "__trunc__", "__floor__", "__ceil__",
              *(f"__{op}__" for base in ("add", "sub", "mul", "truediv", "floordiv", "mod", "divmod", "pow",
                                         "lshift", "rshift", "and", "or", "xor")
                for op in (base, f"r{base}"))):
    setattr(CacheIndex, _name, _forwarding(_name))


@dataclass
class CacheTrace:
    """What :func:`cache_updates_traced` saw while exporting.

    Attributes:
        uses: disallowed uses of a :class:`CacheIndex` (any makes extraction fall back).
        updates: ``[(id(owner module), key_states, value_states, args, kwargs)]`` of each
            ``Cache.update`` a :class:`CacheIndex` selected the layer of, in call order.
    """

    uses: list[str] = field(default_factory=list)
    updates: list[tuple[int, Any, Any, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    #: whether a representative's subtree is running (set by the exporter)
    rep_active: Callable[[], bool] = lambda: False
    #: depth of ``Cache.update`` calls running
    updating: int = 0


class _LayerState:
    """A data descriptor standing in for a cache layer's ``keys`` / ``values`` instance attribute
    while exporting (values are the instances' own): an access while a representative runs, other
    than inside :func:`cache_updates_traced`'s ``Cache.update``, is recorded as a use of the cache
    beyond its own layer (a constant ``cache.layers[0].keys`` would read the same path in
    representative 0's graph as its own layer does, and must not be rebound)."""

    def __init__(self, name: str, trace: CacheTrace):
        self.name, self.trace = name, trace

    def note(self) -> None:
        if self.trace.updating == 0 and self.trace.rep_active():
            self.trace.uses.append(f"a cache layer's {self.name} outside Cache.update")

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        self.note()
        try:
            return obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj: Any, value: Any) -> None:
        self.note()
        obj.__dict__[self.name] = value


@contextlib.contextmanager
def cache_updates_traced(trace: CacheTrace) -> Iterator[None]:
    """For the body's duration, transformers' ``Cache.update(key_states, value_states, layer_idx)``
    accepts a :class:`CacheIndex` as ``layer_idx``: it runs with the real index and is recorded in
    ``trace.updates``, when the cache is a plain one whose layer exists already (no offloading, no
    layer appended, ``update`` not overridden); otherwise the index counts as used. A cache layer's
    ``keys`` or ``values`` touched while a representative runs (``trace.rep_active``) outside such
    an update counts as a use too (see :class:`_LayerState`)."""
    try:
        from transformers.cache_utils import Cache, CacheLayerMixin
    except ImportError:  # pragma: no cover
        yield
        return
    original = Cache.__dict__["update"]

    def update(self: Any, key_states: Any, value_states: Any, layer_idx: Any, *args: Any, **kwargs: Any) -> Any:
        selected: Any = contextlib.nullcontext()
        if isinstance(layer_idx, CacheIndex):
            index = layer_idx.value
            layers = vars(self).get("layers")
            if (type(self).update is not update or getattr(self, "offloading", True)
                    or not isinstance(layers, list) or index >= len(layers)):
                index = layer_idx.used("Cache.update of a cache that appends, offloads or overrides update")
            else:
                trace.updates.append((id(layer_idx.owner), key_states, value_states, args, kwargs))
                selected = cache_layers.selected_layer(index)  # a sibling's graph touches its own layer here
            layer_idx = index
        trace.updating += 1
        try:
            with selected:
                return original(self, key_states, value_states, layer_idx, *args, **kwargs)
        finally:
            trace.updating -= 1

    names = [n for n in ("keys", "values") if n not in vars(CacheLayerMixin)]
    with contextlib.ExitStack() as stack:
        if stack.enter_context(registry.replaced("cache_update_traced", Cache, "update", update)):
            for name in names:
                stack.enter_context(registry.replaced("cache_update_traced", CacheLayerMixin, name, _LayerState(name, trace)))
        yield


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


class _Watched:
    """A class attribute standing in for instance attribute ``name`` while exporting: values are
    the instances' own; a read or write on a watched instance is recorded."""

    def __init__(self, name: str, original: Any, watched: set[int], reads: list[str],
                 indices: frozenset[tuple[int, str]] = frozenset()):
        self.name, self.original, self.watched, self.reads = name, original, watched, reads
        self.indices = indices

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            if self.original is _MISSING:
                raise AttributeError(self.name)
            return self.original
        values = obj.__dict__
        if id(obj) in self.watched:
            if (id(obj), self.name) in self.indices:  # a cache layer index: see CacheIndex
                return CacheIndex(values[self.name], obj, self.name, self.reads)
            self.reads.append(f"{type(obj).__name__}.{self.name}")
        if self.name in values:
            return values[self.name]
        if self.original is not _MISSING:
            getter = getattr(type(self.original), "__get__", None)
            return getter(self.original, obj, type(obj)) if getter is not None else self.original
        return type(obj).__getattr__(obj, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        if id(obj) in self.watched:
            self.reads.append(f"{type(obj).__name__}.{self.name} (written)")
        obj.__dict__[self.name] = value


@contextlib.contextmanager
def reads_watched(watched: list[tuple[torch.nn.Module, str]], indices: frozenset[tuple[int, str]] = frozenset()
                  ) -> Iterator[list[str]]:
    """Record reads of the watched instance attributes for the body's duration (their classes get
    a stand-in class attribute, removed after; values read are unchanged). A read of one of
    ``indices`` (``(id(module), attribute)``: a representative's cache layer index, see
    :func:`cache_indices`) gives a :class:`CacheIndex`, whose uses other than selecting the cache
    layer are recorded as reads."""
    reads: list[str] = []
    by_class: dict[tuple[type, str], set[int]] = {}
    for sub, name in watched:
        by_class.setdefault((type(sub), name), set()).add(id(sub))
    with contextlib.ExitStack() as stack:
        for (cls, name), ids in by_class.items():
            original = cls.__dict__.get(name, _MISSING)
            if original is not _MISSING and hasattr(type(original), "__set__"):
                raise ReuseFallback(f"{cls.__name__}.{name} is a data descriptor")
            inherited = _MISSING
            for base in cls.__mro__[1:]:
                if name in base.__dict__:
                    inherited = base.__dict__[name]
                    break
            watched_attribute = _Watched(name, original if original is not _MISSING else inherited, ids, reads, indices)
            stack.enter_context(registry.replaced("reuse_reads_watched", cls, name, watched_attribute))
        yield reads


def _without(args: tuple[Any, ...], kwargs: dict[str, Any], keys: list[Any]) -> tuple[Any, Any]:
    """The call with its state arguments (positions or keywords ``keys``) replaced by None."""
    positional, keywords = list(args), dict(kwargs)
    for key in keys:
        if isinstance(key, int):
            positional[key] = None
        else:
            keywords[key] = None
    return tuple(positional), keywords


def _same_traced_layer(layer: Any, rep_layer: Any) -> bool:
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


@torch.library.custom_op("nnbridge::sibling_zeros", mutates_args=())
def sibling_zeros(inputs: list[torch.Tensor], size: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Zeros of ``size`` (ints or symbolic sizes) and ``dtype`` on ``inputs[0]``'s device that
    export records as depending on every tensor of ``inputs``: one graph node, where
    ``new_zeros`` plus ``0 * t.sum()`` for each input would take three per input, which a deep
    model's many sibling stubs make a large share of its export (see :func:`sibling_stub`). Only
    sibling stubs and stubbed modules (:func:`~.recording.stub_output`) call it, while exporting; their graphs
    are replaced by their representative's or by opaque modules, so it never runs in a graph
    nnbridge calls. Gradients: none (``None`` for every input)."""
    return inputs[0].new_zeros(size, dtype=dtype)


@sibling_zeros.register_fake
def _sibling_zeros_fake(inputs: list[torch.Tensor], size: list[int], dtype: torch.dtype) -> torch.Tensor:
    return inputs[0].new_zeros(size, dtype=dtype)


def _sibling_zeros_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.inputs = len(inputs[0])


def _sibling_zeros_backward(ctx: Any, grad: torch.Tensor) -> tuple[list[None], None, None]:
    return [None] * ctx.inputs, None, None


sibling_zeros.register_autograd(_sibling_zeros_backward, setup_context=_sibling_zeros_context)


def sibling_stub(sibling: str, rep: str, seen: dict[str, tuple[Any, Any]], rebinding: CacheRebinding | None = None,
                 trace: CacheTrace | None = None, rep_modules: frozenset[int] = frozenset()) -> Callable[..., Any]:
    """What a sibling's ``forward`` is while exporting: outputs shaped as the representative's
    (traced just before, in ``seen``), as zeros depending on the sibling's inputs. With a cache
    (``rebinding``) the stub also makes the cache updates the representative made
    (``trace.updates`` of the modules ``rep_modules``) on its own cache layer, with zeros of the
    same shapes, so later layers and the model's output see the cache state the real layer
    would leave; a tensor an update takes besides keys and values (transformers 5.24 passes the
    attention's ``position_ids``) must be one of the representative's inputs, and the sibling's
    update takes its own input in its place. Raises :class:`ReuseFallback` when the sibling's
    inputs differ from the representative's (symbolic shapes, dtypes, values, its cache layer's
    state), an update takes another tensor, or an output's shape cannot be taken from an input."""
    def stub(*args: Any, **kwargs: Any) -> Any:
        if rep not in seen:
            raise ReuseFallback(f"'{sibling}' ran before '{rep}'")
        (rep_inputs, rep_output) = seen[rep]
        keys, rep_keys = state_keys(args, kwargs), state_keys(*rep_inputs)
        if keys != rep_keys or (keys and (rebinding is None or len(keys) != 1)):
            raise ReuseFallback(f"'{sibling}' is called with other state arguments than '{rep}'")
        caches = []
        if keys:
            assert rebinding is not None
            key = keys[0]
            cache = args[key] if isinstance(key, int) else kwargs[key]
            rep_cache = rep_inputs[0][key] if isinstance(key, int) else rep_inputs[1][key]
            if (type(cache) is not type(rep_cache) or not is_cache(cache)
                    or len(cache.layers) != len(rep_cache.layers) or rebinding.index >= len(cache.layers)
                    or not _same_traced_layer(cache.layers[rebinding.index],
                                              rep_cache.layers[rebinding.rep_index])):
                raise ReuseFallback(f"'{sibling}''s cache layer is not in the state '{rep}''s was")
            caches.append(cache)
            rep_output = rep_output[0]  # a threaded call returns (output, [new states]), see .state
        leaves, spec = pytree.tree_flatten(_without(args, kwargs, keys))
        rep_leaves, rep_spec = pytree.tree_flatten(_without(rep_inputs[0], rep_inputs[1], keys))
        if spec != rep_spec or len(leaves) != len(rep_leaves):
            raise ReuseFallback(f"'{sibling}' is called with another structure than '{rep}'")
        for mine, theirs in zip(leaves, rep_leaves):
            if isinstance(mine, torch.Tensor) != isinstance(theirs, torch.Tensor):
                raise ReuseFallback(f"'{sibling}' is called with other values than '{rep}'")
            if isinstance(mine, torch.Tensor):
                if (str(tuple(mine.shape)) != str(tuple(theirs.shape)) or mine.dtype != theirs.dtype
                        or mine.device != theirs.device):
                    raise ReuseFallback(f"'{sibling}' is called with other shapes than '{rep}'")
            elif not same(mine, theirs):
                raise ReuseFallback(f"'{sibling}' is called with other values than '{rep}'")
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        rep_tensors = [t for t in rep_leaves if isinstance(t, torch.Tensor)]
        if not tensors:
            raise ReuseFallback(f"'{sibling}' has no tensor input")
        depends_on = list(tensors)  # what every made value depends on (see sibling_zeros)

        def sizes(out: torch.Tensor) -> list[Any]:
            """``out``'s sizes, each read off the sibling's input that has it in the representative's call."""
            found: list[Any] = []
            for size in out.shape:
                if not isinstance(size, torch.SymInt):
                    found.append(int(size))
                    continue
                for mine, theirs in zip(tensors, rep_tensors):
                    dims = [d for d, s in enumerate(theirs.shape) if str(s) == str(size)]
                    if dims:
                        found.append(mine.shape[dims[0]])
                        break
                else:
                    raise ReuseFallback(f"a cache update of '{rep}' has a size no input has: {size}")
            return found

        def zeros(out: torch.Tensor) -> torch.Tensor:
            return sibling_zeros(depends_on, sizes(out), out.dtype)

        if caches:
            assert rebinding is not None and trace is not None
            updates = [u for u in trace.updates if u[0] in rep_modules]
            own = {id(theirs): mine for mine, theirs in zip(tensors, rep_tensors)}

            def own_input(value: torch.Tensor) -> torch.Tensor:
                # transformers >= 5.24 passes the attention's kwargs (position_ids) to the update
                if id(value) not in own:
                    raise ReuseFallback(f"a cache update of '{rep}' takes tensors besides keys, values and its inputs")
                return own[id(value)]
            for _, key_states, value_states, extra_args, extra_kwargs in updates:
                extra_args, extra_kwargs = pytree.tree_map_only(torch.Tensor, own_input, (extra_args, extra_kwargs))
                written = caches[0].update(zeros(key_states), zeros(value_states), rebinding.index,
                                           *extra_args, **extra_kwargs)
                # the output depends on what was written, as the real layer's does (else export drops
                # the writes when nothing after reads them, and the caller's cache would lose them)
                depends_on.extend(t for t in pytree.tree_leaves(written) if isinstance(t, torch.Tensor))

        def like(out: torch.Tensor) -> torch.Tensor:
            shape = str(tuple(out.shape))
            for mine, theirs in zip(tensors, rep_tensors):
                if str(tuple(theirs.shape)) == shape:
                    return sibling_zeros([mine, *depends_on], list(mine.shape), out.dtype)
            raise ReuseFallback(f"an output of '{rep}' has no input's shape")
        return pytree.tree_map_only(torch.Tensor, like, rep_output)
    return stub


def copy_graph(graph: Graph, numbers: dict[Node, int]) -> tuple[Graph, dict[Node, int]]:
    """A copy of ``graph`` (node meta copied shallowly, as fx does) and the invocation numbers of
    its ``call_module`` nodes, carried over from ``numbers``."""
    memo: dict[Any, Any] = {None: None}  # fx's __deepcopy__ replaces an empty memo by its own
    copied = copy.deepcopy(graph, memo)
    return copied, {memo[n]: numbers[n] for n in graph.nodes if n in numbers}


class ReusedHolder:
    """Stands in for a sibling's unflattened invocation module: its own copy of the
    representative's graph; attributes (lifted constants, specs) looked up on the representative's."""

    def __init__(self, graph: Graph, source: Any):
        self.graph, self._source = graph, source

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_source"], name)


def placeholder_signature(graph: Graph) -> list[tuple[str, str]]:
    """Placeholder targets and the (symbolic) shapes export gave them."""
    result = []
    for node in graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            result.append((str(node.target), str(tuple(val.shape)) if isinstance(val, torch.Tensor) else type(val).__name__))
    return result


def check_reused_export(plan: ReusePlan, exported: torch.export.ExportedProgram, stubs: dict[str, str],
                        states: dict[str, list[list[Any]]]) -> None:
    """Raise :class:`ReuseFallback` unless the export kept the siblings interchangeable: no module
    of a representative's or sibling's subtree was stubbed or threads state, and every sibling's
    preserved call signature has its representative's input and output structure."""
    for fqn in stubs:
        if plan.covers(fqn):
            raise ReuseFallback(f"'{fqn}' is opaque")
    for fqn, keys in states.items():
        sibling = next((s for s in plan.siblings if fqn == s or fqn.startswith(f"{s}.")), None)
        if plan.covers(fqn) and any(keys) and (sibling is None or sibling not in plan.caches) \
                and not any(fqn == r or fqn.startswith(f"{r}.") for r in
                            {plan.siblings[s] for s in plan.caches}):
            raise ReuseFallback(f"'{fqn}' threads state")
    signatures = {entry.fqn: entry.signature for entry in exported.module_call_graph}
    for sibling, rep in plan.siblings.items():
        mine, theirs = signatures.get(f"model.{sibling}"), signatures.get(f"model.{rep}")
        if mine is None or theirs is None:
            raise ReuseFallback(f"'{sibling}' has another call signature than '{rep}'")
        in_spec, out_spec, rep_out_spec = mine.in_spec, mine.out_spec, theirs.out_spec
        rebinding = plan.caches.get(sibling)
        if rebinding is not None:  # the cache differs in its other layers; outputs: (output, [new states])
            in_spec = _substituted(in_spec, rebinding.spec, rebinding.rep_spec)
            if out_spec.num_children != 2 or rep_out_spec.num_children != 2 \
                    or out_spec.children()[1].num_children != rep_out_spec.children()[1].num_children:
                raise ReuseFallback(f"'{sibling}' has another call signature than '{rep}'")
            out_spec, rep_out_spec = out_spec.children()[0], rep_out_spec.children()[0]
        if in_spec != theirs.in_spec or out_spec != rep_out_spec:
            raise ReuseFallback(f"'{sibling}' has another call signature than '{rep}'")


def _substituted(spec: Any, old: Any, new: Any) -> Any:
    """``spec`` with every subtree equal to ``old`` replaced by ``new``."""
    if spec == old:
        return new
    if spec.is_leaf():
        return spec
    return pytree.TreeSpec(spec.type, spec.context, [_substituted(c, old, new) for c in spec.children()])


def _mentions(spec: Any, kind: type) -> bool:
    return isinstance(spec, pytree.TreeSpec) and (spec.type is kind or any(_mentions(c, kind) for c in spec.children()))


def _sizes_only(read: Node) -> dict[int, list[Node]]:
    """Positions of a :func:`~.state.read_state` node's values that are unused or only give
    symbolic sizes (``sym_size``), each with its ``getitem`` nodes (none when unused)."""
    getitems: dict[int, list[Node]] = {}
    only: dict[int, bool] = {}
    for user in read.users:
        if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)):
            return {}
        k = user.args[1]
        getitems.setdefault(k, []).append(user)
        only[k] = only.get(k, True) and all(
            u.op == "call_function" and str(getattr(u.target, "__name__", u.target)).startswith("sym_size")
            for u in user.users)
    return {k: getitems.get(k, []) for k in range(len(cast(tuple, read.args[2]))) if only.get(k, True)}


def _same_sizes(read: Node, getitems: list[Node], own: int) -> bool:
    """Whether every size read from ``getitems`` (values of another cache layer) equals, in the
    representative's export, the size of the value at position ``own`` (its own layer's, read at
    the same time), so the sibling may take it from its own layer. Sizes of other layers are equal
    to the own layer's only when the call began (the export's guards); layers updated before this
    one ran have grown since, so the other layer's size would be wrong for a later sibling."""
    mine = [u for u in read.users if u.args[1] == own]
    own_val = mine[0].meta.get("val") if mine else None
    if not isinstance(own_val, torch.Tensor):
        return False
    for getitem in getitems:
        for user in getitem.users:
            dim = user.args[1] if len(user.args) > 1 else None
            val = getitem.meta.get("val")
            if not isinstance(dim, int) or not isinstance(val, torch.Tensor) or val.dim() != own_val.dim() \
                    or str(val.shape[dim]) != str(own_val.shape[dim]):
                return False
    return True


def rebind_cache_state(gm: torch.fx.GraphModule, rebinding: CacheRebinding, name: str) -> None:
    """Make a sibling's graph module (built from its representative's graph) read and write its own
    cache layer: the state paths of its :func:`~.state.read_state` / :func:`~.state.write_state`
    nodes move from layer ``rep_index`` to ``index``, and their cache spec (checked before each
    call) becomes the sibling's. Recompiles ``gm``.

    Raises:
        ReuseFallback: the graph touches the cache otherwise (a whole-cache flatten or assignment,
            another layer, a spec other than the representative's at its call): only a full
            extraction would be exact.
    """
    kind = rebinding.rep_spec.type
    changed = False
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, str(node.target), None)
            if not _mentions(value, kind):
                continue
            if value != rebinding.rep_spec or any(
                    user.target not in (read_state, write_state) or user.args[1] is not node for user in node.users):
                raise ReuseFallback(f"'{name}' uses its cache other than by reading and writing its own layer")
            setattr(gm, str(node.target), rebinding.spec)
            changed = True
        elif node.op == "call_function" and node.target in (read_state, write_state):
            positions = (2,) if node.target is read_state else (3,)
            sizes_only = _sizes_only(node) if node.target is read_state else {}
            new_args = list(node.args)
            for i in positions:
                moved = []
                paths = list(node.args[i])
                for k, path in enumerate(paths):
                    if path and path[0] == "layers":
                        if len(path) >= 2 and path[1] == (rebinding.rep_index,):
                            path = ("layers", (rebinding.index,), *path[2:])
                        elif k in sizes_only and not any(getitem.users for getitem in sizes_only[k]):
                            pass  # read but unused: the graph does not depend on it
                        else:
                            # a size taken from another layer: the sibling takes it from its own
                            own = ("layers", (rebinding.rep_index,), *path[2:])
                            if k not in sizes_only or own not in paths \
                                    or not _same_sizes(node, sizes_only[k], paths.index(own)):
                                raise ReuseFallback(f"'{name}' reads or writes a cache layer other than its own:"
                                                    f" {path}")
                            path = ("layers", (rebinding.index,), *path[2:])
                    moved.append(path)
                new_args[i] = tuple(moved)
            if node.target is write_state and node.args[2]:
                raise ReuseFallback(f"'{name}' deletes parts of its cache")
            node.args = tuple(new_args)
            changed = True
        elif node.op == "call_function" and any(_mentions(a, kind) for a in node.args):
            raise ReuseFallback(f"'{name}' uses its cache other than by reading and writing its own layer")
    if changed:
        gm.recompile()
