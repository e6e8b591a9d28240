"""Clean the per-invocation graphs that ``torch.export.unflatten`` produces.

With ``preserve_module_call_signature`` every submodule graph takes its module's original
``(args, kwargs)`` and returns its original output, but unflatten wraps that in pytree plumbing:
``tree_flatten_spec``/``tree_unflatten`` calls, ``getitem`` chains and ``_spec_N`` attributes. This
pass rewrites the plumbing into direct references wherever the containers are plain tuples, lists
and dicts (an argument of a custom pytree type such as transformers' ``DynamicCache`` gets one
``tree_unflatten`` of its own leaves, which :mod:`.state` then replaces by the object itself), removes
``_assert_tensor_metadata`` checks and dead code. Naming the nodes is :mod:`.naming`'s job.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.fx import Graph, Node
from torch.fx.node import Argument
from ..compat.torch.pytree import fx_pytree
from ..compat.torch.symbolic import symbolic_expr
from ..compat.torch.pytree import node_class, pytree, registered_class

from ..errors import ExtractionError
from ..graph.metadata import update_node_meta
from ..graph.state import SIMPLE_CONTAINERS, simple_spec
from .naming import op_base_name

# {(base node, key path prefix): the getitem node reading that prefix off base}
_GetitemCache = dict[tuple[Node, tuple[Any, ...]], Node]


def _leaf_paths(spec: pytree.TreeSpec, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...] | None]:
    """Key path of each leaf of ``spec``; None for leaves inside a container that is not a tuple,
    list or dict (or a subclass): those cannot be read with ``[key]``. Walks the spec only (never
    unflattens: custom pytree types such as ``DynamicCache`` keep state in their spec context)."""
    if spec.is_leaf():
        return [prefix]
    kind = node_class(spec)
    if kind is None or not issubclass(kind, SIMPLE_CONTAINERS):
        return [None] * spec.num_leaves
    if issubclass(kind, dict):
        keys: list[Any] = list(spec.context)
    else:
        keys = list(range(spec.num_children))
    paths: list[tuple[Any, ...] | None] = []
    for key, child in zip(keys, spec.children()):
        paths.extend(_leaf_paths(child, (*prefix, key)))
    return paths


def _spec_of(node: Node, attrs: dict[str, Any]) -> pytree.TreeSpec | None:
    spec_node = node.args[1] if len(node.args) > 1 else None
    if isinstance(spec_node, Node) and spec_node.op == "get_attr":
        return attrs.get(str(spec_node.target))
    return None


def _getitem_chain(graph: Graph, base: Node, path: tuple[Any, ...], *, cache: _GetitemCache) -> Node:
    """The ``getitem`` chain reading ``path`` off ``base``. New getitems go after the last one made for
    ``base`` (held under the empty path): made leaf by leaf in flattening order, they stand in
    depth-first order, as Dynamo made them, so their numbers are graphpatch's (``getitem_5`` reads
    ``[1][0][0][0]`` of a ``((x,), [([y], z), ...])`` output)."""
    node = base
    for depth in range(len(path)):
        key = (base, path[: depth + 1])
        if key not in cache:
            with graph.inserting_after(cache.get((base, ()), base)):
                cache[key] = cache[(base, ())] = graph.call_function(operator.getitem, (node, path[depth]))
        node = cache[key]
    return node


def _replace_leaf_getitems(graph: Graph, flatten: Node, leaf_value: Callable[[int], Node | None]) -> None:
    """Replace each ``getitem(flatten, i)`` user by ``leaf_value(i)`` where that is not None."""
    for user in sorted(flatten.users, key=lambda u: u.args[1] if len(u.args) > 1 and isinstance(u.args[1], int) else -1):
        if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
            replacement = leaf_value(user.args[1])
            if replacement is not None:
                user.replace_all_uses_with(replacement)


def input_prologue(graph: Graph) -> Node | None:
    """The ``tree_flatten_spec(((positional...), {keywords...}), spec)`` of a preserved signature."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is fx_pytree.tree_flatten_spec:
            structure = node.args[0]
            if (isinstance(structure, tuple) and len(structure) == 2 and isinstance(structure[0], tuple)
                    and all(isinstance(a, Node) and a.op == "placeholder" for a in structure[0])):
                return node
    return None


