"""Walk an extracted hierarchy by NodePath: children of a graph, resolution, example values.

A *graph* entry is a submodule graph (:class:`CompiledGraphModule` or :class:`OpaqueGraphModule`);
a *node* entry is a node with an op point (op, placeholder, parameter, output). Opaque modules list
their ``forward()`` arguments, then parameters and buffers, then children, then ``output``.
A compiled graph's nodes may also be reached by their variable aliases (:mod:`.aliases`): a
look-up by an alias gives the canonical name (canonical names and children always win).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.fx import Node

from .aliases import aliases_of, suggestion
from .graph_module import CompiledGraphModule, GraphModuleBase, OpaqueGraphModule
from .kinds import CONTAINERS

#: ``{id(compiled graph): {NodePath name: node}}``, filled as look-ups reach each graph; kept for one
#: batch of look-ups only (a graph edited later would make it stale)
NodeIndex = dict[int, dict[str, Node]]


def _opaque_children(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    for name, child in module.named_children():
        if isinstance(child, CONTAINERS):
            yield from _opaque_children(child, f"{prefix}{name}_")
        else:
            yield prefix + name, child


def children(module: GraphModuleBase) -> list[tuple[str, GraphModuleBase | None]]:
    """``(name, child graph or None for a node)`` in display order."""
    if isinstance(module, CompiledGraphModule):
        points = set(module.point_names)
        return [(name, module.child_graph(node) if node.op == "call_module" else None)
                for name, node in module.named_nodes() if node.op == "call_module" or name in points]
    assert isinstance(module, OpaqueGraphModule)
    names = list(module.point_names)
    kids: list[tuple[str, GraphModuleBase | None]] = [(n, None) for n in names[:-1]]
    kids += [(n, c) for n, c in _opaque_children(module) if isinstance(c, GraphModuleBase)]
    kids.append((names[-1], None))
    return kids


def child(module: GraphModuleBase, segment: str, *, aliases: bool = True,
          index: NodeIndex | None = None) -> tuple[str, GraphModuleBase | None] | None:
    """The child named ``segment`` (None when there is none), as ``(canonical name, child graph or
    None)``; with ``aliases``, a compiled graph's variable alias (``attn_weights_2``) names its node.
    ``index``: a :data:`NodeIndex` shared by look-ups that follow one another (see :func:`resolve_all`)."""
    found = _named_child(module, segment, index)
    if found is not None:
        return found
    if aliases and isinstance(module, CompiledGraphModule):
        target = aliases_of(module).get(segment)
        if target is not None:
            return child(module, target, aliases=False, index=index)
    return None


def _named_child(module: GraphModuleBase, segment: str, index: NodeIndex | None
                 ) -> tuple[str, GraphModuleBase | None] | None:
    """The entry of :func:`children` named ``segment``, or None. A compiled graph finds the node
    first and looks up only its child graph: building every entry would make the example
    recording run, which resolves each node's path, quadratic in the number of nodes."""
    if not isinstance(module, CompiledGraphModule):
        return next(((name, sub) for name, sub in children(module) if name == segment), None)
    if index is None:
        node = next((node for name, node in module.named_nodes() if name == segment), None)
    else:
        nodes = index.get(id(module))
        if nodes is None:
            nodes = index[id(module)] = dict(module.named_nodes())
        node = nodes.get(segment)
    if node is None:
        return None
    if node.op == "call_module":
        return segment, module.child_graph(node)
    return (segment, None) if segment in module.point_names else None


def deepest(module: GraphModuleBase, segments: tuple[str, ...]) -> tuple[GraphModuleBase | None, list[str], int] | None:
    """For a path that does not resolve: ``(the graph its longest resolvable prefix names, or None
    when that prefix is a node; the prefix's NodePath segments; the index of the first segment
    after it)``; None when the whole path resolves."""
    for known in range(len(segments) - 1, -1, -1):
        resolved = split_segments(module, segments[:known])
        if resolved is None:
            continue
        current: GraphModuleBase | None = module
        for segment in resolved:
            found = child(current, segment) if current is not None else None
            current = found[1] if found is not None else None
        return current, resolved, known
    return None


def alias_hint(module: GraphModuleBase, segments: tuple[str, ...], prefix: str = "") -> str:
    """For a path that does not resolve: a ``" Did you mean ...?"`` naming the aliases close to
    the first unknown segment, in the graph the longest resolvable prefix names (see
    :func:`.aliases.suggestion`); ``""`` when there is none. ``prefix``: ``module``'s own NodePath,
    put before the suggested paths."""
    found = deepest(module, segments)
    if found is None or found[0] is None:
        return ""
    current, resolved, known = found
    where = ".".join([p for p in (prefix, *resolved) if p])
    return suggestion(current, segments[known], where)


def walk(module: GraphModuleBase, prefix: str = "") -> Iterator[tuple[str, GraphModuleBase, str, GraphModuleBase | None]]:
    """Every entry below ``module``: ``(path, owner, name, child graph or None)``, depth first."""
    for name, sub in children(module):
        path = f"{prefix}{name}"
        yield path, module, name, sub
        if sub is not None:
            yield from walk(sub, path + ".")


def split_segments(module: GraphModuleBase, segments: tuple[str, ...]) -> list[str] | None:
    """Map nnsight spelling onto NodePath segments (``h``, ``0`` -> ``h_0``); None if impossible."""
    out: list[str] = []
    current: GraphModuleBase | None = module
    i = 0
    while i < len(segments):
        if current is None:
            return None
        found = child(current, segments[i], aliases=False)
        if found is None and i + 1 < len(segments):
            joined = f"{segments[i]}_{segments[i + 1]}"
            found = child(current, joined, aliases=False)
            if found is not None:
                i += 1
        if found is None:  # a variable alias, after every canonical spelling
            found = child(current, segments[i])
        if found is None:
            return None
        out.append(found[0])
        current = found[1]
        i += 1
    return out


def resolve_all(module: GraphModuleBase, segments: list[str], index: NodeIndex | None = None
                ) -> list[tuple[GraphModuleBase, str]]:
    """``(owner, node name)`` for a node path in this tree and in every other extraction of the
    children of opaque modules on the way (their dispatchers may hold several). ``index``: pass one
    dict (``{}``) to a batch of calls over graphs that do not change meanwhile, so each graph's
    nodes are listed once (the example recording resolves every node of the model)."""
    head, rest = segments[0], segments[1:]
    found = child(module, head, index=index)
    if found is None:
        return []
    name, sub = found
    if not rest:
        return [(module, name)] if sub is None else []
    if sub is None:
        return []
    alternatives: list[GraphModuleBase] = [sub]
    if isinstance(module, OpaqueGraphModule):
        dispatcher = module.graph_meta.child_dispatchers.get(name)
        if dispatcher is not None:
            alternatives = [e.root for e in dispatcher.all_extractions()]
    return [hit for alt in alternatives for hit in resolve_all(alt, rest, index)]
