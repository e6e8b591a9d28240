"""Sites: the node of a graph an edit is made at, found from its NodePath before anything changes.

A site is named as ``pg.patch`` keys are: a NodePath (``model.layers_1.mlp.output``), its nnsight
spelling (``model.layers.1.mlp.output``) or a variable alias (``attn_weights_2``); an unknown one
gets the same explanation (the module runs eagerly, its attention implementation has no such op,
or the closest valid NodePaths). A module's own NodePath (``model.layers_1.mlp``) names its call
in the parent's graph. Example::

    site = resolve_site(target, "model.layers.1.mlp.output", what="insert_after")
    site.owner, site.name          # the LlamaMLP module, "output"
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import cast

import torch
from torch.fx import Node

from ..compat.torch.fake_tensors import fake_call
from ..compat.torch.hooks import cleared_module_state
from ..compat.torch.module_dicts import modules_of
from ..compat.torch.symbolic import has_hint, symbolic_hint
from ..errors import SurgeryError
from ..graph import hierarchy
from ..graph.graph_module import CompiledGraphModule, GraphModuleBase, OpaqueGraphModule
from ..graph.kinds import CONTAINERS
from ..graph.metadata import node_meta
from ..graph.node_path import NodePath
from ..patching import varargs_paths
from ..patching.patchable_graph import absence_message
from .targets import Target

#: ``(sizes, dtype, device)`` of a tensor value at a site.
Spec = tuple[torch.Size, torch.dtype, torch.device]


@dataclass(frozen=True)
class Site:
    """A node of the current extraction an edit is made at.

    Attributes:
        text: the site as asked (``model.layers.1.mlp.output``).
        path: its NodePath (``model.layers_1.mlp.output``).
        prefix: the NodePath of the graph holding it (``model.layers_1.mlp``; ``""``: the root).
        graph: that graph (in the most recent extraction).
        owner: the module that graph was extracted from (the edit's recipe is kept on it).
        owner_path: ``owner``'s torch path (``model.layers.1.mlp``).
        name: the node's name in the graph (``output``, ``softmax``; a module call: ``mlp``).
        node: the node.
    """

    text: str
    path: str
    prefix: str
    graph: CompiledGraphModule
    owner: torch.nn.Module
    owner_path: str
    name: str
    node: Node


def _opaque_child(module: torch.nn.Module, segment: str) -> tuple[str, torch.nn.Module] | None:
    """The child of ``module`` an opaque graph names ``segment`` (containers flattened with ``_``)."""
    def walk(holder: torch.nn.Module, prefix: str, path: str) -> tuple[str, torch.nn.Module] | None:
        for name, child in modules_of(holder).items():
            if child is None:
                continue
            if isinstance(child, CONTAINERS):
                found = walk(child, f"{prefix}{name}_", f"{path}{name}.")
                if found is not None:
                    return found
            elif prefix + name == segment:
                return f"{path}{name}", child
        return None
    return walk(module, "", "")


def resolve_site(target: Target, text: str, *, what: str) -> Site:
    """The site ``text`` names in ``target``'s most recent extraction.

    Raises:
        SurgeryError: ``text`` is no node (with the closest valid NodePaths), digs into a
            container value (``|``), or lies in a module that runs eagerly (opaque) or is called
            several times per forward; or nothing is extracted yet.
    """
    if not isinstance(text, str):
        raise SurgeryError(f"{what}: the site must be a NodePath string such as 'model.layers_1.mlp.output';"
                           f" got {type(text).__name__}.")
    root = target.root(what)
    node_path = varargs_paths.canonical(root, NodePath.parse(text))
    if node_path.dig:
        raise SurgeryError(f"{what}: site {text!r} digs into a container value with '|'; an edit takes a whole"
                           " tensor node. Pick the node that makes the element (see pg.graph), or insert after the"
                           " container's producer and unpack it in your module.")
    segments = hierarchy.split_segments(root, node_path.nodes)
    if segments is None or not segments:
        raise SurgeryError(f"{what}: " + absence_message(root, text, node_path.nodes, model=target.model)
                           + " Nothing was edited.")
    graph: GraphModuleBase = root
    module, module_path = target.model, ""
    for depth, segment in enumerate(segments[:-1]):
        where = ".".join(segments[:depth]) or "<root>"
        if isinstance(graph, CompiledGraphModule):
            call = graph.node(segment)
            child_path = node_meta(call).module_path or ""
            calls = [n for n in graph.graph.nodes if n.op == "call_module" and node_meta(n).module_path == child_path]
            if len(calls) > 1:
                raise SurgeryError(
                    f"{what}: site {text!r} lies in '{'.'.join(segments[:depth + 1])}', one of {len(calls)} calls of"
                    f" module '{child_path}' from '{where}' per forward; an edit applies to a module's every call."
                    f" Edit the calling graph instead (insert at '{'.'.join(segments[:depth + 1])}' itself).")
            graph, module = graph.child_graph(call), module.get_submodule(child_path)
            module_path = f"{module_path}.{child_path}" if module_path else child_path
        else:
            found = hierarchy.child(graph, segment)
            child = _opaque_child(module, segment)
            if found is None or found[1] is None or child is None:
                raise SurgeryError(f"{what}: " + absence_message(root, text, node_path.nodes, model=target.model))
            graph, (relative, module) = found[1], child
            module_path = f"{module_path}.{relative}" if module_path else relative
    if isinstance(graph, OpaqueGraphModule):
        where = ".".join(segments[:-1]) or "<root>"
        raise SurgeryError(
            f"{what}: site {text!r} is in '{where}' ({graph.original_type.__name__}), which runs eagerly (opaque:"
            f" {graph.reason}), so it has no graph to edit. Make it extract (see nnbridge.explain(model)), or edit"
            f" at its call instead: '{where}' as the site.")
    graph = cast(CompiledGraphModule, graph)  # not opaque: refused above
    name = segments[-1]
    node = graph.node(name)
    prefix = ".".join(segments[:-1])
    return Site(text, f"{prefix}.{name}" if prefix else name, prefix, graph, module, module_path, name, node)


def value_of(graph: GraphModuleBase, node: object) -> object:
    """Export's example value (``node.meta["val"]``, a fake tensor) of a node of ``graph``; a
    module call's is its graph's output value (unflatten keeps none on ``call_module`` nodes), an
    element of a call's tuple output the element's. None when unknown (a placeholder's, an
    opaque module's)."""
    if not isinstance(node, Node):
        return None
    value = node.meta.get("val")
    if value is not None or not isinstance(graph, CompiledGraphModule):
        return value
    if node.op == "call_module":
        child = graph.child_graph(node)
        if isinstance(child, CompiledGraphModule):
            output = next(n for n in child.graph.nodes if n.op == "output")
            return value_of(child, output.args[0])
        return _opaque_value(graph, node, child)
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], int):
        source = node.args[0]
        if isinstance(source, Node) and source.op == "call_module":
            child = graph.child_graph(source)
            if isinstance(child, CompiledGraphModule):
                output = next(n for n in child.graph.nodes if n.op == "output")
                items = output.args[0]
                if isinstance(items, (tuple, list)) and node.args[1] < len(items):
                    return value_of(child, items[node.args[1]])
    return None


