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
from ..graph.module_tree import POINT_TYPES, named_real_modules


class _Moved:
    """One holder's op points moved out of its ``_modules`` (edited in place: guards hold it by
    identity), with the registry as it was, to put each back in its place."""

    def __init__(self, holder: torch.nn.Module) -> None:
        registry = modules_of(holder)
        self.holder = holder
        self.before = dict(registry)
        self.points: dict[str, torch.nn.Module] = {name: child for name, child in self.before.items()
                                                   if isinstance(child, POINT_TYPES)}
        self.real = {name: child for name, child in self.before.items() if name not in self.points}
        registry.clear()
        registry.update(self.real)
        holder.__dict__.update(self.points)

    def add(self, name: str, point: torch.nn.Module) -> None:
        """Register ``point`` as ``name`` with the moved ones (after them once back)."""
        self.holder.__dict__[name] = point
        self.points[name] = point

    def restore(self) -> None:
        own = self.holder.__dict__
        points = {name: point for name, point in self.points.items() if own.get(name) is point}
        for name in points:  # (one the run deleted or replaced stays as the run left it)
            del own[name]
        registry = modules_of(self.holder)
        now = dict(registry)
        registry.clear()
        if now == self.real and points.keys() == self.points.keys() == self.before.keys() - now.keys():
            registry.update(self.before)  # nothing changed (the usual case)
            return
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
    for _, current in named_real_modules(module):
        if id(current) not in _MEMBERS and id(current) not in mine:
            mine[id(current)] = current
            if any(isinstance(child, POINT_TYPES) for child in modules_of(current).values()):
                _MOVED[id(current)] = _Moved(current)
    _MEMBERS.update(mine)
    try:
        yield
    finally:
        _MEMBERS.difference_update(mine)
        for key in mine:
            moved = _MOVED.pop(key, None)
            if moved is not None:
                moved.restore()


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
        _MOVED[id(holder)] = _Moved(holder)
    _MOVED[id(holder)].add(name, point)
