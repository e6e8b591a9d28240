"""The compiled graphs of a PatchableGraph or a bridged model, by NodePath, and scope globs.

A *scope* is a glob over graph NodePaths: ``*`` matches within one segment (``model.layers_*``:
every decoder layer's graph, not the graphs inside it), ``**`` any run of segments (``**``: every
graph, the root included; ``model.layers_0.**``: every graph inside layer 0). Example::

    graphs = target_graphs(pg)                      # [("model.layers_0", graph), ...]
    scope_matches("model.layers_*", "model.layers_0")   # True
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PassCheckError
from ..graph.graph_module import CompiledGraphModule, GraphModuleBase, OpaqueGraphModule
from ..graph.hierarchy import children
from ..graph.node_path import from_module_path
from ..inplace.bridging import Bridge, bridge_of
from ..patching.patchable_graph import PatchableGraph
from .pass_inputs import Parents


def scope_pattern(scope: str) -> re.Pattern[str]:
    """The regular expression of a scope glob (see the module docstring).

    Raises:
        PassCheckError: ``scope`` is not a non-empty string (check ``argument``).
    """
    if not isinstance(scope, str) or not scope:
        raise PassCheckError(f"apply_passes: scope= must be a non-empty glob over graph NodePaths, such as"
                             f" 'model.layers_*' or '**'; got {scope!r}.", check="argument")
    parts = [re.escape(part).replace(r"\*", "[^.]*").replace(r"\?", "[^.]") for part in scope.split("**")]
    return re.compile(".*".join(parts))


def graph_path(graph: GraphModuleBase) -> str:
    """The NodePath of a graph (``""`` for an extraction's root over the whole model)."""
    return from_module_path(graph.graph_meta.node_path)


@dataclass
class Graphs:
    """The graphs of a target: ``[(NodePath, graph)]``, each graph once; the bridge over the
    model (None for a PatchableGraph over a plain model); each compiled child's caller; each
    extraction root's inputs on the call it was extracted for (``{id(root graph): {name: value}}``)."""

    graphs: list[tuple[str, CompiledGraphModule]]
    bridge: Bridge | None
    parents: Parents
    inputs: dict[int, dict[str, Any]]


def graphs_below(root: GraphModuleBase, seen: set[int], parents: Parents) -> Iterator[GraphModuleBase]:
    """``root`` and every graph below it (compiled and opaque, those of opaque children's own
    dispatchers too), each once (``seen``: ids already given); ``parents`` gets each compiled
    child's caller."""
    if id(root) in seen:
        return
    seen.add(id(root))
    yield root
    if isinstance(root, CompiledGraphModule):
        for node in root.graph.nodes:
            if node.op == "call_module":
                child = root.child_graph(node)
                parents.setdefault(id(child), (root, node))
                yield from graphs_below(child, seen, parents)
    elif isinstance(root, OpaqueGraphModule):
        for _, sub in children(root):
            if sub is not None:
                yield from graphs_below(sub, seen, parents)
        for holder in root.graph_meta.child_dispatchers.values():
            for extraction in holder.all_extractions():
                yield from graphs_below(extraction.root, seen, parents)


def target_graphs(target: object) -> Graphs:
    """Every compiled graph of ``target`` (a :class:`PatchableGraph` or a bridged model), in every
    extraction it holds (each call structure).

    Raises:
        PassCheckError: ``target`` is neither, or nothing is extracted yet (check ``argument``).
    """
    if isinstance(target, PatchableGraph):
        dispatcher = target._dispatcher
        bridge = bridge_of(dispatcher.module)
        dispatchers = list(bridge.dispatchers.values()) if bridge is not None and bridge.dispatcher is dispatcher \
            else [dispatcher]
        if bridge is not None and bridge.dispatcher is not dispatcher:
            bridge = None
    elif isinstance(target, torch.nn.Module) and bridge_of(target) is not None:
        bridge = bridge_of(target)
        assert bridge is not None
        dispatchers = list(bridge.dispatchers.values())
    else:
        raise PassCheckError(
            f"apply_passes: the target must be a PatchableGraph or a bridged model; got {type(target).__name__}."
            " Bridge the model first (nnbridge.bridge(model, *example_inputs)) or make a PatchableGraph(model,"
            " *example_inputs).", check="argument")
    seen: set[int] = set()
    parents: Parents = {}
    graphs = [(graph_path(graph), graph) for dispatcher in dispatchers for extraction in dispatcher.all_extractions()
              for graph in graphs_below(extraction.root, seen, parents) if isinstance(graph, CompiledGraphModule)]
    if not graphs:
        raise PassCheckError(
            f"apply_passes: {type(target).__name__} has no extracted graph yet (bridged without example inputs and"
            " never called); call it once, or bridge it with example inputs, before applying passes.", check="argument")
    inputs = {id(extraction.root): dict(extraction.inputs) for dispatcher in dispatchers
              for extraction in dispatcher.all_extractions()}
    return Graphs(graphs, bridge, parents, inputs)
