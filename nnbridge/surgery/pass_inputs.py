"""What a graph's inputs looked like on the example call, for fake propagation (:mod:`.fake_values`).

Extraction keeps export's metadata (``node.meta["val"]``, fake tensors) on a graph's ops, not on
the placeholders of the graphs unflattening made. A placeholder's metadata is found where its value
comes from: the argument its parent graph's ``call_module`` node passes (an op's ``val``, a
constant, a parameter, an item of another child's output, or the parent's own placeholder, looked
up in turn). An extraction's root has no caller: its inputs are the ones given (``root``: the call
it was extracted for, by argument name), or unknown. Example::

    inputs = recorded_inputs(layer_graph, parents)   # {"hidden_states": FakeTensor(...), "cache": None, ...}
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node
from torch.fx.node import map_aggregate

from ..compat.torch.fake_values import fake_mode
from ..compat.torch.symbolic import has_hint, symbolic_hint
from ..graph.graph_module import CompiledGraphModule
from .fake_values import UNKNOWN
from .pass_graphs import fetch

#: ``{id(child graph): (parent graph, the call_module node calling it)}``
Parents = dict[int, tuple[CompiledGraphModule, Node]]

_DEPTH = 64  # nesting of modules and item look-ups followed at most


def _arguments(call: Node, child: CompiledGraphModule) -> dict[str, Any]:
    placeholders = [n for n in child.graph.nodes if n.op == "placeholder"]
    bound: dict[str, Any] = {str(p.target): a for p, a in zip(placeholders, call.args)}
    bound.update(call.kwargs)
    return bound


def _recorded(node: Node, graph: CompiledGraphModule, parents: Parents, *, depth: int,
              root: Mapping[int, Mapping[str, Any]]) -> Any:
    if depth > _DEPTH:
        return UNKNOWN
    if "val" in node.meta:
        return node.meta["val"]
    if node.op == "get_attr":
        return fetch(graph, str(node.target))
    if node.op == "call_module":
        child = graph.child_graph(node)
        if isinstance(child, CompiledGraphModule):
            output = next(n for n in child.graph.nodes if n.op == "output")
            return _argument(output.args[0], child, parents, depth=depth + 1, root=root)
        return UNKNOWN
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], Node):
        container = _recorded(node.args[0], graph, parents, depth=depth + 1, root=root)
        try:
            return container[node.args[1]]  # a tuple, list or dict of values
        except (TypeError, KeyError, IndexError):
            return UNKNOWN
    if node.op == "placeholder" and id(graph) in parents:
        parent, call = parents[id(graph)]
        bound = _arguments(call, graph)
        if str(node.target) in bound:
            return _argument(bound[str(node.target)], parent, parents, depth=depth + 1, root=root)
        return node.args[0] if node.args else UNKNOWN
    if node.op == "placeholder" and str(node.target) in root.get(id(graph), {}):
        return _root_value(root[id(graph)][str(node.target)])
    return UNKNOWN


def _root_value(value: Any) -> Any:
    """An extraction input recorded as ``(sizes, dtype, device)`` as a fake tensor of those (no
    memory); any other value as is."""
    if isinstance(value, tuple) and len(value) == 3 and isinstance(value[1], torch.dtype):
        with fake_mode():
            return torch.empty(value[0], dtype=value[1], device=value[2])
    return value


def _argument(argument: Any, graph: CompiledGraphModule, parents: Parents, *, depth: int,
              root: Mapping[int, Mapping[str, Any]]) -> Any:
    return map_aggregate(argument, lambda a: _recorded(a, graph, parents, depth=depth, root=root)
                         if isinstance(a, Node) else a)


def recorded_inputs(graph: CompiledGraphModule, parents: Parents,
                    root: Mapping[int, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """``{placeholder target: recorded value}`` (export's fake tensors, constants, parameters;
    :data:`~.fake_values.UNKNOWN` where none was found) for ``graph``'s placeholders (``root``:
    ``{id(extraction root graph): its inputs on the call it was extracted for, by name}``)."""
    return {str(node.target): _recorded(node, graph, parents, depth=0, root=root or {})
            for node in graph.graph.nodes if node.op == "placeholder"}


def recorded_spec(value: Any) -> tuple[torch.Size, torch.dtype, torch.device] | None:
    """``(sizes, dtype, device)`` of a :func:`recorded_value`: a tensor whose sizes are known (a
    symbol's hint stands for it); None for anything else (:data:`~.fake_values.UNKNOWN` included)."""
    if isinstance(value, torch.Tensor) and all(has_hint(s) for s in value.shape):
        return torch.Size(symbolic_hint(s) for s in value.shape), value.dtype, value.device
    return None


def recorded_value(node: Node, graph: CompiledGraphModule, parents: Parents, *,
                   root: Mapping[int, Mapping[str, Any]] | None = None) -> Any:
    """The recorded value of one node of ``graph`` (see the module docstring; ``root``:
    ``{id(root graph): its inputs by name}``: a value, or ``(sizes, dtype, device)``),
    :data:`~.fake_values.UNKNOWN` when none was found."""
    return _recorded(node, graph, parents, depth=0, root=root or {})
