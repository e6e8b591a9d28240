"""The copy of a graph that passes edit, and putting the edited graph in place of the live one.

Passes never touch a graph that runs. :func:`working_copy` gives them a plain ``fx.GraphModule``
over a copy of the live graph (node metadata copied, fx's shallow copy): its ``call_module``
targets are the live graph's child graphs, its ``get_attr`` targets the live graph's tensors
(shared, not copied). Only when every pass and check succeeded on every graph does
:func:`install` put the edited graph into the live :class:`~nnbridge.graph.graph_module.CompiledGraphModule`,
which regenerates its code; it returns the undo. Example::

    work = working_copy(live)
    replace_add_with_mul(work.module)
    undo = install(work, work.module, where="model.layers_0")
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from ..errors import PassCheckError
from ..graph.graph_module import CompiledGraphModule, GraphModuleBase
from ..graph.metadata import NODE_META_KEY, node_name
from .pass_naming import name_nodes_after_pass


def fetch(module: torch.nn.Module, target: str) -> Any:
    """The object a ``get_attr``/``call_module`` target names on ``module`` (dotted)."""
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


@dataclass
class WorkingCopy:
    """A live graph and the copy passes edit.

    Attributes:
        live: the graph that runs.
        module: the copy (a plain ``fx.GraphModule``).
        children: ``{id(child graph): the live graph's call_module target}``.
        attributes: ``{get_attr target: id(value)}`` of the live graph.
        nodes: ``{copy's node: live node}``.
    """

    live: CompiledGraphModule
    module: GraphModule
    children: dict[int, str]
    attributes: dict[str, int]
    nodes: dict[Node, Node]


def working_copy(live: CompiledGraphModule) -> WorkingCopy:
    """A :class:`WorkingCopy` of ``live`` (see the module docstring)."""
    memo: dict[Any, Any] = {None: None}  # fx's __deepcopy__ replaces an empty memo by its own
    graph = copy.deepcopy(live.graph, memo)
    root: dict[str, Any] = {}
    children: dict[int, str] = {}
    attributes: dict[str, int] = {}
    for node in live.graph.nodes:
        target = str(node.target)
        if node.op == "call_module":
            child = live.child_graph(node)
            root[target] = child
            children[id(child)] = target
        elif node.op == "get_attr":
            value = fetch(live, target)
            root[target] = value
            attributes[target] = id(value)
    module = GraphModule(root, graph, class_name="PassWorkingCopy")
    module.meta.update(live.meta)
    nodes = {memo[n]: n for n in live.graph.nodes if n in memo}
    nodes[next(n for n in graph.nodes if n.op == "output")] = next(n for n in live.graph.nodes if n.op == "output")
    return WorkingCopy(live, module, children, attributes, nodes)


def module_call_problem(work: WorkingCopy, module: GraphModule) -> str | None:
    """Why a ``call_module`` node of ``module`` (a pass's result) cannot stay, or None: each must
    call one of the live graph's children, or a plain ``fx.GraphModule`` made by the pass (a fused
    partition) without module calls of its own."""
    for node in module.graph.nodes:
        if node.op != "call_module":
            continue
        try:
            called = fetch(module, str(node.target))
        except AttributeError:
            return f"the call_module node {node_name(node)!r} calls {node.target!r}, which does not exist"
        if id(called) in work.children:
            continue
        if isinstance(called, GraphModuleBase):
            return (f"the call_module node {node_name(node)!r} calls another graph's child ({node.target!r}); a pass"
                    " may call the graph's own children only")
        if isinstance(called, GraphModule):
            inner = [node_name(n) for n in called.graph.nodes if n.op == "call_module"]
            if inner:
                return (f"the fused module {node.target!r} calls modules itself ({inner}); keep module calls out of"
                        " fused partitions (an OperatorSupport that refuses call_module nodes)")
            continue
        return (f"the call_module node {node_name(node)!r} calls a plain {type(called).__name__}, which nnbridge"
                " cannot extract inside a pass; insert modules with nnbridge.surgery's insert_after/insert_before"
                " (they register it as a child of the model), or call a function (call_function) instead")
    return None


def _free_name(module: torch.nn.Module, base: str) -> str:
    name, number = base, 0
    while hasattr(module, name):
        number += 1
        name = f"{base}_{number}"
    return name


def graph_child(called: GraphModule, where: str) -> CompiledGraphModule:
    """A plain ``fx.GraphModule`` a pass made (a fused partition) as an nnbridge child graph: its
    nodes named by nnbridge's rules, its NodePath ``where``."""
    root = {str(n.target): fetch(called, str(n.target)) for n in called.graph.nodes if n.op == "get_attr"}
    graph = called.graph
    name_nodes_after_pass(graph, kept={})
    child = CompiledGraphModule(root, graph, GraphModule)
    child.graph_meta.node_path = where
    return child


def install(work: WorkingCopy, result: GraphModule, *, where: str) -> Callable[[], None]:
    """Put ``result``'s graph (the passes' result on ``work.module``) in place of ``work.live``'s,
    regenerating its code; returns the undo (the old graph, children and attributes back, op
    points as they were).

    Raises:
        PassCheckError: a module call :func:`module_call_problem` refuses (nothing changed).
    """
    live = work.live
    problem = module_call_problem(work, result)
    if problem is not None:
        raise PassCheckError(f"{where or '<root>'}: {problem}.", graph=where, check="call_module")
    by_target = {target: fetch(work.module, target) for target in work.children.values()}
    made = live.named_op_points_made()
    old_graph, old_children, old_aliases = live.graph, live.graph_meta.graph_children, live.graph_meta.aliases
    added: list[str] = []
    retargets: list[tuple[Node, str]] = []
    children: dict[str, Any] = {}
    prefix = f"{where}." if where else ""
    for node in result.graph.nodes:
        if node.op == "call_module":
            called = fetch(result, str(node.target))
            if id(called) in work.children:
                retargets.append((node, work.children[id(called)]))
                children[node_name(node)] = by_target[work.children[id(called)]]
            else:
                name = _free_name(live, node_name(node))
                child = graph_child(called, prefix + node_name(node))
                live.add_module(name, child)
                added.append(name)
                retargets.append((node, name))
                children[node_name(node)] = child
        elif node.op == "get_attr":
            value = fetch(result, str(node.target))
            if work.attributes.get(str(node.target)) != id(value):  # made by the pass: the live graph gets it
                name = _free_name(live, str(node.target).replace(".", "_"))
                if isinstance(value, torch.Tensor):
                    live.register_buffer(name, value, persistent=False)
                else:
                    setattr(live, name, value)
                added.append(name)
                retargets.append((node, name))
    for node, target in retargets:
        node.target = target
    output = next(n for n in result.graph.nodes if n.op == "output")
    old_output = next(n for n in old_graph.nodes if n.op == "output")
    if NODE_META_KEY not in output.meta:  # a Transformer's new output node
        output.meta = {**old_output.meta, **output.meta}

    def undo() -> None:
        for name in added:
            delattr(live, name)
        _set_graph(live, old_graph)
        live.graph_meta.graph_children, live.graph_meta.aliases = old_children, old_aliases
        for name, point in made.items():  # the points of nodes the edit removed, with their hooks
            if name in live.point_names:
                live.share_point(name, point)

    try:
        _set_graph(live, result.graph)
        if old_children is not None:
            live.graph_meta.graph_children = children
        live.graph_meta.aliases = None  # computed again from the new graph on first use
    except BaseException:
        undo()
        raise
    return undo


def _set_graph(live: CompiledGraphModule, graph: Graph) -> None:
    """Make ``graph`` ``live``'s graph and regenerate its code (fx's ``graph`` setter recompiles)."""
    live.graph = graph