def localize_symbols(graph: Graph) -> list[Node]:
    """Rewrite reads of symbolic sizes off the extra inputs unflatten threads into a graph.

    With dynamic shapes, ``torch.export.unflatten`` passes root inputs (``args_0``) as extra
    leading arguments to every preserved-signature submodule so that ``sym_size(args_0, d)`` can
    read a symbolic size, and forwards them on to the submodule's own children. Each such
    ``sym_size`` is rewritten to read the same symbol off one of the module's own inputs.

    Returns:
        The extra placeholders. Once the children stop taking them (see ``drop_unused_extras``)
        and nothing else reads them, the graph takes exactly its module's arguments.
    """
    prologue = input_prologue(graph)
    if prologue is None:
        return []
    positional, keywords = cast(tuple[tuple[Node, ...], dict[str, Node]], prologue.args[0])
    declared = set(positional) | set(keywords.values())
    extras = [n for n in graph.nodes if n.op == "placeholder" and n not in declared]
    sources: dict[Any, tuple[Node, int]] = {}
    # each getitem of the flattened inputs reads leaf ``args[1]``, an int index
    for leaf in sorted((u for u in prologue.users if u.target is operator.getitem),
                       key=lambda u: cast(int, u.args[1])):
        value = leaf.meta.get("val")
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt):
                    sources.setdefault(symbolic_expr(size), (leaf, dim))
    for extra in extras:
        for user in list(extra.users):
            value = user.meta.get("val")
            if (user.op == "call_function" and op_base_name(user) == "sym_size"
                    and isinstance(value, torch.SymInt) and symbolic_expr(value) in sources):
                leaf, dim = sources[symbolic_expr(value)]
                user.args = (leaf, dim)
                leaf.append(user)
    return extras


def drop_unused_extras(graph: Graph, extras: list[Node]) -> bool:
    """Remove the extra placeholders when nothing reads any of them any more; True when so (the
    graph then has its module's exact signature). When one is read, all stay: a caller passes its
    extra arguments by position, one for each extra placeholder as unflatten made them."""
    if any(extra.users for extra in extras):
        return False
    for extra in extras:
        graph.erase_node(extra)
    return True


def _clean_prologue(graph: Graph, attrs: dict[str, Any]) -> None:
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is fx_pytree.tree_flatten_spec):
            continue
        structure = node.args[0]
        if not (isinstance(structure, tuple) and len(structure) == 2
                and all(isinstance(a, Node) and a.op == "placeholder" for a in structure[0])):
            continue
        spec = _spec_of(node, attrs)
        paths = _leaf_paths(spec) if spec is not None else None
        if paths is None:
            continue
        positional, keywords = cast(tuple[tuple[Node, ...], dict[str, Node]], structure)
        cache: _GetitemCache = {}

        def leaf(i: int, paths: list[tuple[Any, ...] | None] = paths, positional: tuple[Node, ...] = positional,
                 *, keywords: dict[str, Node] = keywords) -> Node | None:
            path = paths[i]
            if path is None:
                return None
            where, key, *rest = path
            arg = positional[key] if where == 0 else keywords[key]
            return _getitem_chain(graph, arg, tuple(rest), cache=cache) if rest else arg

        _replace_leaf_getitems(graph, node, leaf)


def spec_node(graph: Graph, attrs: dict[str, Any], spec: pytree.TreeSpec, *, before: Node) -> Node:
    """A new ``get_attr`` node (inserted before ``before``) reading ``spec`` from a fresh
    ``_spec_N`` attribute of the graph's owner; ``attrs`` gets the new entry."""
    i = len(attrs)
    while f"_spec_{i}" in attrs:
        i += 1
    name = f"_spec_{i}"
    attrs[name] = spec
    if graph.owning_module is not None:
        setattr(graph.owning_module, name, spec)
    with graph.inserting_before(before):
        return graph.create_node("get_attr", name)  # not get_attr(): it warns for non-tensor values


