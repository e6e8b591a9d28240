"""Walk an extracted hierarchy by NodePath: children of a graph, resolution, example values.

A *graph* entry is a submodule graph (:class:`CompiledGraphModule` or :class:`OpaqueGraphModule`);
a *node* entry is a node with an op point (op, placeholder, parameter, output). Opaque modules list
their ``forward()`` arguments, then parameters and buffers, then children, then ``output``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch

from .extraction import copy_inputs
from .graph_module import CompiledGraphModule, GraphModuleBase, OpaqueGraphModule

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def _opaque_children(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    for name, child in module.named_children():
        if isinstance(child, _CONTAINERS):
            yield from _opaque_children(child, f"{prefix}{name}_")
        else:
            yield prefix + name, child


def children(module: GraphModuleBase) -> list[tuple[str, GraphModuleBase | None]]:
    """``(name, child graph or None for a node)`` in display order."""
    if isinstance(module, CompiledGraphModule):
        points = set(module.point_names)
        return [(name, module.child_graph(node) if node.op == "call_module" else None)
                for name, node in module.named_nodes() if node.op == "call_module" or name in points]
    assert isinstance(module, OpaqueGraphModule)
    names = list(module.point_names)
    kids: list[tuple[str, GraphModuleBase | None]] = [(n, None) for n in names[:-1]]
    kids += [(n, c) for n, c in _opaque_children(module) if isinstance(c, GraphModuleBase)]
    kids.append((names[-1], None))
    return kids


def child(module: GraphModuleBase, segment: str) -> tuple[str, GraphModuleBase | None] | None:
    """The child named ``segment`` (None when there is none)."""
    for name, sub in children(module):
        if name == segment:
            return name, sub
    return None


def walk(module: GraphModuleBase, prefix: str = "") -> Iterator[tuple[str, GraphModuleBase, str, GraphModuleBase | None]]:
    """Every entry below ``module``: ``(path, owner, name, child graph or None)``, depth first."""
    for name, sub in children(module):
        path = f"{prefix}{name}"
        yield path, module, name, sub
        if sub is not None:
            yield from walk(sub, path + ".")


def split_segments(module: GraphModuleBase, segments: tuple[str, ...]) -> list[str] | None:
    """Map nnsight spelling onto NodePath segments (``h``, ``0`` -> ``h_0``); None if impossible."""
    out: list[str] = []
    current: GraphModuleBase | None = module
    i = 0
    while i < len(segments):
        if current is None:
            return None
        found = child(current, segments[i])
        if found is None and i + 1 < len(segments):
            joined = f"{segments[i]}_{segments[i + 1]}"
            found = child(current, joined)
            if found is not None:
                i += 1
        if found is None:
            return None
        out.append(found[0])
        current = found[1]
        i += 1
    return out


def resolve_all(module: GraphModuleBase, segments: list[str]) -> list[tuple[GraphModuleBase, str]]:
    """``(owner, node name)`` for a node path in this tree and in every other extraction of the
    children of opaque modules on the way (their dispatchers may hold several)."""
    head, rest = segments[0], segments[1:]
    found = child(module, head)
    if found is None:
        return []
    name, sub = found
    if not rest:
        return [(module, name)] if sub is None else []
    if sub is None:
        return []
    alternatives: list[GraphModuleBase] = [sub]
    if isinstance(module, OpaqueGraphModule):
        dispatcher = module.__dict__.get("child_dispatchers", {}).get(name)
        if dispatcher is not None:
            alternatives = [e.root for e in dispatcher.all_extractions()]
    return [hit for alt in alternatives for hit in resolve_all(alt, rest)]


def summarize(value: Any) -> Any:
    """What inspection keeps of an example value: ``torch.Size`` for tensors, containers of
    summaries for tuples/lists/dicts, the type name otherwise."""
    if isinstance(value, torch.Tensor):
        return value.shape
    if isinstance(value, (tuple, list)):
        return type(value)(summarize(v) for v in value) if type(value) in (tuple, list) else [summarize(v) for v in value]
    if isinstance(value, dict):
        return {k: summarize(v) for k, v in value.items()} if type(value) is dict else _Named(type(value).__name__, {k: summarize(v) for k, v in value.items()})
    return type(value).__name__


class _Named(dict):
    """A dict summary that remembers the container's class name (``CausalLMOutputWithPast``)."""

    def __init__(self, type_name: str, items: dict[str, Any]):
        super().__init__(items)
        self.type_name = type_name


