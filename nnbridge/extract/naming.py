"""NodePath names for the nodes of a cleaned graph, one name per node, unique per graph:

- placeholders after the ``forward()`` arguments (``hidden_states``, ``attention_mask``;
  ``args_0``... for ``*args`` entries);
- ``get_attr`` nodes after their attribute (``weight``, ``bias``); the constants export lifts and
  numbers across the whole model are numbered within the graph (``lifted_tensor_0``), so a module
  extracted alone names them as in a whole-model extraction;
- ops after the ATen op, numbered within the graph (``softmax``, ``add``, ``add_1``);
- submodule calls after the child (``h_0``; ``linear_0``/``linear_1`` when called twice);
- a name ``pg.graph``'s ``_shape``/``_code`` would shadow as graphpatch renames it (``sub_shape``, see
  :func:`~nnbridge.graph.node_path.unprotected_names`), in the NodePath only: the placeholder's
  target and the fx name stay the argument's name (a call by keyword still binds).

Each name is the node's :class:`~.metadata.NodeMeta` ``name`` and, made legal, its fx name.
Example::

    name_nodes(graph, type(module).forward, {call_node: "h_0"})
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from torch.fx import Graph, Node

from ..compat.torch.export import rename_nodes
from ..graph.metadata import update_node_meta
from ..graph.node_path import unprotected_names


#: export's names of the constants a forward creates (``torch.tensor(...)``), numbered model-wide
_NUMBERED_CONSTANT = re.compile(r"(lifted_tensor|_tensor_constant)_?\d+")


def op_base_name(node: Node) -> str:
    """ATen op name of a ``call_function`` node (``aten.add.Tensor`` -> ``add``)."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    name = getattr(target, "__name__", None) or str(target)
    return re.sub(r"\W", "_", name)


def _placeholder_names(graph: Graph, forward: Callable[..., Any]) -> dict[Node, str]:
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    if params and not inspect.ismethod(forward):
        params = params[1:]  # the class's forward: drop ``self`` (whatever it is called)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), "args")
    names: dict[Node, str] = {}
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        match = re.fullmatch(r"_positional_arg_(\d+)", str(node.target))
        if match:
            i = int(match.group(1))
            names[node] = positional[i].name if i < len(positional) else f"{varargs}_{i - len(positional)}"
        else:
            names[node] = str(node.target)
    return names


def name_nodes(graph: Graph, forward: Callable[..., Any], call_names: dict[Node, str]) -> None:
    """Give every node its per-graph NodePath name (its :class:`~.metadata.NodeMeta` ``name``) and a legal fx name.

    Args:
        graph: the graph to rename in place.
        forward: the original ``forward`` (for placeholder names).
        call_names: NodePath names already chosen for ``call_module`` nodes.
    """
    names: dict[Node, str] = {}
    used: set[str] = set()
    counts: Counter[str] = Counter()

    def unique(base: str) -> str:
        candidate = base if counts[base] == 0 else f"{base}_{counts[base]}"
        while candidate in used:
            counts[base] += 1
            candidate = f"{base}_{counts[base]}"
        counts[base] += 1
        used.add(candidate)
        return candidate

    placeholder_names = _placeholder_names(graph, forward)
    for node, name in placeholder_names.items():
        names[node] = unique(name)
        node.target = names[node]
    for node in graph.nodes:
        if node.op == "call_module":
            names[node] = unique(call_names[node])
        elif node.op == "get_attr":
            constant = _NUMBERED_CONSTANT.fullmatch(str(node.target))
            if constant is not None:  # export numbers constants across the model: number them per graph
                names[node] = unique(f"{constant.group(1)}_{counts[constant.group(1) + '#']}")
                counts[constant.group(1) + "#"] += 1
            else:
                names[node] = unique(str(node.target).replace(".", "_"))
    for node in graph.nodes:
        if node in names:
            continue
        names[node] = "output" if node.op == "output" else unique(op_base_name(node))
    for node, name in zip(names, unprotected_names(list(names.values()))):
        update_node_meta(node, name=name)
    rename_nodes(graph, names)