def _call_arguments(graph: Graph, attrs: dict[str, Any], call: Node, *, leaves: list[Any],
                    spec: pytree.TreeSpec) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of a call from the leaves of its input spec: plain arguments become
    containers of the leaves, an argument of a custom pytree type (a ``Cache``) one
    ``tree_unflatten`` node of its own leaves."""
    if simple_spec(spec):
        return pytree.tree_unflatten(leaves, spec)
    positional, keywords = spec.children()
    start = 0

    def argument(sub: pytree.TreeSpec) -> Any:
        nonlocal start
        part, start = leaves[start:start + sub.num_leaves], start + sub.num_leaves
        if simple_spec(sub):
            return pytree.tree_unflatten(part, sub)
        with graph.inserting_before(call):
            return graph.call_function(pytree.tree_unflatten, (list(part), spec_node(graph, attrs, sub, before=call)))
    args = tuple(argument(sub) for sub in positional.children())
    kwargs = {key: argument(sub) for key, sub in zip(keywords.context, keywords.children())}
    return args, kwargs


def _clean_calls(graph: Graph, attrs: dict[str, Any]) -> None:
    for call in [n for n in graph.nodes if n.op == "call_module"]:
        # inputs: tree_unflatten(leaves, spec) -> getitem 0/1 -> getitem j/key -> call_module
        unflatten = _find_input_unflatten(call)
        if unflatten is not None:
            spec = _spec_of(unflatten, attrs)
            if spec is not None:
                leaves = cast(Sequence[Argument], unflatten.args[0])  # tree_unflatten(leaves, spec)
                args, kwargs = _call_arguments(graph, attrs, call, leaves=list(leaves), spec=spec)
                extra = 0
                while extra < len(call.args) and _find_input_unflatten_of(call.args[extra]) is None:
                    extra += 1
                call.args, call.kwargs = tuple(call.args[:extra]) + tuple(args), dict(kwargs)
                update_node_meta(call, extra_args=extra)
        # output: tree_flatten_spec(call, spec) -> getitem i
        for user in list(call.users):
            if user.op == "call_function" and user.target is fx_pytree.tree_flatten_spec:
                spec = _spec_of(user, attrs)
                paths = _leaf_paths(spec) if spec is not None else None
                if paths is None:
                    continue
                cache: _GetitemCache = {}

                def leaf(i: int, paths: list[tuple[Any, ...] | None] = paths, call: Node = call,
                         *, cache: _GetitemCache = cache) -> Node | None:
                    path = paths[i]
                    return None if path is None else _getitem_chain(graph, call, path, cache=cache)

                _replace_leaf_getitems(graph, user, leaf)


def _find_input_unflatten_of(arg: object) -> Node | None:
    node = arg
    for _ in range(2):
        if isinstance(node, Node) and node.op == "call_function" and node.target is operator.getitem:
            node = node.args[0]
    if isinstance(node, Node) and node.op == "call_function" and node.target is pytree.tree_unflatten:
        return node
    return None


def _find_input_unflatten(call: Node) -> Node | None:
    for arg in list(call.args) + list(call.kwargs.values()):
        found = _find_input_unflatten_of(arg)
        if found is not None:
            return found
    return None


def _clean_epilogue(graph: Graph, attrs: dict[str, Any]) -> None:
    output = next(n for n in graph.nodes if n.op == "output")
    value = output.args[0]
    if isinstance(value, Node) and value.op == "call_function" and value.target is pytree.tree_unflatten:
        spec = _spec_of(value, attrs)
        if spec is not None and simple_spec(spec):
            leaves = cast(Sequence[Argument], value.args[0])  # tree_unflatten(leaves, spec)
            output.args = (pytree.tree_unflatten(list(leaves), spec),)


def _placeholders_first(graph: Graph) -> None:
    """Move every placeholder before the first other node (in their order): reads of container
    arguments (``getitem`` chains) are inserted right after their placeholder."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    others = [n for n in graph.nodes if n.op != "placeholder"]
    if not others:
        return
    for placeholder in placeholders:
        others[0].prepend(placeholder)