def _opaque_value(graph: CompiledGraphModule, node: Node, child: GraphModuleBase) -> object:
    """The value of a call of an opaque module: its code run on fake tensors of the call's
    tensor arguments (None when one is unknown, or it takes other arguments)."""
    if not isinstance(child, OpaqueGraphModule) or node.kwargs:
        return None
    values = [value_of(graph, a) for a in node.args]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None
    specs = [(cast(torch.Tensor, v).shape, cast(torch.Tensor, v).dtype, cast(torch.Tensor, v).device) for v in values]
    try:
        with cleared_module_state(child.original):
            return fake_call(child.original, [(torch.Size(symbolic_hint(d) for d in size), dtype, device)
                                              for size, dtype, device in specs])
    except Exception:  # noqa: BLE001 - unknown: the caller says the value is no known tensor
        return None


def tensor_spec(graph: GraphModuleBase, node: object, *, where: str) -> Spec:
    """``(sizes, dtype, device)`` of a node's tensor value on the example call (see :func:`value_of`).

    Raises:
        SurgeryError: the value is no tensor (a container, a number), is unknown (a module's
            input: edit at its call instead) or has a data-dependent size.
    """
    value = value_of(graph, node)
    if isinstance(node, Node) and node.op == "placeholder":
        raise SurgeryError(f"{where} is an input of its module, whose value the graph does not record; insert before"
                           " the module's call in its caller instead: insert_before(target, '<module NodePath>',"
                           " module, arg=<index of the input>).")
    if not isinstance(value, torch.Tensor) or not all(has_hint(s) for s in value.shape):
        kind = type(value).__name__ if isinstance(node, Node) else type(node).__name__
        raise SurgeryError(f"{where} is not a tensor of known size ({kind}); an inserted module takes and returns one"
                           " tensor. Pick a tensor node (pg.graph shows each node's shape).")
    return torch.Size(symbolic_hint(s) for s in value.shape), value.dtype, value.device
