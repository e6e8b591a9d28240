"""Descriptors installed on the model's own module classes while a representative layer is exported.

Its one job: record reads of the instance attributes whose values differ between sibling layers
(``layer_idx``), so that a representative's graph that depends on one is not reused for its
siblings (see :mod:`.reuse_plan`). For the duration of :func:`reads_watched` (the registry's
``reuse_reads_watched`` patch) each watched attribute's class gets a stand-in class attribute
(:class:`_Watched`) that returns the instance's own value and notes each read or write on a
watched instance; a representative's cache layer index is read as a
:class:`~nnbridge.compat.transformers.cache_updates.CacheIndex` instead. Example::

    with reads_watched([(model.layers[0].self_attn, "layer_idx")]) as reads:
        export(...)
    if reads: raise ReuseFallback(...)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..compat import registry
from ..compat.transformers.cache_updates import CacheIndex
from .reuse_plan import ReuseFallback

_MISSING = object()


class _Watched:
    """A class attribute standing in for instance attribute ``name`` while exporting: values are
    the instances' own; a read or write on a watched instance is recorded."""

    def __init__(self, name: str, original: Any, watched: set[int], *, reads: list[str],
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
                return CacheIndex(values[self.name], obj, self.name, uses=self.reads)
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
    :func:`~.reuse_plan.cache_indices`) gives a
    :class:`~nnbridge.compat.transformers.cache_updates.CacheIndex`, whose uses other than
    selecting the cache layer are recorded as reads."""
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
            watched_attribute = _Watched(name, original if original is not _MISSING else inherited, ids,
                                         reads=reads, indices=indices)
            stack.enter_context(registry.replaced("reuse_reads_watched", cls, name, value=watched_attribute))
        yield reads
