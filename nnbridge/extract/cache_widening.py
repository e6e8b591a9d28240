"""A parent graph's calls of reused siblings widened back from stand-in caches to the whole cache.

Its one job: :func:`widen_narrowed_calls`. Siblings of layer reuse are exported with a stand-in
cache holding only their own layer (see :mod:`.cache_narrowing`), so in their parent's graph each
such call takes a cache rebuilt from that layer's leaves only, and its output flatten gives them
back alone. The rewrite gives each call the whole cache instead, rebuilt from the newest value of
every leaf, and makes its output flatten read the whole cache: the graph is then the one an export
with the whole cache would have given, and the state rewrites that follow (:mod:`.state_graphs`)
pass one cache object through every layer. Example::

    widen_narrowed_calls(graph, attrs)
"""

from __future__ import annotations

import operator
from typing import Any, cast

from torch.fx import Graph, Node

from ..compat.torch.pytree import fx_pytree, node_class, pytree
from .cache_narrowing import narrowed_index, narrowed_leaves, widened_spec
from .cleanup import spec_node
from .reuse_plan import ReuseFallback


def _custom(spec: pytree.TreeSpec) -> bool:
    """A custom pytree object (a ``Cache``): not a tuple, list or dict (or a subclass: a
    namedtuple, a ``ModelOutput``), nor None."""
    kind = node_class(spec)
    return not spec.is_leaf() and kind is not type(None) and (kind is None or not issubclass(kind, (tuple, list, dict)))


def _parts(spec: pytree.TreeSpec, start: int = 0) -> list[tuple[int, pytree.TreeSpec]]:
    """``(first leaf index, subtree)`` of each custom object (a cache) in ``spec``, in leaf order."""
    if _custom(spec):
        return [(start, spec)]
    found = []
    for child in spec.children():
        found += _parts(child, start)
        start += child.num_leaves
    return found


def _replaced(spec: pytree.TreeSpec, new: list[pytree.TreeSpec]) -> pytree.TreeSpec:
    """``spec`` with its custom objects (:func:`_parts`, in order) replaced by ``new`` (consumed)."""
    if _custom(spec):
        return new.pop(0)
    if spec.is_leaf():
        return spec
    return pytree.TreeSpec(spec.type, spec.context, [_replaced(child, new) for child in spec.children()])


def _narrowed(spec: Any) -> bool:
    return isinstance(spec, pytree.TreeSpec) and any(narrowed_index(sub) is not None for _, sub in _parts(spec))


def widen_narrowed_calls(graph: Graph, attrs: dict[str, Any]) -> None:
    """Give the calls a cleaned parent graph makes with stand-in caches the whole cache.

    Walking the graph in order, the newest value of each leaf of the whole cache is kept (from
    the flattens of call outputs and of the graph's inputs): a rebuild of a stand-in becomes a
    rebuild of the whole cache, in the state the previous call left it, from those values; a
    flatten of a stand-in's new state becomes a flatten of the whole cache written back (its
    ``getitem`` readers renumbered); a later rebuild of the whole cache (the model's returned
    cache) takes the newest values too.

    Args:
        graph: a parent graph after :func:`~.cleanup.clean_graph`, before its state rewrites.
        attrs: ``{get_attr target: value}`` of the graph's owner (``_spec_N`` attributes are added).

    Raises:
        ReuseFallback: a stand-in is rebuilt before the graph holds the whole cache, or from a
            cache in another state, or a flatten of a call's output is used otherwise than by
            ``getitem``: only an export with the whole cache would be exact.
    """
    if not any(_narrowed(value) for value in attrs.values()):
        return
    widening = _Widening(graph, attrs)
    for node in list(graph.nodes):
        if node.op != "call_function" or len(node.args) < 2 or not isinstance(node.args[1], Node):
            continue
        spec = attrs.get(str(node.args[1].target))
        if not isinstance(spec, pytree.TreeSpec):
            continue
        if node.target is pytree.tree_unflatten:
            widening.rebuild(node, spec)
        elif node.target is fx_pytree.tree_flatten_spec:
            widening.flatten(node, spec)


