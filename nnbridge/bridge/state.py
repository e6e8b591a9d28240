"""Stateful call arguments: objects a module mutates in place, such as transformers' ``Cache``.

A decoder layer called with ``past_key_values=cache`` appends to ``cache`` and returns only its
hidden states. ``torch.export`` with a preserved call signature hands the module a *rebuilt* copy
of each pytree argument, so the update would never reach the caller, and
``torch.export.unflatten`` cannot thread it either. While exporting, each such call is therefore
rewritten (see :func:`states_returned`) so that the module returns ``(output, [new states])``
and its caller copies the new states into its own objects. The extracted graphs keep eager's
contract: a state module's graph takes the cache object, writes its new state into that same
object (an :func:`assign_state` node) and returns only the module's output; a parent graph reads
the state back from the object it passed in. Hooks and nnsight envoys thus see the module's real
signature (``hidden_states, attention_mask=..., past_key_values=cache, ...``) and real output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import operator

import torch
from torch.fx import Graph, Node
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from ..compat import call_overridden
from ..errors import ExtractionError
from .cleanup import input_prologue, plain_value, spec_node

#: A top-level argument of a call: its position, or its keyword.
Key = int | str


def state_keys(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Key]:
    """Positions and keywords of the call's arguments that are not plain pytrees of leaves (tuples,
    lists, dicts, None, tensors, scalars): the objects a module may mutate, in call order."""
    return [i for i, a in enumerate(args) if not plain_value(a)] + [k for k, v in kwargs.items() if not plain_value(v)]


def argument(args: tuple[Any, ...], kwargs: dict[str, Any], key: Key) -> Any:
    """The argument at ``key`` (a position or a keyword)."""
    return args[key] if isinstance(key, int) else kwargs[key]


def _fresh(value: Any) -> Any:
    """A new object with the same state (a pytree round trip; tensors are shared)."""
    leaves, spec = pytree.tree_flatten(value)
    return pytree.tree_unflatten(leaves, spec)


@torch.fx.node.has_side_effect
def assign_state(target: Any, source: Any) -> None:
    """Give ``target`` the state of ``source`` (same type), keeping ``target``'s identity and, where
    the structure matches, the identity of the objects it holds (a cache's layer objects).

    Raises:
        TypeError: ``target`` and ``source`` are of different types.
    """
    if type(target) is not type(source):
        raise TypeError(f"cannot copy the state of a {type(source).__name__} into a {type(target).__name__}")
    if isinstance(target, list):
        if len(target) == len(source):
            for i, (old, new) in enumerate(zip(target, source)):
                if _assignable(old, new):
                    assign_state(old, new)
                else:
                    target[i] = new
        else:
            target[:] = source
        return
    if isinstance(target, dict):
        for key in [k for k in target if k not in source]:
            del target[key]
        for key, new in source.items():
            if key in target and _assignable(target[key], new):
                assign_state(target[key], new)
            else:
                target[key] = new
        return
    state, new_state = vars(target), vars(source)
    for name in [n for n in state if n not in new_state]:
        del state[name]
    for name, new in new_state.items():
        if name in state and _assignable(state[name], new):
            assign_state(state[name], new)
        else:
            state[name] = new


#: Plumbing, not an op: op points skip nodes calling it.
assign_state.nnbridge_plumbing = True  # type: ignore[attr-defined]


def _assignable(old: Any, new: Any) -> bool:
    if old is new or type(old) is not type(new) or isinstance(old, torch.Tensor):
        return False
    return isinstance(old, (list, dict)) or (hasattr(old, "__dict__") and not isinstance(old, type))


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


@contextlib.contextmanager
def states_returned(modules: dict[str, torch.nn.Module]) -> Iterator[dict[str, list[list[Key]]]]:
    """While exporting, make each call of ``modules`` with stateful arguments return its new states.

    Inside (after export's signature-preserving pre-hook rebuilt the arguments) the module's
    forward runs on fresh copies of its stateful arguments and returns ``(output, [copies])``, so
    the preserved signature records the arguments as they were before the call and an output that
    carries the new state. Outside (around the whole call, hooks included), the copies' state is
    assigned to the caller's objects and only ``output`` is returned, as the eager call would.
    Calls without stateful arguments are untouched.

    Args:
        modules: ``{path: module}``; each module's forward is the class's or an instance override.

    Yields:
        ``{path: [state keys of each invocation, in call order]}`` (``[]`` for a call without
        stateful arguments), filled while the body runs.
    """
    calls: dict[str, list[list[Key]]] = {}
    installed: list[tuple[torch.nn.Module, Any]] = []

    def wrap(path: str, module: torch.nn.Module) -> None:
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            keys = state_keys(args, kwargs)
            if not keys:
                return inner(*args, **kwargs)
            args, kwargs = list(args), dict(kwargs)
            copies = []
            for key in keys:
                copy = _fresh(argument(args, kwargs, key))  # type: ignore[arg-type]
                if isinstance(key, int):
                    args[key] = copy
                else:
                    kwargs[key] = copy
                copies.append(copy)
            return inner(*args, **kwargs), copies

        def call(run: Any, *args: Any, **kwargs: Any) -> Any:
            keys = state_keys(args, kwargs)
            calls.setdefault(path, []).append(keys)
            if not keys:
                return run(*args, **kwargs)
            output, copies = run(*args, **kwargs)
            for key, copy in zip(keys, copies):
                assign_state(argument(args, kwargs, key), copy)
            return output

        installed.append((module, module.__dict__.get("forward")))
        module.__dict__["forward"] = forward
        call_overridden(module, call)

    try:
        for path, module in modules.items():
            wrap(path, module)
        yield calls
    finally:
        for module, previous in installed:
            call_overridden(module, None)
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous
