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
from typing import Any, cast

import torch
from torch.fx import Graph, Node
from ..compat.torch.pytree import fx_pytree
from ..compat.torch.pytree import node_class, pytree

from ..errors import ExtractionError
from .cleanup import input_prologue, spec_node
from ..graph.state import Key, Path, assign_state, read_state, write_state


def write_states_back(graph: Graph, attrs: dict[str, Any], keys: list[Key], *, path: str = "") -> None:
    """Rewrite a state module's raw unflattened graph, whose output is ``(output, [new states])``,
    to assign each new state to its argument (an :func:`assign_state` node) and return ``output``.

    Args:
        graph: the module's per-invocation graph, before :func:`~.cleanup.clean_graph`.
        attrs: ``{get_attr target: value}`` of the graph's owner (its ``_spec_N`` tree specs).
        keys: the invocation's state keys, as :func:`states_returned` recorded them.
        path: the module's NodePath, for messages.

    Raises:
        ExtractionError: the graph does not have the shape export gives a threaded module; or a
            tensor the module writes into its state argument is read by nothing in the exported
            program, so ``torch.export`` dropped it (the graph would leave ``None`` where eager
            leaves the tensor).
    """
    output = next(n for n in graph.nodes if n.op == "output")
    value, prologue = output.args[0], input_prologue(graph)
    spec = None
    if isinstance(value, Node) and value.target is pytree.tree_unflatten and isinstance(value.args[1], Node):
        spec = attrs.get(str(value.args[1].target))
    if spec is None or prologue is None or spec.num_children != 2:
        raise ExtractionError("internal: a module called with a stateful argument (a transformers Cache) has no"
                              " (output, [states]) graph output; please report this with the model's class.")
    positional, keywords = cast(tuple[tuple[Node, ...], dict[str, Node]], prologue.args[0])
    out_spec, states_spec = spec.children()
    leaves = list(cast(list[Any], cast(Node, value).args[0]))
    with graph.inserting_before(output):
        result = graph.call_function(pytree.tree_unflatten, (leaves[:out_spec.num_leaves],
                                                             spec_node(graph, attrs, out_spec, before=output)))
        start = out_spec.num_leaves
        for key, state_spec in zip(keys, states_spec.children()):
            part, start = leaves[start:start + state_spec.num_leaves], start + state_spec.num_leaves
            if any(leaf is None for leaf in part):
                raise ExtractionError(
                    f"'{path or '<root>'}' writes a tensor into its state argument {key!r} (a transformers Cache)"
                    " that nothing in the traced program reads afterwards, so torch.export dropped it: the"
                    " graph would leave None where eager leaves the tensor. Return the cache from the model,"
                    " or run this module eagerly (ExtractionOptions(classes_to_skip_compiling={...})).")
            new = graph.call_function(pytree.tree_unflatten, (part, spec_node(graph, attrs, state_spec, before=output)))
            graph.call_function(assign_state, (positional[key] if isinstance(key, int) else keywords[key], new))
    output.args = (result,)
    graph.erase_node(value)


def read_states_back(graph: Graph, call: Node, keys: list[Key], *, extra: int) -> None:
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


def drop_unused_reads(graph: Graph) -> None:
    """Make each :func:`~.state.read_state` node of a graph read only the paths whose values the
    graph uses (its ``getitem`` users are renumbered); run after dead code is removed.

    :func:`narrow_state_access` turns every leaf export read off a state argument into a path of
    one ``read_state``, and export reads every leaf of a ``Cache`` argument, used or not: a decode
    step's attention graph of an ``L``-layer model would read all ``2 L`` keys and values to use
    its own layer's two, so each call would cost ``O(L)`` path lookups, and its cache check would
    compare every layer in full (the layers a graph reads are never compared by type alone, see
    :class:`~.state.SpecCheck`): ``O(L^2)`` per step.

    A ``read_state`` with a user other than ``node[k]`` (``k`` an int) is left as it is.
    """
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is read_state):
            continue
        users = list(node.users)
        if not all(user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)
                   for user in users):
            continue
        paths = cast(tuple, node.args[2])
        used = sorted({cast(int, user.args[1]) for user in users})
        if len(used) == len(paths):
            continue
        position = {old: new for new, old in enumerate(used)}
        node.args = (*node.args[:2], tuple(paths[k] for k in used))
        for user in users:
            user.args = (node, position[cast(int, user.args[1])])


