"""``pg.graph``: browse an extracted hierarchy in a REPL (graphpatch's NodePath inspection).

Attribute access walks NodePaths (``pg.graph.linear_0.output``), ``dir()`` lists the next
segments (tab completion), the repr draws the tree with the shapes observed on the example
inputs, ``_shape`` gives a ``torch.Size`` and ``_code`` the code behind a node. A view can be used
as a NodePath key in ``pg.patch``. A node's variable alias (``attn_weights_2`` for ``softmax``, see
:mod:`.aliases`) reaches the same view and is shown next to its name: ``softmax (attn_weights_2)``.
"""

from __future__ import annotations

import difflib
from collections import deque
from collections.abc import Iterator
from typing import Any, TypeVar, cast, overload

import torch
from torch.fx.node import Argument, Node, map_arg

from ..graph import hierarchy
from ..graph.absence import absence_reason
from ..graph.aliases import aliases_by_node, aliases_of, stack_frames
from ..graph.node_path import NodePathStr
from ..graph.summaries import describe, summary_children
from ..graph.graph_module import CompiledGraphModule, GraphModuleBase, OpaqueGraphModule
from .varargs_paths import variadic_elements


_T = TypeVar("_T")
_NO_SOURCE = "<no source recorded for this node>"


def _last_frame(stack_trace: str | None) -> str:
    """The innermost frame of a stack trace: the source line(s) that produced a node."""
    frames = stack_frames(stack_trace)
    return frames[-1] if frames else _NO_SOURCE


def _through_forward(stack_trace: str | None) -> list[str]:
    """The frames of a stack trace down to the innermost ``forward`` (the frames of helper
    functions below it, see :mod:`nnbridge.compat.torch.stack_traces`, left out)."""
    frames = stack_frames(stack_trace)
    last = max((i for i, frame in enumerate(frames) if frame.splitlines()[0].rstrip().endswith(" in forward")),
               default=len(frames) - 1)
    return frames[:last + 1]


def _first_trace(module: GraphModuleBase) -> str | None:
    if not isinstance(module, CompiledGraphModule):
        return None
    for node in module.graph.nodes:
        if node.meta.get("stack_trace"):
            return node.meta["stack_trace"]
        if node.op == "call_module":
            found = _first_trace(module.child_graph(node))
            if found:
                return found
    return None


def _calling_context(owner: CompiledGraphModule, child_graph: GraphModuleBase) -> str:
    """The line of the parent's forward that called a submodule: the frame of a child op's stack
    trace at the depth of the parent's own ops."""
    child_frames = _through_forward(_first_trace(child_graph))
    parent_depth = next((len(_through_forward(n.meta["stack_trace"])) for n in owner.graph.nodes
                         if n.op == "call_function" and n.meta.get("stack_trace")), None)
    if parent_depth is not None and 0 < parent_depth <= len(child_frames):
        return child_frames[parent_depth - 1]
    return child_frames[-2] if len(child_frames) >= 2 else _NO_SOURCE


class _Name:
    """A node shown by its NodePath name inside a printed value (``return (linear, add)``)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _return_line(owner: CompiledGraphModule, node: Node) -> str:
    """graphpatch's ``_code`` of an ``output`` node: the return statement, by NodePath names."""
    names = {n: name for name, n in owner.named_nodes()}

    def shown(n: Node) -> Argument:
        # map_arg only rebuilds the containers around the nodes: a _Name may stand in for a node
        return cast(Argument, _Name(names.get(n, n.name)))
    return f"return {map_arg(node.args[0], shown)!r}"


