"""graphpatch's NodePath spelling of ``*args`` / ``**kwargs`` elements, resolved in compiled graphs.

For ``forward(self, x, *foos, blah=3, **bars)`` called as ``m(x, t0, t1, t2, a=ta, b=tb)``,
graphpatch 0.2.3 showed one placeholder per variadic parameter and dug into it: ``foos|sub_0``,
``foos|sub_1``, ``foos|sub_2``, ``bars|a``, ``bars|b`` (its ``VarargsModule`` snapshot). nnbridge's
opaque modules use that spelling already; a compiled graph has one placeholder per element instead,
named ``foos_0``, ``foos_1``, ``foos_2``, ``a``, ``b`` (torch.export flattens the call). Both
spellings resolve: :func:`canonical` maps graphpatch's onto the placeholder.

Example::

    pg = PatchableGraph(m, x, t0, t1, t2, a=ta, b=tb)
    with pg.patch({"foos|sub_1": ZeroPatch(), "bars|a": ZeroPatch()}):   # same as "foos_1", "a"
        pg(x, t0, t1, t2, a=ta, b=tb)

``pg.graph.foos.sub_1`` and ``pg.graph.bars.a`` (graphpatch's attribute spelling) are views of the
same elements (see :func:`variadic_elements`). Not supported in a compiled graph: the whole
``foos`` / ``bars`` container as one node (graphpatch's ``foos`` node): patch its elements.
"""

from __future__ import annotations

import inspect

import torch

from ..graph import hierarchy
from ..graph.graph_module import CompiledGraphModule, GraphModuleBase
from ..graph.node_path import NodePath, dig_key


def _owner(root: GraphModuleBase, segments: tuple[str, ...]) -> GraphModuleBase | None:
    prefix = hierarchy.split_segments(root, segments)
    if prefix is None:
        return None
    current: GraphModuleBase | None = root
    for segment in prefix:
        found = hierarchy.child(current, segment) if current is not None else None
        current = None if found is None else found[1]
    return current


def canonical(root: GraphModuleBase, node_path: NodePath) -> NodePath:
    """``node_path`` with a leading graphpatch-style dig into a variadic parameter of a compiled
    graph (``foos|sub_1``, ``layer.bars|a``) replaced by the element's placeholder (``foos_1``,
    ``layer.a``); any other path unchanged (including a target that does not exist, so the caller
    reports it). The rest of the dig is kept: ``foos|sub_0.sub_2`` -> ``foos_0|sub_2``."""
    if not node_path.dig:
        return node_path
    owner = _owner(root, node_path.nodes[:-1])
    name = node_path.nodes[-1]
    if not isinstance(owner, CompiledGraphModule) or hierarchy.child(owner, name) is not None:
        return node_path
    original_type: type[torch.nn.Module] = owner.original_type
    parameter = inspect.signature(original_type.forward).parameters.get(name)
    if parameter is None:
        return node_path
    key = dig_key(node_path.dig[0])
    if parameter.kind is inspect.Parameter.VAR_POSITIONAL and isinstance(key, int):
        target = f"{name}_{key}"
    elif parameter.kind is inspect.Parameter.VAR_KEYWORD and isinstance(key, str):
        target = key
    else:
        return node_path
    if hierarchy.child(owner, target) is None:
        return node_path
    return NodePath((*node_path.nodes[:-1], target), node_path.dig[1:])


def variadic_elements(owner: GraphModuleBase, name: str) -> list[tuple[str, str]] | None:
    """``[(graphpatch's dig key, element placeholder)]`` for the variadic parameter ``name`` of a
    compiled graph's ``forward`` (``[("sub_0", "foos_0"), ("sub_1", "foos_1")]`` for ``*foos``,
    ``[("a", "a")]`` for ``**bars`` called with ``a=``), or None when ``name`` is no such parameter
    or the graph is opaque (an opaque module has the ``foos`` node itself)."""
    if not isinstance(owner, CompiledGraphModule):
        return None
    try:
        parameter = inspect.signature(owner.original_type.forward).parameters.get(name)
    except (TypeError, ValueError):
        return None
    if parameter is None or parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        return None
    parameters = inspect.signature(owner.original_type.forward).parameters.values()
    placeholders = [str(node.target) for node in owner.graph.nodes if node.op == "placeholder"]

    def positional(var: str) -> list[str]:
        found: list[str] = []
        while f"{var}_{len(found)}" in placeholders:
            found.append(f"{var}_{len(found)}")
        return found

    if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
        return [(f"sub_{i}", target) for i, target in enumerate(positional(name))]
    taken = {p.name for p in parameters}
    for p in parameters:
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            taken.update(positional(p.name))
    return [(target, target) for target in placeholders if target not in taken]
