"""transformers' ``Cache.update`` taking a traced layer index, while a representative layer is exported.

Its one job: layer reuse (:mod:`nnbridge.extract.reuse_plan`) exports one representative of
sibling decoder layers called with a transformers ``Cache``, and a sibling's graph is its
representative's with the cache layer rebound (:mod:`nnbridge.extract.cache_rebinding`). That is
exact only if the representative's layer index (``layer_idx``) did nothing but select the cache
layer ``Cache.update`` writes. While the representative is exported, the index is read as a
:class:`CacheIndex`, and for the duration of :func:`cache_updates_traced` (the registry's
``cache_update_traced`` patch of ``Cache.update`` and of ``CacheLayerMixin.keys`` / ``.values``)
``Cache.update`` accepts one and records the update in a :class:`CacheTrace`; any other use of the
index or of the cache's layers is recorded too, and makes extraction fall back. Example::

    trace = CacheTrace()
    with cache_updates_traced(trace):
        cache.update(keys, values, CacheIndex(0, attention, "layer_idx", uses=trace.uses))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import registry
from . import cache_layers


class CacheIndex:
    """What reading a watched int attribute (``layer_idx``) gives while exporting a representative.

    Its only silent use is as the ``layer_idx`` argument of transformers' ``Cache.update`` (see
    :func:`cache_updates_traced`), which selects the cache layer a graph reads and writes, so a
    sibling's graph is its representative's with the layer rebound
    (:class:`~nnbridge.extract.reuse_plan.CacheRebinding`). Any other use (arithmetic, comparison,
    hashing, formatting, indexing, passing it to a torch op) is recorded in ``uses`` and makes
    extraction fall back to per-layer export; the value used is the real one, so export still
    finishes.
    """

    __slots__ = ("value", "owner", "name", "uses")

    def __init__(self, value: int, owner: torch.nn.Module, name: str, *, uses: list[str]):
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
        if stack.enter_context(registry.replaced("cache_update_traced", Cache, "update", value=update)):
            for name in names:
                stack.enter_context(registry.replaced("cache_update_traced", CacheLayerMixin, name,
                                                      value=_LayerState(name, trace)))
        yield