class ShapeView:
    """``_shape`` of a node whose value is a container (graphpatch's shape tree): attribute access
    by dig key (``pg.graph.output._shape.sub_0`` is a ``torch.Size``), indexing by position or key,
    ``unwrap()`` for the plain tuple/list/dict of ``torch.Size`` (non-tensor leaves as their type
    name), and a tree repr."""

    # set through object.__setattr__ (attribute access reads the shape's entries)
    _path: str
    _summary: Any

    def __init__(self, path: str, summary: Any):
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_summary", summary)

    @staticmethod
    def _view_of(path: str, summary: Any) -> Any:
        return ShapeView(path, summary) if summary_children(summary) else summary

    def __getattr__(self, key: str) -> Any:
        for name, value in summary_children(self._summary):
            if name == key:
                return self._view_of(f"{self._path}.{key}", value)
        raise AttributeError(f"No entry {key!r} in the shape of {self._path}; entries:"
                             f" {[name for name, _ in summary_children(self._summary)]}")

    def __getitem__(self, key: int | str) -> Any:
        children = summary_children(self._summary)
        if isinstance(key, int):
            return self._view_of(f"{self._path}.{children[key][0]}", children[key][1])
        return self.__getattr__(key)

    def __len__(self) -> int:
        return len(summary_children(self._summary))

    def __dir__(self) -> list[str]:
        return [name for name, _ in summary_children(self._summary)]

    def unwrap(self) -> Any:
        """The shapes as plain containers, e.g. ``(torch.Size([3, 3]), torch.Size([3, 3]))``."""
        def plain(summary: Any) -> Any:
            if isinstance(summary, (tuple, list)):
                return type(summary)(plain(v) for v in summary)
            if isinstance(summary, dict):
                return {k: plain(v) for k, v in summary.items()}
            return summary
        return plain(self._summary)

    def __eq__(self, other: object) -> bool:
        return self.unwrap() == (other.unwrap() if isinstance(other, ShapeView) else other)

    __hash__ = None  # type: ignore[assignment]  # unhashable, as __eq__ compares shapes (Python's idiom)

    def __repr__(self) -> str:
        lines = [f"{self._path}: {describe(self._summary)}"]

        def draw(summary: Any, indent: str) -> None:
            kids = summary_children(summary)
            for i, (name, value) in enumerate(kids):
                last = i == len(kids) - 1
                shown = f"torch.Size({list(value)})" if isinstance(value, torch.Size) else describe(value)
                lines.append(f"{indent}{'└─' if last else '├─'}{name}: {shown}")
                draw(value, indent + ("  " if last else "│ "))
        draw(self._summary, "")
        return "\n".join(lines)