def _sizes_first(graph: Graph) -> None:
    """Move the reads of an input's symbolic size (``sym_size(x, d)``, ``x`` a placeholder) before
    the first op, after the placeholders and the parameter reads that lead the graph (in their
    order): where :func:`localize_symbols` puts them in a submodule's graph, so a module's graph has
    the same node order whether it was exported as the root or inside its caller."""
    reads = [n for n in graph.nodes if n.op == "call_function" and op_base_name(n) == "sym_size"
             and isinstance(n.args[0], Node) and n.args[0].op == "placeholder"]
    first = next((n for n in graph.nodes if n.op not in ("placeholder", "get_attr") and n not in reads), None)
    if first is None:
        return
    for read in reads:
        first.prepend(read)


def _remove_checks(graph: Graph) -> None:
    """Drop export's ``_assert_tensor_metadata`` checks and the ``aten.alias`` nodes that
    :func:`nnbridge.compat.torch.export` adds around conversions while tracing: at run time the graph
    then has eager's exact structure (the same autograd accumulation order, bit-equal gradients)."""
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        name = op_base_name(node)
        if name == "_assert_tensor_metadata":
            graph.erase_node(node)
        elif name == "alias" and isinstance(node.args[0], Node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def remove_dead_code(graph: Graph) -> None:
    """Erase nodes nothing uses, pytree plumbing included (side-effecting calls stay).

    A submodule call stays even when nothing reads its outputs (``b_outputs[0] = self.lin(h)``
    then dropped): eager runs it, so its graph runs too, and its op points see each call as eager
    makes it."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node.op in ("placeholder", "output", "call_module") or node.users:
                continue
            if node.op == "get_attr" or node.target in (operator.getitem, fx_pytree.tree_flatten_spec,
                                                        pytree.tree_unflatten) or not node.is_impure():
                graph.erase_node(node)
                changed = True


def restore_constant_outputs(graph: Graph, constants: dict[int, Any]) -> None:
    """Put back the Python constants a module returned next to its tensors (``return x * 2, 3``).

    Unflatten builds the output as ``tree_unflatten(leaves, spec)`` with ``None`` for every leaf
    that was a constant in the call's signature (see :func:`nnbridge.compat.constant_outputs`);
    ``constants`` is ``{leaf index: value}`` for this invocation. Run before :func:`clean_graph`.
    The values are those of the extracted call: export specialises on them (a size read with
    ``x.shape[0]`` makes the whole extraction static, so a new size re-extracts).
    """
    if not constants:
        return
    output = next(n for n in graph.nodes if n.op == "output")
    value = output.args[0]
    unflattened = (value.args[0] if isinstance(value, Node) and value.op == "call_function"
                   and value.target is pytree.tree_unflatten else None)
    leaves: list[Any] = list(unflattened) if isinstance(unflattened, (tuple, list)) else []
    for i, constant in constants.items():
        if i >= len(leaves) or leaves[i] is not None:  # unflatten's output differs from torch 2.13's
            raise ExtractionError(
                f"Cannot restore the constant {constant!r} returned by a module: the unflattened graph's output"
                f" is {value}, not a tree_unflatten with None at leaf {i} (written for torch 2.13).")
        leaves[i] = constant
    assert isinstance(value, Node) and isinstance(unflattened, (tuple, list))  # leaves were found above
    value.args = (type(unflattened)(leaves), *value.args[1:])


def clean_graph(graph: Graph, attrs: dict[str, Any]) -> list[Node]:
    """Remove unflatten's pytree plumbing in place (see the module docstring).

    Args:
        graph: an unflattened per-invocation graph.
        attrs: ``{get_attr target: value}`` of the graph's owner (for the ``_spec_N`` tree specs).

    Returns:
        The extra placeholders unflatten added (see :func:`localize_symbols`).
    """
    extras = localize_symbols(graph)
    _clean_prologue(graph, attrs)
    _clean_calls(graph, attrs)
    _clean_epilogue(graph, attrs)
    _remove_checks(graph)
    _placeholders_first(graph)
    remove_dead_code(graph)
    _sizes_first(graph)
    graph.lint()
    return extras
