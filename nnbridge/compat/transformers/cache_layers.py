"""Which layers of a transformers ``Cache`` a module's own code touches while it is exported.

A graph bakes in the non-tensor state its code read (``layer.is_initialized``, a layer's sizes).
A cache layer the code never touched cannot have shaped the graph, so the check before each call
(:class:`~nnbridge.graph.state.SpecCheck`) need not compare it: a layer that an nnsight
``.skip()`` left unwritten, as in eager, then does not force a new extraction of every later
attention. This module records the touches: for the duration of :func:`layer_touches`, every
attribute access on a transformers cache layer (a ``CacheLayerMixin`` instance) goes through a
class-level ``__getattribute__`` that notes, per open :class:`Scope`, the layers it watches.

Accesses made by torch.export's own machinery (flattening a cache for a submodule call's preserved
signature) or by the caller's plumbing (nnbridge's state threading, named when a scope opens) are
not the module's code and are not counted; any other access is, whatever the caller (a
``tree_flatten`` of the cache in the module's own code counts, as do nested modules' accesses).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from .. import registry

try:
    from transformers.cache_utils import CacheLayerMixin
except ImportError:  # pragma: no cover - transformers is a dependency
    CacheLayerMixin = None  # type: ignore[assignment,misc]

#: A path into a state object (see :data:`nnbridge.graph.state.Path`).
Path = tuple[Any, ...]
#: Modules whose frames are export's machinery, not a module's code.
_MACHINERY = ("torch.export", "torch._export")
_SCOPES: list[Scope] = []
_SELECTED: list[int] = []  # the layer indices of the Cache.update calls running, see selected_layer


class Scope:
    """The cache layers of one module call's state arguments, and which of them its code touched.

    Attributes:
        paths: ``{id(layer): (state argument index, path)}`` of the layers watched.
        touched: ``(state argument index, path)`` of the layers touched.
        by_index: those touched, only, inside a ``Cache.update`` whose layer was selected by a
            module's layer index (see :func:`selected_layer`).
        frame: the frame that opened the scope; machinery is looked for below it only.
        machinery: module name prefixes whose frames are plumbing (export's, the caller's).
    """

    def __init__(self, paths: dict[int, tuple[int, Path]], frame: Any, machinery: tuple[str, ...]):
        self.paths, self.frame, self.machinery = paths, frame, machinery
        self.touched: set[tuple[int, Path]] = set()
        self.by_index: set[tuple[int, Path]] = set()


def _machinery(frame: Any, scope: Scope) -> bool:
    while frame is not None and frame is not scope.frame:
        if frame.f_globals.get("__name__", "").startswith(scope.machinery):
            return True
        frame = frame.f_back
    return False


def _getattribute(self: Any, name: str) -> Any:
    if _SCOPES:
        key = id(self)
        for scope in _SCOPES:
            where = scope.paths.get(key)
            if where is None or where in scope.touched or _machinery(sys._getframe(1), scope):
                continue
            if _SELECTED and where[1][-1:] == ((_SELECTED[-1],),):
                scope.by_index.add(where)
            else:
                scope.touched.add(where)
    return object.__getattribute__(self, name)


@contextlib.contextmanager
def selected_layer(index: int) -> Iterator[None]:
    """For the body's duration (a ``Cache.update`` whose ``layer_idx`` is a module's layer index),
    touches of the layer at item ``index`` count as :attr:`Scope.by_index`; other touches as usual."""
    _SELECTED.append(index)
    try:
        yield
    finally:
        _SELECTED.pop()


def watchable(value: Any) -> bool:
    """Whether ``value`` is a cache layer whose attribute accesses :func:`layer_touches` sees (a
    ``CacheLayerMixin`` whose class does not define its own ``__getattribute__``)."""
    return (CacheLayerMixin is not None and isinstance(value, CacheLayerMixin)
            and getattr(type(value), "__getattribute__", None) is _getattribute)


def layer_paths(value: Any, path: Path = (), seen: set[int] | None = None) -> Iterator[tuple[Path, Any]]:
    """``(path, layer)`` of every cache layer inside ``value`` (through lists, tuples, dicts and
    object attributes; a path step is an attribute name or a one-element tuple holding an item
    key, as :data:`nnbridge.graph.state.Path`)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    if CacheLayerMixin is not None and isinstance(value, CacheLayerMixin):
        yield path, value
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from layer_paths(item, (*path, (i,)), seen)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from layer_paths(item, (*path, (key,)), seen)
    elif hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module, torch.Tensor)):
        for name, item in vars(value).items():
            yield from layer_paths(item, (*path, name), seen)


@contextlib.contextmanager
def layer_touches() -> Iterator[None]:
    """For the body's duration, attribute accesses on cache layers are seen by open scopes
    (:func:`scope`). No-op without transformers or when ``CacheLayerMixin`` defines
    ``__getattribute__`` itself."""
    if CacheLayerMixin is None or "__getattribute__" in vars(CacheLayerMixin):  # off, or already on
        yield
        return
    with registry.replaced("cache_layer_touches", CacheLayerMixin, "__getattribute__", value=_getattribute):
        yield


@contextlib.contextmanager
def scope(states: list[Any], plumbing: tuple[str, ...] = ()) -> Iterator[Scope | None]:
    """Watch the cache layers of ``states`` (a call's state arguments) while the body runs.

    ``plumbing``: names of modules (prefixes) whose code touching the layers is the caller's
    plumbing, not the module's code (as export's own, which is always left out).

    Yields:
        the :class:`Scope` (read ``touched`` after the body), or None when a layer cannot be
        watched (recording is off, or its class overrides ``__getattribute__``): nothing may then
        be assumed untouched.
    """
    paths: dict[int, tuple[int, Path]] = {}
    for index, state in enumerate(states):
        for path, layer in layer_paths(state):
            if not watchable(layer):
                yield None
                return
            paths[id(layer)] = (index, path)
    opened = Scope(paths, sys._getframe(2), _MACHINERY + plumbing)
    _SCOPES.append(opened)
    try:
        yield opened
    finally:
        _SCOPES.remove(opened)