class NodeView:
    """One entry of the hierarchy: a graph, a node, or a dug-into part of a node's value.

    Attributes are the next NodePath segments; ``_shape``, ``_code`` and ``_path`` describe it.
    """

    # set through object.__setattr__ (the view is read-only: __setattr__ raises)
    #: NodePath of this entry ("" for the root)
    _path: NodePathStr
    #: the graph holding the node (None for the root)
    _owner: GraphModuleBase | None
    #: node name in ``_owner``
    _node_name: str
    #: the graph this entry is, or None for a node
    _graph_module: GraphModuleBase | None
    #: summary of the node's value on the example call (``torch.Size`` for a tensor, see .summaries)
    _summary: Any
    #: dig keys into the node's value
    _dig: tuple[str, ...]
    #: the model the hierarchy was extracted from (its config names the attention implementation), or None
    _model: object

    def __init__(self, path: NodePathStr, owner: GraphModuleBase | None, name: str, *, graph: GraphModuleBase | None,
                 summary: Any = None, dig: tuple[str, ...] = (), model: object = None):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_node_name", name)
        object.__setattr__(self, "_graph_module", graph)
        object.__setattr__(self, "_summary", summary)
        object.__setattr__(self, "_dig", dig)

    # -- navigation -----------------------------------------------------------------------------
    def _child_views(self) -> list[tuple[str, NodeView]]:
        prefix = f"{self._path}." if self._path else ""
        if self._graph_module is not None:
            graph = self._graph_module
            return [(name, NodeView(NodePathStr(prefix + name), graph, name, graph=sub, summary=graph.example(name),
                                    model=self._model))
                    for name, sub in hierarchy.children(self._graph_module)]
        sep = "." if self._dig else "|"
        return [(key, NodeView(NodePathStr(f"{self._path}{sep}{key}"), self._owner, self._node_name, graph=None,
                               summary=value, dig=(*self._dig, key), model=self._model))
                for key, value in summary_children(self._summary)]

    def _child(self, item: str) -> NodeView | None:
        """The child named ``item``, or whose variable alias is ``item`` (canonical names first)."""
        children = self._child_views()
        for name, view in children:
            if name == item:
                return view
        target = aliases_of(self._graph_module).get(item) if isinstance(self._graph_module, CompiledGraphModule) else None
        found = next((view for name, view in children if name == target), None)
        if found is None and self._graph_module is not None:
            found = self._variadic(item)
        return found

    def _variadic(self, item: str) -> NodeView | None:
        """graphpatch's ``pg.graph.foos`` for a compiled graph's ``*foos`` (``**bars``): a view
        whose ``sub_0`` (``a``) is the element's placeholder, spelled ``foos|sub_0`` as graphpatch
        (see :mod:`.varargs_paths`); None when ``item`` is no variadic parameter."""
        graph = self._graph_module
        assert graph is not None
        elements = variadic_elements(graph, item)
        if not elements:
            return None
        examples = [graph.example(name) for _, name in elements]
        summary: Any = (tuple(examples) if elements[0][0] == "sub_0" and all(k.startswith("sub_") for k, _ in elements)
                        else {k: e for (k, _), e in zip(elements, examples)})
        prefix = f"{self._path}." if self._path else ""
        return NodeView(NodePathStr(prefix + item), graph, item, graph=None, summary=summary, model=self._model)

    def __getattr__(self, item: str) -> NodeView:
        found = self._child(item)
        if found is not None:
            return found
        raise AttributeError(missing_child(self, item, listing="dir() lists them"))

    def __dir__(self) -> list[str]:
        aliases = list(aliases_of(self._graph_module)) if isinstance(self._graph_module, CompiledGraphModule) else []
        return [name for name, _ in self._child_views()] + aliases + ["_code", "_shape", "_path"]

    def __setattr__(self, key: str, value: object) -> None:
        raise AttributeError("pg.graph is read-only; patch nodes with pg.patch({...})")

    # -- description ----------------------------------------------------------------------------
    # -- mapping interface (graphpatch's NodeData) ---------------------------------------------
    def keys(self) -> Iterator[str]:
        """Every NodePath below this view, relative to it, breadth first (dig paths with ``|``).

        Raises:
            ValueError: this view is a leaf (as graphpatch's mapping interface on a leaf).
        """
        self._require_children()
        queue: deque[tuple[str, NodeView]] = deque([("", self)])
        while queue:
            prefix, view = queue.popleft()
            for name, child in view._child_views():
                sep = "|" if (child._dig and len(child._dig) == 1) else "."
                path = f"{prefix}{sep}{name}" if prefix else name
                yield path
                queue.append((path, child))

    def __iter__(self) -> Iterator[str]:
        return self.keys()

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())

    def __bool__(self) -> bool:  # a view is a NodePath, true even when it is a leaf
        return True

    def __contains__(self, path: object) -> bool:
        return isinstance(path, str) and self._lookup(NodePathStr(path)) is not None

    def __getitem__(self, path: str) -> NodeView:
        """The view at ``path`` below this one: ``pg.graph["linear.output"]``; a dig may be written
        ``"output|sub_0"`` or, as graphpatch's mapping keys, ``"output.sub_0"``.

        Raises:
            KeyError: no such path (the message lists the closest ones).
            ValueError: this view is a leaf.
        """
        found = self._lookup(NodePathStr(path)) if isinstance(path, str) else None
        if found is None:
            close = difflib.get_close_matches(str(path), list(self.keys()), n=5, cutoff=0.4)
            hint = ""
            if isinstance(path, str) and self._graph_module is not None:
                hint = hierarchy.alias_hint(self._graph_module, tuple(path.replace("|", ".").split(".")), self._path)
            raise KeyError(f"No node {path!r} under {self._path or '<root>'}; closest: {close}.{hint}")
        return found

    @overload
    def get(self, path: str) -> NodeView | None: ...
    @overload
    def get(self, path: str, default: _T) -> NodeView | _T: ...

    def get(self, path: str, default: object = None) -> object:
        """``self[path]``, or ``default`` when there is no such path."""
        found = self._lookup(NodePathStr(path)) if isinstance(path, str) else None
        return default if found is None else found

    def _require_children(self) -> None:
        if self._graph_module is None and not summary_children(self._summary):
            raise ValueError(f"{self._path or '<root>'} is a leaf ({describe(self._summary)}); the mapping"
                             " interface (in, [], len, keys) applies to graphs and container values.")

    def _lookup(self, path: NodePathStr) -> NodeView | None:
        self._require_children()
        view = self
        for segment in path.replace("|", ".").split("."):
            found = view._child(segment)
            if found is None:
                return None
            view = found
        return view

    @property
    def _shape(self) -> torch.Size | ShapeView | None:
        """The ``torch.Size`` observed on the example inputs; for a container value a
        :class:`ShapeView` of its entries' shapes, and for a graph one of its nodes' and child
        graphs' shapes (``pg.graph._shape.linear.output``, as graphpatch); None for other values."""
        if isinstance(self._summary, torch.Size):
            return self._summary
        if self._graph_module is None and summary_children(self._summary):
            return ShapeView(self._path, self._summary)
        if self._graph_module is not None:  # graphpatch's shape tree of a graph: pg.graph._shape.add
            return ShapeView(self._path or "<root>", self._shape_tree())
        return None

    def _shape_tree(self) -> dict[str, Any]:
        """``{child: its summary}`` of a graph, a child graph as its own such dict."""
        return {name: view._shape_tree() if view._graph_module is not None else view._summary
                for name, view in self._child_views()}

    @property
    def _code(self) -> str:
        """Generated code (graphs), original source line(s) (nodes), or both (submodule calls)."""
        if self._graph_module is not None:
            graph = self._graph_module
            if isinstance(graph, CompiledGraphModule):
                code = graph.code
            else:
                assert isinstance(graph, OpaqueGraphModule), type(graph)  # the only other kind
                code = f"<opaque: runs {type(graph.original).__qualname__}.forward; reason: {graph.reason}>"
            code = code.strip("\n")
            if isinstance(self._owner, CompiledGraphModule):
                return f"Calling context:\n{_calling_context(self._owner, self._graph_module)}\nCompiled code:\n{code}"
            return code
        if isinstance(self._owner, CompiledGraphModule):
            node = self._owner.node(self._node_name)
            if node.op == "output":
                return _return_line(self._owner, node)
            return _last_frame(node.meta.get("stack_trace"))
        if isinstance(self._owner, OpaqueGraphModule):
            return f"<{self._node_name} of opaque module {type(self._owner.original).__qualname__}>"
        return ""

    def _alias(self) -> str | None:
        """The variable alias of this node (None for graphs, digs and nodes without one)."""
        if self._graph_module is not None or self._dig or not isinstance(self._owner, CompiledGraphModule):
            return None
        return aliases_by_node(self._owner).get(self._node_name)

    def _label(self, aliases: bool = True) -> str:
        name = self._path.rpartition(".")[2].rpartition("|")[2] if self._path else "<root>"
        if self._graph_module is not None:
            return f"{name}: {type(self._graph_module).__name__}"
        alias = self._alias() if aliases else None
        shown = f"{name} ({alias})" if alias else name
        return f"{shown}: {describe(self._summary)}"

    def _lines(self, indent: str, depth: int | None = None, aliases: bool = True) -> list[str]:
        if depth is not None and depth <= 0:
            return []
        lines = []
        kids = self._child_views()
        for i, (_, view) in enumerate(kids):
            last = i == len(kids) - 1
            lines.append(f"{indent}{'└─' if last else '├─'}{view._label(aliases)}")
            lines.extend(view._lines(indent + ("  " if last else "│ "), None if depth is None else depth - 1, aliases))
        return lines

    def __repr__(self) -> str:
        return "\n".join([self._label(), *self._lines("")])

    def __str__(self) -> str:
        """A module's view prints its tree (as ``repr``; ``print(pg.graph)``), a node's view its
        NodePath (``str(pg.graph.output.sub_0) == "output|sub_0"``, usable as a patch key)."""
        return repr(self) if self._graph_module is not None else self._path


