"""Copies of a representative layer's graphs for its siblings (layer reuse).

Its one job: the pieces :class:`~.building.GraphBuilder` builds a sibling's graph from when it
was not exported (see :mod:`.reuse_plan`): a copy of the representative's unflattened graph with
its invocation numbers (:func:`copy_graph`), held in place of the sibling's own unflattened
module (:class:`ReusedHolder`), and the placeholder signature that says whether a built graph
fits as a template (:func:`placeholder_signature`). Example::

    graph, numbers = copy_graph(rep_holder.graph, numbers)
    holder = ReusedHolder(graph, rep_holder)
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.fx import Graph, Node


def copy_graph(graph: Graph, numbers: dict[Node, int]) -> tuple[Graph, dict[Node, int]]:
    """A copy of ``graph`` (node meta copied shallowly, as fx does) and the invocation numbers of
    its ``call_module`` nodes, carried over from ``numbers``."""
    memo: dict[Any, Any] = {None: None}  # fx's __deepcopy__ replaces an empty memo by its own
    copied = copy.deepcopy(graph, memo)
    return copied, {memo[n]: numbers[n] for n in graph.nodes if n in numbers}


class ReusedHolder:
    """Stands in for a sibling's unflattened invocation module: its own copy of the
    representative's graph; attributes (lifted constants, specs) looked up on the representative's."""

    def __init__(self, graph: Graph, source: Any):
        self.graph, self._source = graph, source

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_source"], name)


def placeholder_signature(graph: Graph) -> list[tuple[str, str]]:
    """Placeholder targets and the (symbolic) shapes export gave them."""
    result = []
    for node in graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            result.append((str(node.target), str(tuple(val.shape)) if isinstance(val, torch.Tensor) else type(val).__name__))
    return result