def _custom(spec: pytree.TreeSpec) -> bool:
    """A custom pytree object (a ``Cache``): not a tuple, list, dict, namedtuple or None."""
    kind = node_class(spec)
    if spec.is_leaf() or kind in (tuple, list, dict, type(None)):
        return False
    return kind is None or not pytree.is_namedtuple_class(kind)


def _objects(structure: Any, spec: pytree.TreeSpec, start: int = 0, *, path: tuple[Any, ...] = ()
             ) -> Iterator[tuple[int, pytree.TreeSpec, Node, tuple[Any, ...]]]:
    """``(first leaf index, spec, node, key path)`` of every custom pytree object (a ``Cache``) in an
    fx argument structure flattened by ``tree_flatten_spec(structure, spec)``; the object is
    ``node[k0][k1]...`` (a path into a node's tuple, list, dict or ``ModelOutput`` value)."""
    if isinstance(structure, Node):
        if _custom(spec):
            yield start, spec, structure, path
        kind = node_class(spec)
        if spec.is_leaf() or kind is None or not issubclass(kind, (tuple, list, dict)):
            return
        keys = list(spec.context) if issubclass(kind, dict) else list(range(spec.num_children))
        for key, child in zip(keys, spec.children()):
            yield from _objects(structure, child, start, path=(*path, key))
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
    if prologue is None:
        return []
    spec = attrs.get(str(cast(Node, prologue.args[1]).target))
    if spec is None:
        return []
    return [(sub, node) for _, sub, node, path in _objects(prologue.args[0], spec) if not path]