def record_examples(root: GraphModuleBase, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Run ``root`` once on the example inputs with every node listened, storing summaries in each
    graph module's ``examples`` dict (``{node name: summary}``).

    A node is listened in every extraction of its module (the children of opaque modules extract on
    their own and may hold several), each storing into the graph ``pg.graph`` shows. When the run
    made new extractions (a child whose earlier graph came from a no-grad observed run extracts
    again under grad), nodes they ran are missed: the run is repeated once, listening to them too.
    """
    for attempt in range(2):
        listeners = []
        for path, owner, name, sub in walk(root):
            if sub is not None:
                continue
            store = owner.__dict__.setdefault("examples", {})

            def record(value: Any, store: dict = store, name: str = name) -> Any:
                store.setdefault(name, summarize(value))
                return value
            targets = resolve_all(root, path.split(".")) or [(owner, name)]
            for target, target_name in targets:
                point = target.op_point(target_name)
                point.add_listener(record, refresh=False)
                listeners.append((point, record))
        before = len(listeners)
        refresh_all(point for point, _ in listeners)
        try:
            # on copies: a cache argument would be updated in place. In the caller's grad mode (the
            # mode the example was extracted in)
            root(*copy_inputs(args), **copy_inputs(kwargs))
        finally:
            for point, record in listeners:
                point.remove_listener(record, refresh=False)
            refresh_all(point for point, _ in listeners)
        missing = any(sub is None and name not in owner.__dict__.get("examples", {})
                      for _, owner, name, sub in walk(root))
        if not missing or sum(1 for path, _, _, sub in walk(root) if sub is None
                              for _ in resolve_all(root, path.split("."))) <= before:
            return


def refresh_all(points: Any) -> None:
    """Refresh the routing of every distinct owner of ``points`` once."""
    owners = {id(owner): owner for p in points for owner in p.owners()}
    for owner in owners.values():
        owner.refresh_routing()


def _size(value: torch.Tensor) -> torch.Size:
    """The example's concrete sizes of a (fake) tensor whose dimensions may be symbolic."""
    return torch.Size(int(s.node.hint) if isinstance(s, torch.SymInt) else int(s) for s in value.shape)


def _from_val(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _size(value)
    if isinstance(value, (torch.SymInt, int)):
        return "int"
    if isinstance(value, (torch.SymFloat, float)):
        return "float"
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_size(v) for v in value) if type(value) in (tuple, list) else [_size(v) for v in value]
    return None


def _from_spec(spec: Any, leaves: Iterator[Any]) -> Any:
    """Summary of ``tree_unflatten(leaves, spec)`` built from the spec alone (never unflattens:
    custom pytree types keep state in their spec)."""
    if spec.is_leaf():
        return next(leaves)
    children = [_from_spec(child, leaves) for child in spec.children()]
    kind = spec.type
    if kind in (tuple, list):
        return kind(children)
    if kind is dict:
        return dict(zip(spec.context, children))
    if kind is not None and issubclass(kind, dict):
        return _Named(kind.__name__, dict(zip(spec.context, children)))
    if kind is not None and issubclass(kind, (tuple, list)):
        return list(children)
    return getattr(kind, "__name__", "object")


_UNKNOWN = object()  # a value export kept no metadata for


def _missing(summary: Any) -> bool:
    if summary is _UNKNOWN:
        return True
    if isinstance(summary, torch.Size):
        return False
    if isinstance(summary, (tuple, list)):
        return any(_missing(s) for s in summary)
    if isinstance(summary, dict):
        return any(_missing(s) for s in summary.values())
    return False


def static_examples(module: GraphModuleBase, inputs: dict[str, Any], attrs: dict[str, Any] | None = None) -> Any:
    """Fill ``module.examples`` from export's metadata (fake tensors, sizes of the example call).

    Args:
        module: an extracted graph.
        inputs: ``{placeholder name: summary}`` of the call.

    Returns:
        The summary of the module's output, or None when some value is unknown (opaque modules,
        values export kept no metadata for): callers then fall back to :func:`record_examples`.
    """
    from torch.fx import Node
    from ..compat.pytree import fx_pytree
    from ..compat.pytree import pytree

    if not isinstance(module, CompiledGraphModule):
        return None
    examples: dict[str, Any] = {}
    values: dict[Node, Any] = {}
    complete = True

    def of(arg: Any) -> Any:
        return pytree.tree_map(lambda leaf: values.get(leaf, _UNKNOWN) if isinstance(leaf, Node) else summarize(leaf), arg)

    for name, node in module.named_nodes():
        summary = _from_val(node.meta.get("val"))
        if node.op == "placeholder":
            summary = inputs.get(name, summary)
        elif node.op == "get_attr":
            attr = module
            for part in str(node.target).split("."):
                attr = getattr(attr, part)
            summary = summarize(attr)
        elif node.op == "call_module":
            child_module = module.child_graph(node)
            child_inputs = bind_inputs(child_module, of(node.args), of(node.kwargs))
            summary = static_examples(child_module, child_inputs) if child_inputs is not None else None
            complete = complete and summary is not None
            summary = _UNKNOWN if summary is None else summary
        elif node.op == "output":
            summary = _plain(of(node.args[0]))
        elif summary is None and node.target is fx_pytree.tree_flatten_spec:
            summary = "list"  # custom-pytree plumbing; its leaves carry metadata of their own
        elif summary is None and node.target is pytree.tree_unflatten:
            spec = getattr(module, str(node.args[1].target))
            summary = _from_spec(spec, iter(of(list(node.args[0]))))
        elif summary is None and node.target is operator.getitem:
            container = values.get(node.args[0], _UNKNOWN)
            try:
                summary = container[node.args[1]]
            except (KeyError, IndexError, TypeError):
                summary = _UNKNOWN
        elif summary is None:
            summary = _UNKNOWN
        values[node] = summary
        if node.op != "call_module":
            examples[name] = summary
            complete = complete and not _missing(summary)
    module.__dict__["examples"] = examples
    return values[next(n for n in module.graph.nodes if n.op == "output")] if complete else None


def _plain(summary: Any) -> Any:
    """fx's ``immutable_list``/``immutable_dict`` (graph argument containers) as list/dict."""
    if isinstance(summary, list) and type(summary) is not list:
        return [_plain(s) for s in summary]
    if isinstance(summary, dict) and type(summary) not in (dict, _Named):
        return {k: _plain(v) for k, v in summary.items()}
    if type(summary) is tuple:
        return tuple(_plain(s) for s in summary)
    return summary


def bind_inputs(module: GraphModuleBase, args: Any, kwargs: Any) -> dict[str, Any] | None:
    """``{placeholder name: value}`` for a call of a compiled graph (None for other kinds)."""
    if not isinstance(module, CompiledGraphModule):
        return None
    placeholders = [name for name, node in module.named_nodes() if node.op == "placeholder"]
    bound = dict(zip(placeholders, args))
    bound.update(kwargs)
    return bound


def describe_examples(root: GraphModuleBase, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Store example summaries on every graph of ``root``: statically from export's metadata when
    it describes every value, else by one recording run of the example inputs."""
    inputs = bind_inputs(root, [summarize(a) for a in args], {k: summarize(v) for k, v in kwargs.items()})
    if inputs is None or static_examples(root, inputs) is None:
        record_examples(root, args, kwargs)
