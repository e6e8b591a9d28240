"""The registry as the user built it while a bridged module's own code runs.

A bridge registers its op points (and their ``invocation_<k>`` containers) in the ``_modules`` of
the user's modules, so ``model.layer.add`` reaches one and ``named_modules()`` lists them. A
module's own code that walks its registry (``for child in self.children()``,
``len(list(self.named_modules()))``) would see them too when it runs over a bridged model: an
opaque module, a submodule called on its own, a trace that runs the model's code. While such code
runs, :func:`as_built` moves the op points of the module's tree out of ``_modules`` into each
holder's ``__dict__``: ``getattr`` (so a hook's ``model.layer.add``) still finds them, the
registry walks do not. Each goes back to its place in ``_modules`` after the run, also on error.
Example::

    with as_built(module):
        output = type(module).forward(module, x)  # module.children() yields the user's children only
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..compat.torch.module_dicts import modules_of
from ..graph.module_tree import POINT_TYPES


class _Moved:
    """One holder's op points moved out of its ``_modules`` (edited in place: guards hold it by
    identity), with the registry as it was, to put each back in its place."""

    def __init__(self, holder: torch.nn.Module, real: dict[str, torch.nn.Module | None],
                 points: dict[str, torch.nn.Module]) -> None:
        """Move ``holder``'s op points out; ``real`` and ``points`` split its registry as it is now
        (the rest and the op points, in order: :func:`_split`)."""
        registry = modules_of(holder)
        self.holder = holder
        self.before = dict(registry)
        self.points, self.real = points, real
        self.added = False  # (an op point registered while moved out: see add)
        registry.clear()
        registry.update(real)
        holder.__dict__.update(points)

    def add(self, name: str, point: torch.nn.Module) -> None:
        """Register ``point`` as ``name`` with the moved ones (after them once back)."""
        self.holder.__dict__[name] = point
        self.points[name] = point
        self.added = True

    def restore(self) -> None:
        own, registry = self.holder.__dict__, modules_of(self.holder)
        points = {name: point for name, point in self.points.items() if own.get(name) is point}
        for name in points:  # (one the run deleted or replaced stays as the run left it)
            del own[name]
        if not self.added and len(points) == len(self.points) and registry == self.real:
            registry.clear()
            registry.update(self.before)  # nothing changed (the usual case)
            return
        now = dict(registry)
        registry.clear()
        for name in self.before:
            if name in points:
                registry[name] = points.pop(name)
            elif name in now:
                registry[name] = now.pop(name)
        registry.update(now)  # children the run added
        registry.update(points)  # op points registered during the run


#: ids of the modules of the trees whose op points are moved out, while a run lasts (bridged calls
#: run one at a time per process: ``nnbridge.graph.locking.CALL_LOCK``)
_MEMBERS: set[int] = set()
#: ``{id(holder): its moved op points}``, while a run lasts
_MOVED: dict[int, _Moved] = {}


@contextlib.contextmanager
def as_built(module: torch.nn.Module) -> Iterator[None]:
    """Move the op points registered in ``module``'s tree out of every ``_modules`` for the body's
    duration (nothing to do for a tree a run already moved); put them back after, in their
    places, also on error."""
    if id(module) in _MEMBERS:
        yield
        return
    mine: dict[int, torch.nn.Module] = {}
    stack = [module]
    while stack:  # (one loop over the registries: this runs around every forward a trace makes)
        current = stack.pop()
        if id(current) in _MEMBERS or id(current) in mine:
            continue
        mine[id(current)] = current
        real, points = _split(modules_of(current))
        if points:
            _MOVED[id(current)] = _Moved(current, real, points)
        stack.extend(child for child in reversed(real.values()) if child is not None)
    _MEMBERS.update(mine)
    try:
        yield
    finally:
        _MEMBERS.difference_update(mine)
        for key in mine:
            moved = _MOVED.pop(key, None)
            if moved is not None:
                moved.restore()


def _split(registry: dict[str, torch.nn.Module | None]
           ) -> tuple[dict[str, torch.nn.Module | None], dict[str, torch.nn.Module]]:
    """``registry`` as ``(the user's entries, the op points and containers a bridge registered)``."""
    real: dict[str, torch.nn.Module | None] = {}
    points: dict[str, torch.nn.Module] = {}
    for name, child in registry.items():
        if isinstance(child, POINT_TYPES):
            points[name] = child
        else:
            real[name] = child
    return real, points


def registry(holder: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    """``holder``'s ``_modules`` with the op points a run moved out of it (what the user sees)."""
    moved = _MOVED.get(id(holder))
    return modules_of(holder) if moved is None else {**modules_of(holder), **moved.points}


def hidden(holder: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """The op point (or container) ``name`` of ``holder`` a run moved out, or None."""
    moved = _MOVED.get(id(holder))
    return None if moved is None else moved.points.get(name)


def register(holder: torch.nn.Module, name: str, point: torch.nn.Module) -> None:
    """Register ``point`` as ``holder``'s ``name``: in ``_modules``, or, while a run has moved
    ``holder``'s tree out, beside the moved ones (in ``_modules`` after the run)."""
    if id(holder) not in _MEMBERS:
        holder.add_module(name, point)
        return
    if id(holder) not in _MOVED:
        _MOVED[id(holder)] = _Moved(holder, *_split(modules_of(holder)))
    _MOVED[id(holder)].add(name, point)