def forward_state_objects(graph: Graph, attrs: dict[str, Any], threaded: list[tuple[Node, list[Key], int]],
                          *, arguments: list[tuple[pytree.TreeSpec, Node]]) -> None:
    """Pass state objects by reference, as the eager code does, and let each graph touch only the
    parts of them it reads or changes (:func:`narrow_state_access`).

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
    forwarding = _ObjectForwarding(graph, attrs, threaded, arguments=arguments)
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is pytree.tree_unflatten and isinstance(node.args[1], Node)):
            continue
        spec = attrs.get(str(node.args[1].target))
        if spec is None:
            continue
        leaves, new_spec = forwarding.reuse(list(node.args[0]), spec, node)
        if new_spec == spec:
            continue
        if new_spec.is_leaf():
            node.replace_all_uses_with(leaves[0])
            forwarding.replaced[node] = leaves[0]
            graph.erase_node(node)
        else:
            node.args = (leaves, spec_node(graph, attrs, new_spec, before=node))
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is assign_state and node.args[0] is node.args[1]:
            graph.erase_node(node)
    narrow_state_access(graph, attrs, threaded, arguments=arguments)


def _mutated_between(threaded: list[tuple[Node, list[Key], int]], order: dict[Node, int], obj: Node, *,
                     after: Node, before: Node) -> bool:
    """Whether a call that writes states back (``threaded``) is passed ``obj`` as a state argument
    between the nodes ``after`` and ``before`` (``order``: each node's position in the graph)."""
    for call, keys, extra in threaded:
        if order[after] < order[call] < order[before]:
            states = [call.args[extra + k] if isinstance(k, int) else call.kwargs[k] for k in keys]
            if any(state is obj for state in states):
                return True
    return False


class _ObjectForwarding:
    """Finds, for the leaves a ``tree_unflatten`` rebuilds an object from, the object node they
    were read off (see :func:`forward_state_objects`).

    Attributes:
        sources: ``{tree_flatten_spec node: {first leaf index: (spec, object node, key path)}}``
            of the custom pytree objects each flatten reads leaves off.
        replaced: ``{rebuilt object node: the object node used instead}``.
    """

    def __init__(self, graph: Graph, attrs: dict[str, Any], threaded: list[tuple[Node, list[Key], int]],
                 *, arguments: list[tuple[pytree.TreeSpec, Node]]):
        self.graph, self.threaded, self.arguments = graph, threaded, arguments
        self.order = {node: i for i, node in enumerate(graph.nodes)}
        self.sources: dict[Node, dict[int, tuple[pytree.TreeSpec, Node, tuple[Any, ...]]]] = {}
        for node in graph.nodes:
            if node.op == "call_function" and node.target is fx_pytree.tree_flatten_spec:
                spec = attrs.get(str(node.args[1].target)) if isinstance(node.args[1], Node) else None
                if spec is not None:
                    self.sources[node] = {}
                    for start, sub, obj, path in _objects(node.args[0], spec):
                        self.sources[node].setdefault(start, (sub, obj, path))
        self.replaced: dict[Node, Node] = {}

    def empty_source(self, spec: pytree.TreeSpec, user: Node
                     ) -> tuple[Node, tuple[pytree.TreeSpec, Node, tuple]] | None:
        """An object without leaves (an empty cache) is matched by its spec when it is the only
        earlier object with that spec."""
        found = {(obj, path): (flatten, (sub, obj, path)) for flatten, entries in self.sources.items()
                 if self.order[flatten] < self.order[user] for sub, obj, path in entries.values() if sub == spec}
        for sub, placeholder in self.arguments:
            if sub == spec:
                found.setdefault((placeholder, ()), (placeholder, (sub, placeholder, ())))
        return next(iter(found.values())) if len(found) == 1 else None

    def source_of(self, leaves: list[Any], spec: pytree.TreeSpec, user: Node) -> Node | None:
        """The object node ``leaves`` (all of ``spec``'s, in order) were read off, unchanged since,
        as ``user`` sees it (a path into it read with ``getitem`` nodes); None when there is none."""
        if not leaves:
            match = self.empty_source(spec, user)
            if match is None:
                return None
            flatten, found = match
        else:
            first = leaves[0]
            if not (isinstance(first, Node) and first.target is operator.getitem and first.args[0] in self.sources):
                return None
            flatten, index = cast(tuple[Node, int], first.args)
            entry = self.sources[flatten].get(index)
            if entry is None or entry[0] != spec or spec.num_leaves != len(leaves):
                return None
            found = entry
            for i, leaf in enumerate(leaves):
                if not (isinstance(leaf, Node) and leaf.target is operator.getitem and leaf.args == (flatten, index + i)):
                    return None
        _, obj, path = found
        while obj in self.replaced:  # the object node was itself forwarded to an earlier object
            obj = self.replaced[obj]
        if _mutated_between(self.threaded, self.order, obj, after=flatten, before=user):
            return None
        with self.graph.inserting_before(user):
            for key in path:
                obj = self.graph.call_function(operator.getitem, (obj, key))
        return obj

    def reuse(self, leaves: list[Any], spec: pytree.TreeSpec, user: Node) -> tuple[list[Any], pytree.TreeSpec]:
        """``(leaves, spec)`` for ``user``'s rebuild, each custom object in it that
        :meth:`source_of` finds being one leaf: the object node itself."""
        if _custom(spec):
            obj = self.source_of(leaves, spec, user)
            if obj is not None:
                return [obj], pytree.treespec_leaf()
        if spec.is_leaf():
            return leaves, spec
        new_leaves: list[Any] = []
        children = []
        start = 0
        for child in spec.children():
            part, new_child = self.reuse(leaves[start:start + child.num_leaves], child, user)
            start += child.num_leaves
            new_leaves += part
            children.append(new_child)
        return new_leaves, pytree.TreeSpec(spec.type, spec.context, children)


def _layer(path: Path) -> Path:
    """The part of ``path`` up to its first item step (``("layers", (3,), "keys")`` gives
    ``("layers", (3,))``): the cache layer it is in; the whole path when it has no item step."""
    for i, step in enumerate(path):
        if isinstance(step, tuple):
            return path[:i + 1]
    return path


def state_argument_specs(graph_module: torch.nn.Module
                         ) -> list[tuple[int | str, pytree.TreeSpec, frozenset[Path] | None]]:
    """``(position or keyword, spec, layers)`` of each argument of a compiled graph that is a custom
    pytree object (a ``Cache``) whose leaves the graph reads or writes, off its input prologue or
    its :func:`read_state` and :func:`write_state` nodes; empty for other graphs. ``layers`` are the
    paths of the cache layers (:func:`_layer`) those nodes read or write, or None when the input
    prologue flattens the whole object."""
    graph = getattr(graph_module, "graph", None)
    if not isinstance(graph, Graph):
        return []
    found: dict[tuple[int | str, pytree.TreeSpec], set[Path] | None] = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in graph.nodes:
        if node.op == "call_function" and node.target in (read_state, write_state) and node.args[0] in placeholders:
            spec = getattr(graph_module, str(cast(Node, node.args[1]).target), None)
            where = placeholders.index(cast(Node, node.args[0]))
            if isinstance(spec, pytree.TreeSpec):
                paths = node.args[2] if node.target is read_state else (*node.args[2], *node.args[3])
                layers = found.setdefault((where, spec), set())
                if layers is not None:
                    layers.update(_layer(path) for path in cast(tuple, paths))
    prologue = input_prologue(graph)
    if prologue is not None and isinstance(prologue.args[1], Node):
        spec = getattr(graph_module, str(prologue.args[1].target), None)
        if isinstance(spec, pytree.TreeSpec) and spec.num_children == 2:
            pos_spec, kw_spec = spec.children()
            for i, child in enumerate(pos_spec.children()):
                if _custom(child):
                    found[(i, child)] = None
            for key, child in zip(kw_spec.context, kw_spec.children()):
                if _custom(child):
                    found[(key, child)] = None
    return [(where, spec, None if layers is None else frozenset(layers)) for (where, spec), layers in found.items()]


class _Leaf:
    """Stands for leaf ``index`` of a spec in a :func:`_template`."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class _Unnarrowable(Exception):
    """The change between two states cannot be written as a few assignments (see :func:`_changes`)."""


#: Values a write may set as graph constants (fx prints them in generated code).
_ATOMS = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _template(spec: pytree.TreeSpec) -> Any:
    """The object ``spec`` unflattens to, with :class:`_Leaf` markers for its leaves; None when the
    spec's unflatten needs real leaves."""
    try:
        return pytree.tree_unflatten([_Leaf(i) for i in range(spec.num_leaves)], spec)
    except Exception:  # noqa: BLE001 - a custom unflatten that computes on its leaves
        return None


def _members(obj: Any) -> list[tuple[str | tuple[Any], Any]] | None:
    """``[(path step, value)]`` of a list's items, a dict's items or an object's attributes (see
    :data:`.state.Path`); None for anything else (a tuple, an atom, a leaf)."""
    if isinstance(obj, list):
        return [((i,), item) for i, item in enumerate(obj)]
    if isinstance(obj, dict):
        return [((key,), item) for key, item in obj.items()]
    if isinstance(obj, _Leaf) or isinstance(obj, type) or not hasattr(obj, "__dict__"):
        return None
    return list(vars(obj).items())


def _leaf_paths(template: Any, path: Path = ()) -> dict[int, Path]:
    """``{leaf index: path}`` of the markers in a :func:`_template`.

    Raises:
        _Unnarrowable: a marker sits inside a tuple or other value paths cannot address.
    """
    if isinstance(template, _Leaf):
        return {template.index: path}
    members = _members(template)
    if members is None:
        if isinstance(template, tuple) and any(_leaf_paths(item) for item in template):
            raise _Unnarrowable
        return {}
    found: dict[int, Path] = {}
    for step, value in members:
        found.update(_leaf_paths(value, (*path, step)))
    return found


def _changes(old: Any, new: Any, unchanged: Any, *, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """``(path, value)`` of each assignment that turns ``old`` into ``new`` as :func:`assign_state`
    does, both :func:`_template` objects; ``value`` is a ``_Leaf`` of ``new``, a constant, or
    :data:`_DELETE` (delete the attribute or item at ``path``).
    ``unchanged(old_leaf, new_leaf)`` tells whether a new leaf is the old one, unmodified.

    Raises:
        _Unnarrowable: a changed part is a new container or object (it would have to be rebuilt).
    """
    if isinstance(new, _Leaf):
        if not (isinstance(old, _Leaf) and unchanged(old, new)):
            yield path, new
        return
    new_members, old_members = _members(new), _members(old)
    if new_members is None:
        if _leaf_paths(new):
            raise _Unnarrowable
        if type(old) is type(new) and isinstance(new, _ATOMS) and old == new:
            return
        if not isinstance(new, _ATOMS):
            raise _Unnarrowable
        yield path, new
        return
    if old_members is None or type(old) is not type(new):
        raise _Unnarrowable  # assign_state would put in the new object itself
    if isinstance(new, list):
        if len(old) != len(new):
            raise _Unnarrowable  # assign_state replaces the whole list's contents
    else:
        new_steps = {step for step, _ in new_members}
        for step, _ in old_members:
            if step not in new_steps:
                yield (*path, step), _DELETE
    old_state = dict(old_members)
    for step, value in new_members:
        if step in old_state:
            yield from _changes(old_state[step], value, unchanged, path=(*path, step))
        elif isinstance(value, _Leaf) or isinstance(value, _ATOMS):
            yield (*path, step), value
        else:
            raise _Unnarrowable


#: Marks a deletion in :func:`_changes`.
_DELETE = object()


def narrow_state_access(graph: Graph, attrs: dict[str, Any], threaded: list[tuple[Node, list[Key], int]],
                        *, arguments: list[tuple[pytree.TreeSpec, Node]]) -> None:
    """Make a graph read and write only the parts of its state arguments it uses or changes.

    Export leaves a state module's graph flattening the whole state argument (every layer of a
    ``Cache``) to read a few leaves, and rebuilding the whole new state to :func:`assign_state` it
    back, so that each attention call of an ``L``-layer model costs ``O(L)`` and a forward
    ``O(L^2)``. Here, for each argument that is a custom pytree object (``arguments``):

    - ``assign_state(arg, tree_unflatten(leaves, spec))`` becomes :func:`write_state` of the
      assignments that differ from the argument's own state: a new leaf, a changed constant
      (``is_initialized``, ``dtype``), a deleted attribute. A leaf that is the argument's own leaf,
      read before and not changed by a child call in between, is not written. The node carries
      the argument's spec, which the bridge checks before the call, as export's flatten did;
    - reads of the argument's leaves off a ``tree_flatten_spec`` become one :func:`read_state` of
      their paths (it carries the argument's spec, which the bridge checks before the call); a
      flatten left without readers is removed.

    A change that would need a new container or object built (a cache that appends layers), or
    a spec whose unflatten computes on its leaves, keeps export's whole-object code.

    Args:
        graph: a cleaned graph, after :func:`forward_state_objects`.
        attrs: ``{get_attr target: value}`` of the graph's owner (``_spec_N`` attributes are added).
        threaded: ``(call, state keys, extra arguments)`` of each call that writes states back.
        arguments: the graph's object arguments (:func:`argument_objects`).
    """
    narrowing = _StateNarrowing(graph, attrs, threaded, arguments=arguments)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is assign_state:
            narrowing.narrow_write(node)
    for flatten in [n for n in graph.nodes if n.op == "call_function" and n.target is fx_pytree.tree_flatten_spec]:
        for placeholder, spec in narrowing.specs.items():
            narrowing.narrow_reads(flatten, placeholder, spec)
        if not flatten.users:
            graph.erase_node(flatten)


class _StateNarrowing:
    """Rewrites a graph's whole-object writes and reads of its state arguments to the parts it
    changes and uses (see :func:`narrow_state_access`); ``specs``: ``{placeholder: spec}`` of the
    object arguments."""

    def __init__(self, graph: Graph, attrs: dict[str, Any], threaded: list[tuple[Node, list[Key], int]],
                 *, arguments: list[tuple[pytree.TreeSpec, Node]]):
        self.graph, self.attrs, self.threaded = graph, attrs, threaded
        self.specs = {placeholder: spec for spec, placeholder in arguments}
        self.order = {node: i for i, node in enumerate(graph.nodes)}

    def read_of(self, leaf: Any, obj: Node) -> tuple[Node, int] | None:
        """``(flatten, leaf index in obj's spec)`` when ``leaf`` reads a leaf of ``obj`` off a flatten."""
        if not (isinstance(leaf, Node) and leaf.op == "call_function" and leaf.target is operator.getitem):
            return None
        flatten, index = leaf.args
        if not (isinstance(flatten, Node) and flatten.target is fx_pytree.tree_flatten_spec
                and isinstance(flatten.args[1], Node) and isinstance(index, int)):
            return None
        spec = self.attrs.get(str(flatten.args[1].target))
        if spec is None:
            return None
        for start, sub, found, path in _objects(flatten.args[0], spec):
            if found is obj and not path and sub == self.specs[obj] and start <= index < start + sub.num_leaves:
                return flatten, index - start
        return None

    def narrow_write(self, node: Node) -> None:
        """Make the ``assign_state`` ``node`` a :func:`write_state` of what changes, when it can."""
        graph, attrs, specs = self.graph, self.attrs, self.specs
        target, new = cast(tuple[Node, Any], node.args)  # an object argument, checked below
        if not (target in specs and isinstance(new, Node) and new.target is pytree.tree_unflatten
                and isinstance(new.args[1], Node)):
            return
        new_spec, leaves = attrs.get(str(new.args[1].target)), list(cast(list[Any], new.args[0]))
        old_template = _template(specs[target])
        new_template = _template(new_spec) if new_spec is not None else None
        if old_template is None or new_template is None:
            return

        def unchanged(old: _Leaf, new_leaf: _Leaf) -> bool:
            read = self.read_of(leaves[new_leaf.index], target)
            return read is not None and read[1] == old.index and not _mutated_between(
                self.threaded, self.order, target, after=read[0], before=node)

        try:
            changes = list(_changes(old_template, new_template, unchanged))
        except _Unnarrowable:
            return
        deleted = tuple(path for path, value in changes if value is _DELETE)
        written = [(path, leaves[value.index] if isinstance(value, _Leaf) else value)
                   for path, value in changes if value is not _DELETE]
        with graph.inserting_before(node):
            graph.call_function(write_state, (target, spec_node(graph, attrs, specs[target], before=node), deleted,
                                              tuple(p for p, _ in written), [v for _, v in written]))
        graph.erase_node(node)
        if not new.users:
            graph.erase_node(new)

    def narrow_reads(self, flatten: Node, placeholder: Node, spec: pytree.TreeSpec) -> None:
        """Make the reads of ``placeholder``'s leaves off ``flatten`` one :func:`read_state` of their
        paths, when they can be addressed."""
        graph = self.graph
        readers = [user for user in flatten.users if self.read_of(user, placeholder) is not None]
        template = _template(spec) if readers else None
        if template is None:
            return
        try:
            paths = _leaf_paths(template)
        except _Unnarrowable:
            return
        indices = [cast(tuple[Node, int], self.read_of(user, placeholder))[1] for user in readers]
        with graph.inserting_after(flatten):
            read = graph.call_function(read_state, (placeholder, spec_node(graph, self.attrs, spec, before=flatten),
                                                    tuple(paths[i] for i in indices)))
        with graph.inserting_after(read):
            for k, user in enumerate(readers):
                value = graph.call_function(operator.getitem, (read, k))
                value.meta.update(user.meta)  # the leaf's example value (its symbolic sizes)
                user.replace_all_uses_with(value)
                graph.erase_node(user)