def missing_child(view: NodeView, item: str, *, listing: str) -> str:
    """Why ``view`` has no child ``item``: the closest children by edit distance, how many there
    are and how to list them (``listing``: ``"dir() lists them"`` in a REPL, the command in a
    shell), and an alias close to ``item``."""
    names = [name for name, _ in view._child_views()]
    graph = view._graph_module
    subject = f"{view._path or '<root>'} has no child {item!r}"
    if graph is not None:  # it runs eagerly, or its attention has no such op: the one explanation says so
        where = f"{view._path or '<root>'} ({graph.original_type.__name__})"
        reason = absence_reason(item, where=where, ops=names, model=view._model,
                                opaque=graph.reason if isinstance(graph, OpaqueGraphModule) else None,
                                original=graph.original if isinstance(graph, OpaqueGraphModule) else None)
        if reason is not None:
            return f"{subject}: {reason}"
    close = difflib.get_close_matches(item, names, n=5, cutoff=0.4) or names[:5]
    hint = hierarchy.alias_hint(view._graph_module, (item,), view._path) if view._graph_module is not None else ""
    return f"{subject}; closest: {close} ({len(names)} children; {listing}).{hint}"


def format_tree(view: NodeView, depth: int | None = None, *, aliases: bool = False) -> str:
    """The tree under ``view`` (as its repr), limited to ``depth`` levels when given; with
    ``aliases``, each node's variable alias next to its name (``softmax (attn_weights_2)``), as
    the repr shows them."""
    return "\n".join([view._label(aliases), *view._lines("", depth, aliases)])
