"""NodePath names and metadata for the nodes a pass leaves in a graph.

nnbridge names nodes as extraction does (:mod:`nnbridge.extract.naming`): ops after the ATen op,
numbered within the graph when the name is taken (``relu``, ``relu_1``), module calls after the
child (``fused_0``), attributes after their target. After a pass:

- a node that was in the graph before keeps its name and metadata (a retargeted ``add`` that now
  computes ``mul`` is still ``add``);
- a node an ``fx.Transformer`` rebuilt from an old node gets the old node's metadata (its
  :class:`~nnbridge.graph.metadata.NodeMeta`, fx's ``val`` and ``stack_trace``, ...), so it keeps
  the old name too;
- a node copied with its metadata (``graph.node_copy``) keeps the copied name while no other node
  has it (a new ``call_module`` node is named after its child, as in extraction);
- every other node is new and is named by the rules above (never fx's ``relu_default``).

Example::

    carry_metadata({new_mul: old_add})
    name_nodes_after_pass(graph, kept={node: node.name for node in nodes_before})
"""

from __future__ import annotations

from collections.abc import Mapping

from torch.fx import Graph, Node

from ..compat.torch.export import rename_nodes
from ..extract.naming import op_base_name
from ..graph.metadata import NODE_META_KEY, NodeMeta, node_name, update_node_meta
from ..graph.node_path import unprotected_names


def carry_metadata(origins: dict[Node, Node]) -> None:
    """Give each rebuilt node (key) the metadata of the node it stands for (value); keys fx set on
    the new node that the old one lacks stay."""
    for new, old in origins.items():
        if new is old:
            continue
        merged = dict(old.meta)
        merged.update((key, value) for key, value in new.meta.items() if key not in old.meta)
        new.meta = merged


def _base_name(node: Node) -> str:
    if node.op == "call_function":
        return op_base_name(node)
    if node.op == "output":
        return "output"
    return str(node.target).replace(".", "_")


def name_nodes_after_pass(graph: Graph, kept: Mapping[Node, str]) -> list[Node]:
    """Name every node of ``graph`` that has no name yet (see the module docstring) and make fx's
    names follow; returns the nodes named here, in graph order.

    Args:
        graph: the graph after a pass.
        kept: ``{node: fx name}`` of the nodes that stand for a node of the graph before the pass
            (the old node's fx name): their names stay.
    """
    nodes = list(graph.nodes)
    kept_set = set(kept)
    taken = {name for node in nodes if node in kept_set and node.op != "output" for name in (node_name(node), kept[node])}
    names: dict[Node, str] = {}
    named: list[Node] = []
    counts: dict[str, int] = {}
    for node in nodes:
        if node in kept_set or node.op == "output":
            names[node] = "output" if node.op == "output" else node_name(node)
            continue
        meta = node.meta.get(NODE_META_KEY)
        if node.op == "call_module":  # a new child call is named after its child, whatever it copied
            node.meta[NODE_META_KEY] = meta = None
        base = meta.name if isinstance(meta, NodeMeta) else _base_name(node)
        candidate, number = base, counts.get(base, 0)
        while candidate in taken:
            number += 1
            candidate = f"{base}_{number}"
        counts[base] = number
        taken.add(candidate)
        names[node] = candidate
        named.append(node)
    final = dict(zip(names, unprotected_names(list(names.values()))))
    for node in named:
        update_node_meta(node, name=final[node])
    # fx's names: a kept node keeps its own (a placeholder keeps its argument's name); a new one its NodePath name
    rename_nodes(graph, {node: (kept[node] if node in kept_set else final.get(node, node.name)) for node in nodes})
    return named