class _Widening:
    """The newest leaves of the whole cache while walking a graph (see :func:`widen_narrowed_calls`).

    Attributes:
        spec: the whole cache's spec as the graph last saw it (None before).
        leaves: its leaves' newest values, in spec order.
        same: ``{node: an earlier node holding the same value}``: a leaf a widened call's output
            gives back unchanged is the leaf the call was given.
    """

    def __init__(self, graph: Graph, attrs: dict[str, Any]):
        self.graph, self.attrs = graph, attrs
        self.spec: pytree.TreeSpec | None = None
        self.leaves: list[Any] = []
        self.same: dict[Any, Any] = {}

    def _first(self, value: Any) -> Any:
        """The earliest node known to hold ``value``'s value."""
        while isinstance(value, Node) and value in self.same:
            value = self.same[value]
        return value

    def _newest(self, old: list[Any], positions: list[int]) -> None:
        """Check that the leaves ``old`` hold the values of the newest leaves at ``positions``.

        Raises:
            ReuseFallback: one holds another value (a cache rebuilt from other tensors).
        """
        if any(self._first(a) is not self._first(self.leaves[k]) for a, k in zip(old, positions)):
            raise ReuseFallback("a cache is rebuilt from values other than its layers' newest")

    def rebuild(self, node: Node, spec: pytree.TreeSpec) -> None:
        parts = _parts(spec)
        if not parts:
            return
        old = list(cast(list[Any], node.args[0]))
        leaves: list[Any] = []
        new_parts: list[pytree.TreeSpec] = []
        done = 0
        for start, sub in parts:
            leaves += old[done:start]
            done = start + sub.num_leaves
            index = narrowed_index(sub)
            if index is not None:
                narrow = narrowed_leaves(self.spec, index) if self.spec is not None else None
                if narrow is None or narrow[0] != sub:
                    raise ReuseFallback("a layer's cache stand-in was made from a cache in another state")
                self._newest(old[start:done], narrow[1])
                leaves += self.leaves
                new_parts.append(cast(pytree.TreeSpec, self.spec))  # narrow is None without it
            elif sub == self.spec:
                self._newest(old[start:done], list(range(sub.num_leaves)))
                leaves += self.leaves  # the same cache, as the latest call left it
                new_parts.append(sub)
            else:
                self.spec, self.leaves = sub, old[start:done]
                leaves += self.leaves
                new_parts.append(sub)
        leaves += old[done:]
        new_spec = _replaced(spec, new_parts)
        if new_spec == spec and leaves == old:
            return
        rebuilt = tuple(leaves) if isinstance(node.args[0], tuple) else leaves
        node.args = (rebuilt, self._spec(node, new_spec), *node.args[2:])

    def flatten(self, node: Node, spec: pytree.TreeSpec) -> None:
        parts = _parts(spec)
        if not parts:
            return
        getitems: dict[int, list[Node]] = {}
        for user in node.users:
            if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)):
                if any(narrowed_index(sub) is not None for _, sub in parts):
                    raise ReuseFallback("a flatten of a layer's output is read otherwise than by getitem")
                self.spec = None  # the leaves it gives are not all known: no stand-in may follow
                return
            getitems.setdefault(user.args[1], []).append(user)
        moved: dict[int, int] = {}  # old leaf index -> new
        new_parts, widened = [], []
        done = shift = 0
        for start, sub in parts:
            moved.update({k: k + shift for k in range(done, start)})
            done = start + sub.num_leaves
            new_start = start + shift
            if narrowed_index(sub) is not None:
                if self.spec is None:
                    raise ReuseFallback("a layer's cache stand-in was made before the graph held the cache")
                whole, origins = widened_spec(self.spec, sub)
                moved.update({start + k: new_start + j for j, (ours, k) in enumerate(origins) if ours})
                new_parts.append(whole)
                shift += whole.num_leaves - sub.num_leaves
                widened.append((new_start, whole, {j: self.leaves[k] for j, (ours, k) in enumerate(origins)
                                                   if not ours}))
            else:
                moved.update({k: k + shift for k in range(start, done)})
                new_parts.append(sub)
                widened.append((new_start, sub, {}))
        moved.update({k: k + shift for k in range(done, spec.num_leaves)})
        new_spec = _replaced(spec, new_parts)
        if new_spec != spec:
            for k, users in getitems.items():
                for user in users:
                    user.args = (node, moved[k])
            node.args = (node.args[0], self._spec(node, new_spec), *node.args[2:])
            getitems = {moved[k]: users for k, users in getitems.items()}
        for start, sub, unchanged in widened:  # the cache as this flatten reads it is the newest
            self.spec, self.leaves = sub, [self._getitem(node, start + k, getitems) for k in range(sub.num_leaves)]
            self.same.update({self.leaves[j]: before for j, before in unchanged.items()})

    def _spec(self, node: Node, spec: pytree.TreeSpec) -> Node:
        """The ``get_attr`` node ``node`` is to read ``spec`` off: its own, holding ``spec`` now, when
        nothing else reads that attribute (the graph keeps export's names), else a new one."""
        old = cast(Node, node.args[1])
        target = str(old.target)
        if len(old.users) == 1 and sum(1 for n in self.graph.nodes if n.op == "get_attr" and n.target == target) == 1:
            self.attrs[target] = spec
            if self.graph.owning_module is not None:
                setattr(self.graph.owning_module, target, spec)
            return old
        return spec_node(self.graph, self.attrs, spec, before=node)

    def _getitem(self, flatten: Node, index: int, getitems: dict[int, list[Node]]) -> Node:
        """A ``getitem`` of leaf ``index`` off ``flatten``, made when there is none."""
        if index in getitems:
            return getitems[index][0]
        with self.graph.inserting_after(flatten):
            made = self.graph.call_function(operator.getitem, (flatten, index))
        getitems[index] = [made]
        return made
