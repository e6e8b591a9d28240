"""Graph rewrites that thread stateful arguments (transformers' ``Cache``) through extracted graphs.

Export (see :func:`.state.states_returned`) leaves a state module's graph returning
``(output, [new states])``. :func:`write_states_back` turns that into eager's contract (assign the
new state to the argument, return ``output``), :func:`read_states_back` fixes the callers, and
:func:`forward_state_objects` passes the objects by reference instead of rebuilding them from
their leaves, so one cache object flows through a forward as in the eager model.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch.fx import Graph, Node
from ..compat.pytree import fx_pytree
from ..compat.pytree import pytree

from ..errors import ExtractionError
from .cleanup import input_prologue, spec_node
from .state import Key, assign_state


def write_states_back(graph: Graph, attrs: dict[str, Any], keys: list[Key]) -> None:
    """Rewrite a state module's raw unflattened graph, whose output is ``(output, [new states])``,
    to assign each new state to its argument (an :func:`assign_state` node) and return ``output``.

    Args:
        graph: the module's per-invocation graph, before :func:`~.cleanup.clean_graph`.
        attrs: ``{get_attr target: value}`` of the graph's owner (its ``_spec_N`` tree specs).
        keys: the invocation's state keys, as :func:`states_returned` recorded them.

    Raises:
        ExtractionError: the graph does not have the shape export gives a threaded module.
    """
    output = next(n for n in graph.nodes if n.op == "output")
    value, prologue = output.args[0], input_prologue(graph)
    spec = None
    if isinstance(value, Node) and value.target is pytree.tree_unflatten and isinstance(value.args[1], Node):
        spec = attrs.get(str(value.args[1].target))
    if spec is None or prologue is None or spec.num_children != 2:
        raise ExtractionError("internal: a module called with a stateful argument (a transformers Cache) has no"
                              " (output, [states]) graph output; please report this with the model's class.")
    positional, keywords = prologue.args[0]
    out_spec, states_spec = spec.children()
    leaves = list(value.args[0])
    with graph.inserting_before(output):
        result = graph.call_function(pytree.tree_unflatten, (leaves[:out_spec.num_leaves],
                                                             spec_node(graph, attrs, out_spec, output)))
        start = out_spec.num_leaves
        for key, state_spec in zip(keys, states_spec.children()):
            part, start = leaves[start:start + state_spec.num_leaves], start + state_spec.num_leaves
            new = graph.call_function(pytree.tree_unflatten, (part, spec_node(graph, attrs, state_spec, output)))
            graph.call_function(assign_state, (positional[key] if isinstance(key, int) else keywords[key], new))
    output.args = (result,)
    graph.erase_node(value)


def read_states_back(graph: Graph, call: Node, keys: list[Key], extra: int) -> None:
    """Rewrite a cleaned parent graph's call of a state module: the callee now returns only its
    output and writes its new states into the objects it was passed, so every read of the old
    ``(output, [states])`` result reads ``output`` and those objects instead.

    Args:
        graph: the caller's cleaned graph.
        call: the ``call_module`` node.
        keys: the invocation's state keys.
        extra: how many leading arguments of ``call`` are not the module's own (``args_0``).
    """
    states = [call.args[extra + key] if isinstance(key, int) else call.kwargs[key] for key in keys]
    for user in list(call.users):
        if user.op == "call_function" and user.target is operator.getitem and user.args == (call, 0):
            user.replace_all_uses_with(call)
            graph.erase_node(user)
        else:
            result = (call, list(states))
            user.args = tuple(result if a is call else a for a in user.args)
            user.kwargs = {k: result if v is call else v for k, v in user.kwargs.items()}


def _custom(spec: pytree.TreeSpec) -> bool:
    return not spec.is_leaf() and spec.type not in (tuple, list, dict, type(None))


def _objects(structure: Any, spec: pytree.TreeSpec, start: int = 0, path: tuple[Any, ...] = ()
             ) -> Iterator[tuple[int, pytree.TreeSpec, Node, tuple[Any, ...]]]:
    """``(first leaf index, spec, node, key path)`` of every custom pytree object (a ``Cache``) in an
    fx argument structure flattened by ``tree_flatten_spec(structure, spec)``; the object is
    ``node[k0][k1]...`` (a path into a node's tuple, list, dict or ``ModelOutput`` value)."""
    if isinstance(structure, Node):
        if _custom(spec):
            yield start, spec, structure, path
        if spec.is_leaf() or spec.type is None or not issubclass(spec.type, (tuple, list, dict)):
            return
        keys = list(spec.context) if issubclass(spec.type, dict) else list(range(spec.num_children))
        for key, child in zip(keys, spec.children()):
            yield from _objects(structure, child, start, (*path, key))
            start += child.num_leaves
        return
    if spec.is_leaf():
        return
    if isinstance(structure, dict):
        items = [structure[key] for key in spec.context]
    elif isinstance(structure, (tuple, list)):
        items = list(structure)
    else:
        return
    for item, child in zip(items, spec.children()):
        yield from _objects(item, child, start)
        start += child.num_leaves


def argument_objects(graph: Graph, attrs: dict[str, Any]) -> list[tuple[pytree.TreeSpec, Node]]:
    """``(spec, placeholder)`` of each argument of a raw unflattened graph that is a custom pytree
    object (a ``Cache``), read off the input prologue before cleaning removes it."""
    prologue = input_prologue(graph)
    spec = attrs.get(str(prologue.args[1].target)) if prologue is not None else None
    if spec is None:
        return []
    return [(sub, node) for _, sub, node, path in _objects(prologue.args[0], spec) if not path]


def forward_state_objects(graph: Graph, attrs: dict[str, Any], threaded: list[tuple[Node, list[Key], int]],
                          arguments: list[tuple[pytree.TreeSpec, Node]]) -> None:
    """Pass state objects by reference, as the eager code does.

    Where a graph rebuilds an object (``tree_unflatten``) from exactly the leaves it just read off
    an object it holds (a ``Cache`` argument, or one a callee wrote its new state into), the
    object itself is used instead: every layer then gets the very cache object the model was
    called with, a skipped layer leaves it untouched as in eager, and no copy is made per call.
    Self-assignments left by :func:`write_states_back` are removed.

    Args:
        graph: a cleaned graph (after :func:`read_states_back`).
        attrs: ``{get_attr target: value}`` of the graph's owner (``_spec_N`` attributes are added).
        threaded: ``(call, state keys, extra arguments)`` of each call that writes states back.
        arguments: the graph's object arguments (:func:`argument_objects`).
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    # flatten node -> {first leaf index: (spec, object node)}
    sources: dict[Node, dict[int, tuple[pytree.TreeSpec, Node]]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is fx_pytree.tree_flatten_spec:
            spec = attrs.get(str(node.args[1].target)) if isinstance(node.args[1], Node) else None
            if spec is not None:
                sources[node] = {}
                for start, sub, obj, path in _objects(node.args[0], spec):
                    sources[node].setdefault(start, (sub, obj, path))

    replaced: dict[Node, Node] = {}

    def mutated_between(obj: Node, after: Node, before: Node) -> bool:
        for call, keys, extra in threaded:
            if order[after] < order[call] < order[before]:
                states = [call.args[extra + k] if isinstance(k, int) else call.kwargs[k] for k in keys]
                if any(state is obj for state in states):
                    return True
        return False

    def empty_source(spec: pytree.TreeSpec, user: Node) -> tuple[Node, tuple[pytree.TreeSpec, Node, tuple]] | None:
        """An object without leaves (an empty cache) is matched by its spec when it is the only
        earlier object with that spec."""
        found = {(obj, path): (flatten, (sub, obj, path)) for flatten, entries in sources.items()
                 if order[flatten] < order[user] for sub, obj, path in entries.values() if sub == spec}
        for sub, placeholder in arguments:
            if sub == spec:
                found.setdefault((placeholder, ()), (placeholder, (sub, placeholder, ())))
        return next(iter(found.values())) if len(found) == 1 else None

    def source_of(leaves: list[Any], spec: pytree.TreeSpec, user: Node) -> Node | None:
        if not leaves:
            match = empty_source(spec, user)
            if match is None:
                return None
            flatten, found = match
        else:
            first = leaves[0]
            if not (isinstance(first, Node) and first.target is operator.getitem and first.args[0] in sources):
                return None
            flatten, index = first.args
            found = sources[flatten].get(index)
            if found is None or found[0] != spec or spec.num_leaves != len(leaves):
                return None
            for i, leaf in enumerate(leaves):
                if not (isinstance(leaf, Node) and leaf.target is operator.getitem and leaf.args == (flatten, index + i)):
                    return None
        _, obj, path = found
        while obj in replaced:  # the object node was itself forwarded to an earlier object
            obj = replaced[obj]
        if mutated_between(obj, flatten, user):
            return None
        with graph.inserting_before(user):
            for key in path:
                obj = graph.call_function(operator.getitem, (obj, key))
        return obj

    def reuse(leaves: list[Any], spec: pytree.TreeSpec, user: Node) -> tuple[list[Any], pytree.TreeSpec]:
        if _custom(spec):
            obj = source_of(leaves, spec, user)
            if obj is not None:
                return [obj], pytree.treespec_leaf()
        if spec.is_leaf():
            return leaves, spec
        new_leaves: list[Any] = []
        children = []
        start = 0
        for child in spec.children():
            part, new_child = reuse(leaves[start:start + child.num_leaves], child, user)
            start += child.num_leaves
            new_leaves += part
            children.append(new_child)
        return new_leaves, pytree.TreeSpec(spec.type, spec.context, children)

    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is pytree.tree_unflatten and isinstance(node.args[1], Node)):
            continue
        spec = attrs.get(str(node.args[1].target))
        if spec is None:
            continue
        leaves, new_spec = reuse(list(node.args[0]), spec, node)
        if new_spec == spec:
            continue
        if new_spec.is_leaf():
            node.replace_all_uses_with(leaves[0])
            replaced[node] = leaves[0]
            graph.erase_node(node)
        else:
            node.args = (leaves, spec_node(graph, attrs, new_spec, node))
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is assign_state and node.args[0] is node.args[1]:
            graph.erase_node(node)


def state_argument_specs(graph_module: torch.nn.Module) -> list[tuple[int | str, pytree.TreeSpec]]:
    """``(position or keyword, spec)`` of each argument of a compiled graph that is a custom pytree
    object (a ``Cache``), read off its input prologue; empty for other graphs."""
    graph = getattr(graph_module, "graph", None)
    prologue = input_prologue(graph) if isinstance(graph, Graph) else None
    if prologue is None or not isinstance(prologue.args[1], Node):
        return []
    spec = getattr(graph_module, str(prologue.args[1].target), None)
    if not isinstance(spec, pytree.TreeSpec) or spec.num_children != 2:
        return []
    positional, keywords = prologue.args[0]
    found: list[tuple[int | str, pytree.TreeSpec]] = []
    pos_spec, kw_spec = spec.children()
    for i, child in enumerate(pos_spec.children()):
        if _custom(child):
            found.append((i, child))
    for key, child in zip(kw_spec.context, kw_spec.children()):
        if _custom(child):
            found.append((key, child))
    return found
