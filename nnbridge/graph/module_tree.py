"""The module tree as extraction sees it: real submodules, reserved and aliased names.

Extraction walks the user's modules without the op points a bridge registered on them
(:func:`named_real_modules`), renames children whose names fx or ``pg.graph`` reserve
(:func:`reserved_names_renamed`, graphpatch mangled them too), hides second registrations of
one module object (:func:`aliases_hidden`) and a bridge's op points (:func:`op_points_hidden`) for
the duration of an export. Example::

    with reserved_names_renamed(model) as renamed, aliases_hidden(model), op_points_hidden(model):
        ...  # export model; renamed == {id(parent): {"graph_": "graph"}}
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch

from ..compat.torch.forwards import instance_forward
from ..compat.torch.module_dicts import modules_of
from ..errors import ExtractionError
from .graph_module import CompiledGraphModule
from .kinds import CONTAINERS
from .op_point import OpPoint, OpPointContainer

#: Names a child may not take in a graph module or in ``pg.graph``; such children get a trailing
#: ``_`` in NodePaths and as attributes (graphpatch mangled them too).
RESERVED_NAMES = frozenset(
    {"graph", "code", "_code", "_shape", "forward", "training", "output", "op_points"}
    | {name for name in dir(CompiledGraphModule) if not name.startswith("__")}
)
#: modules whose own code goes through their registrations (iteration, indexing, ``len``,
#: ``append``'s next index; ``ParametrizationList`` probes ``hasattr(self, str(i))``)
ITERATED = (*CONTAINERS, torch.nn.Sequential)
#: what a bridge registers on the user's modules: op points and their ``invocation_<k>`` containers
POINT_TYPES = (OpPoint, OpPointContainer)
#: the value type of a module's registry (``_modules``, ``_parameters``, ``_buffers``)
_V = TypeVar("_V")


def real_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and its submodules, without the op points a bridge registered on them."""
    return [m for _, m in named_real_modules(module)]


def named_real_modules(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """``named_modules()`` without op points and their per-invocation containers (as ``named_modules``
    without its memo: a module object under two parents comes once under each; depth first, in
    registration order). One loop over the registries, no nested generators: it runs before every
    nnsight trace and walks hundreds of op points, where nested ``named_children`` generators would
    be a visible share of a short trace."""
    stack = [(prefix, module)]
    while stack:
        path, current = stack.pop()
        yield path, current
        children: dict[int, tuple[str, torch.nn.Module]] = {}
        for name, child in modules_of(current).items():
            if child is not None and id(child) not in children and not isinstance(child, POINT_TYPES):
                children[id(child)] = (f"{path}.{name}" if path else name, child)
        stack.extend(reversed(children.values()))



def named_registrations(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """Every path a submodule is registered under (``named_modules(remove_duplicate=False)``
    without op points): one module object held at two entries of one container, or as
    ``self.linear`` and ``self.alias``, comes once per name; depth first, in registration order."""
    yield prefix, module
    for name, child in modules_of(module).items():
        if child is not None and not isinstance(child, POINT_TYPES):
            yield from named_registrations(child, f"{prefix}.{name}" if prefix else name)


def refuse_instance_forwards(module: torch.nn.Module, what: str,
                             modules: Iterable[tuple[str, torch.nn.Module]] | None = None, *, since: str = "") -> None:
    """Raise when a module of ``module``'s tree (or of ``modules``, its ``(path, module)`` pairs)
    has a ``forward`` set on the instance (``layer.mlp.forward = f``, see
    :func:`~nnbridge.compat.instance_forward`): extraction and the eager fallback run a module's
    class forward, so its graphs would compute what the class computes, not what the module
    computes (the bridged outputs would differ from eager without an error). Called before
    anything is extracted, and by a PatchableGraph over a plain model on every call (``since``
    then says the forward was set after it was built).

    Raises:
        ExtractionError: names the module, the function and the fix.
    """
    for path, child in named_real_modules(module) if modules is None else modules:
        found = instance_forward(child)
        if found is not None:
            name = getattr(found, "__qualname__", None) or type(found).__name__
            raise ExtractionError(
                f"{what}: module '{path or '<root>'}' ({type(child).__name__}) has its own forward set on the instance"
                f" ({name}){since}; nnbridge runs the class's forward ({type(child).__name__}.forward), so its graphs"
                " would not compute what the module computes. Put the function on a subclass instead (module.__class__"
                " = a subclass of its class defining forward), or remove it (del module.forward), then try again.")


def safe_name(name: str) -> str:
    """``name`` with a trailing ``_`` when it is reserved (``graph`` -> ``graph_``)."""
    return f"{name}_" if name in RESERVED_NAMES else name


@contextlib.contextmanager
def reserved_names_renamed(module: torch.nn.Module) -> Iterator[dict[int, dict[str, str]]]:
    """Rename children whose names are reserved (``graph`` -> ``graph_``) for the body's duration.

    ``torch.export.unflatten`` cannot hold a submodule called ``graph`` and a GraphModule cannot
    hold one called ``_code``. The child moves to the safe key in ``_modules`` while an instance
    attribute keeps ``self.graph`` working in the module's own code. Yields
    ``{id(parent): {safe name: original name}}``; restores everything on exit, also on error.

    Raises:
        ExtractionError: the safe name is already taken by another child.
    """
    renamed: list[tuple[torch.nn.Module, str, str]] = []
    try:
        for parent in real_modules(module):
            for name in [n for n in modules_of(parent) if n in RESERVED_NAMES]:
                safe = safe_name(name)
                if safe in modules_of(parent):
                    raise ExtractionError(
                        f"{type(parent).__name__} has children named both {name!r} and {safe!r}; nnbridge renames"
                        f" {name!r} (reserved) to {safe!r} in NodePaths. Rename one of them.")
                child = modules_of(parent)[name]
                _rename_key(modules_of(parent), name, safe)  # in its place: registration order is kept
                parent.__dict__[name] = child
                renamed.append((parent, name, safe))
        mapping: dict[int, dict[str, str]] = {}
        for parent, name, safe in renamed:
            mapping.setdefault(id(parent), {})[safe] = name
        yield mapping
    finally:
        for parent, name, safe in reversed(renamed):
            parent.__dict__.pop(name, None)
            _rename_key(modules_of(parent), safe, name)  # the child keeps its place (state_dict order)


def _rename_key(store: dict[str, _V], old: str, new: str) -> None:
    """Rename key ``old`` of ``store`` to ``new`` in place, keeping its position."""
    items = list(store.items())
    store.clear()
    for key, value in items:
        store[new if key == old else key] = value


def reorder(store: dict[str, _V], order: list[str]) -> None:
    """Reorder ``store`` in place: the keys in ``order`` first, in that order, then the others."""
    items = dict(store)
    store.clear()
    for name in [n for n in order if n in items] + [n for n in items if n not in order]:
        store[name] = items[name]


@contextlib.contextmanager
def op_points_hidden(module: torch.nn.Module) -> Iterator[None]:
    """Take the op points (and their ``invocation_<k>`` containers) a bridge registered in
    ``module``'s tree out of every ``_modules`` for the body's duration, so the tree is the one the
    user built; put each back in its place on exit, also on error (each registry is edited in
    place: guards hold it by identity).

    For an export of a module already bridged for another call structure. torch.export walks the
    whole module tree several times (non-strict export snapshots and compares every submodule's
    attributes around the trace, ``_detect_attribute_assignment``), and a bridged SmolLM2-135M has
    3,878 op points among its 4,275 modules, so with them in the tree those walks are a sizeable
    share of the export of a new call structure (``output_attentions=True``). The module's code
    never reaches an op point (their names avoid its attributes), so the traced code is the same.
    """
    hidden: list[tuple[dict[str, torch.nn.Module | None], list[str], dict[str, torch.nn.Module]]] = []
    seen: set[int] = set()  # a module under two parents is walked under each
    for _, current in named_real_modules(module):
        registry = modules_of(current)
        if id(registry) in seen:
            continue
        seen.add(id(registry))
        points: dict[str, torch.nn.Module] = {name: child for name, child in registry.items()
                                              if isinstance(child, POINT_TYPES)}
        if points:
            hidden.append((registry, list(registry), points))
    try:
        for registry, _, points in hidden:
            for name in points:
                del registry[name]
        yield
    finally:
        for registry, order, points in reversed(hidden):
            for name, point in points.items():
                registry.setdefault(name, point)
            reorder(registry, order)


@contextlib.contextmanager
def aliases_hidden(module: torch.nn.Module, *, in_containers: bool = False) -> Iterator[None]:
    """Hide every further registration of a module object (``self.alias = self.linear``, or one
    child shared by two parents) from ``_modules`` for the body's duration.

    torch.export (2.13, non-strict) traces a model with shared submodules through attribute
    proxies whose paths break when a forward is overridden on the instance (``KeyError: 'linear'``
    in its tracepoint pass), as extraction's threading of stateful arguments does; a tree holding a
    shared module at a container entry is exported with no override and no alias hidden instead
    when it can be (see :mod:`nnbridge.extract.shared_names`). The hidden name stays an instance attribute, so the module's code
    still reaches the child through it; export then knows the child by its first name only, and
    every call of it, under any name, is an invocation of that name (``linear_0``, ``linear_1``).
    Restores every registration in its place on exit, also on error.

    A ModuleList/ModuleDict/Sequential entry is hidden only with ``in_containers``: iterating a
    container (and a Sequential's forward) goes through its registrations, so this is for the
    export call alone, whose container owners and such Sequentials are stubbed (see
    :func:`shared_container_entries`).
    """
    hidden: list[tuple[torch.nn.Module, str, torch.nn.Module, list[str]]] = []
    seen = {id(module)}

    def visit(parent: torch.nn.Module) -> None:
        for name, child in list(modules_of(parent).items()):
            if child is None or isinstance(child, POINT_TYPES):
                continue
            if id(child) in seen and (in_containers or not isinstance(parent, ITERATED)):
                hidden.append((parent, name, child, list(modules_of(parent))))
                del modules_of(parent)[name]
                parent.__dict__[name] = child
                continue
            seen.add(id(child))
            visit(child)
    try:
        visit(module)
        yield
    finally:
        for parent, name, child, order in reversed(hidden):
            parent.__dict__.pop(name, None)
            modules_of(parent)[name] = child
            reorder(modules_of(parent), order)


def direct_callees(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """Children a module's forward can call, looking through ModuleList/ModuleDict containers.

    Every registration counts: a container holding one module object at two entries yields both
    (iterating the container runs it twice), unlike ``named_children()``.
    """
    for name, child in modules_of(module).items():
        if child is None or isinstance(child, POINT_TYPES):
            continue
        if isinstance(child, CONTAINERS):
            yield from direct_callees(child, f"{prefix}{name}.")
        else:
            yield prefix + name, child


class SharedModuleEntry(ExtractionError):
    """Why a module runs opaque: its container holds a module object registered twice (see
    :func:`shared_container_entries`)."""

    #: what the error (with ``error_on_compilation_failure``) tells the user to do
    FIX = ("Give each container entry its own module object (to share weights, call one module twice"
           " from forward instead), or set error_on_compilation_failure=False to run this module opaque"
           " (its children are still extracted). Called without stateful arguments, such a module is"
           " extracted with a graph per name each call went through, as graphpatch did (migration: the"
           " graphpatch guide, docs/graphpatch.md, 'A ModuleList/ModuleDict holding one module object"
           " twice').")


def shared_container_entries(module: torch.nn.Module) -> dict[str, str]:
    """``{fqn: reason}`` for each module whose ModuleList/ModuleDict holds a module object that is
    registered more than once in ``module``'s tree (``nn.ModuleList([block, other, block])``), and
    for each Sequential that holds one (``nn.Sequential(linear, relu)`` where ``self.linear`` is the
    same object, or ``nn.Sequential(block, block)``). The reason names the registrations.

    Iterating, indexing and ``len()`` of a container go through its registrations, so hiding a
    repeated one from export (:func:`aliases_hidden`) would change what the module runs: such a
    tree is exported with every name kept (:mod:`nnbridge.extract.shared_names`), or, when a call
    passes a stateful argument, these modules run opaque, their children extracted one by one
    (each entry its own invocation).
    """
    registrations: dict[int, list[str]] = {}
    for fqn, sub in named_real_modules(module):
        for name, child in modules_of(sub).items():
            if child is not None and not isinstance(child, POINT_TYPES):
                registrations.setdefault(id(child), []).append(f"{fqn}.{name}" if fqn else name)
    found: dict[str, str] = {}
    for fqn, sub in named_real_modules(module):
        if isinstance(sub, CONTAINERS):
            continue
        if isinstance(sub, torch.nn.Sequential):
            # its forward iterates its own registrations: a hidden one would not run at all
            for name, child in modules_of(sub).items():
                paths = registrations.get(id(child), [])
                if len(paths) > 1 and fqn not in found:
                    found[fqn] = (f"{' and '.join(repr(p) for p in paths)} are one module object, and"
                                  f" {fqn or '<root>'!r} is a Sequential, which runs every entry it holds")
            continue
        for name, child in direct_callees(sub):
            paths = registrations.get(id(child), [])
            if len(paths) > 1 and "." in name and fqn not in found:
                found[fqn] = (f"{' and '.join(repr(p) for p in paths)} are one module object, held in a"
                              f" {type(sub.get_submodule(name.rsplit('.', 1)[0])).__name__}")
    return found
