"""Value summaries: what inspection shows of an example value, and the pass that computes them.

A *summary* is ``torch.Size`` for a tensor, a tuple/list/dict of summaries for a container (a
``dict`` subclass such as ``CausalLMOutputWithPast`` keeps its class name), and the type name
(``"int"``) for anything else. :class:`ExampleSummaries` propagates summaries through a compiled
graph as fx's ``ShapeProp`` propagates shapes: a ``torch.fx.Interpreter`` whose nodes return
summaries computed from export's metadata (``node.meta["val"]``, fake tensors), writing each into
the node's :class:`~.metadata.NodeMeta`. Example::

    out = ExampleSummaries(graph, {"input_ids": torch.Size([1, 8])}).propagate()
    node_meta(graph.node("softmax")).example     # torch.Size([1, 4, 8, 8])
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Interpreter, Node
from torch.fx.node import Argument, Target, map_aggregate

from ..compat.torch.pytree import fx_pytree, node_class, pytree
from ..compat.torch.symbolic import has_hint, symbolic_hint
from .metadata import update_node_meta
from .state import write_state

if TYPE_CHECKING:
    from .graph_module import CompiledGraphModule, GraphModuleBase


class Named(dict):
    """A dict summary that remembers the container's class name (``CausalLMOutputWithPast``)."""

    def __init__(self, type_name: str, items: dict[str, Any]):
        super().__init__(items)
        self.type_name = type_name


#: A value export kept no metadata for (opaque children's results, some plumbing).
UNKNOWN: Any = object()

# Summaries stay typed ``Any`` here and where they are stored (``NodeMeta.example``, ``pg.graph``):
# they mirror arbitrary pytrees (``torch.Size`` leaves, type-name strings, :data:`UNKNOWN`, any
# dict key) and every reader tells them apart with ``isinstance``.


def summarize(value: Any) -> Any:
    """The summary of a concrete value (see module docstring)."""
    if isinstance(value, torch.Tensor):
        return value.shape
    if isinstance(value, (tuple, list)):
        return type(value)(summarize(v) for v in value) if type(value) in (tuple, list) else [summarize(v) for v in value]
    if isinstance(value, dict):
        items = {k: summarize(v) for k, v in value.items()}
        return items if type(value) is dict else Named(type(value).__name__, items)
    return type(value).__name__


def describe(summary: object) -> str:
    """One-line text of a summary: ``Tensor(1, 4, 8, 8)``, ``tuple(2)``, ``CausalLMOutputWithPast(2)``."""
    if isinstance(summary, torch.Size):
        return f"Tensor({', '.join(str(s) for s in summary)})"
    if isinstance(summary, Named):
        return f"{summary.type_name}({len(summary)})"
    if isinstance(summary, (tuple, list, dict)):
        return f"{type(summary).__name__}({len(summary)})"
    return str(summary)


def summary_children(summary: Any) -> list[tuple[str, Any]]:
    """``(name, summary)`` of a container summary's entries (``sub_0``... for sequences, as
    graphpatch named them; keys for dicts); empty for a leaf."""
    if isinstance(summary, torch.Size):
        return []
    if isinstance(summary, (tuple, list)):
        return [(f"sub_{i}", v) for i, v in enumerate(summary)]
    if isinstance(summary, dict):
        return [(str(k), v) for k, v in summary.items()]
    return []


def incomplete(summary: object) -> bool:
    """Whether some part of ``summary`` is :data:`UNKNOWN`."""
    if summary is UNKNOWN:
        return True
    if isinstance(summary, torch.Size):
        return False
    if isinstance(summary, (tuple, list)):
        return any(incomplete(s) for s in summary)
    if isinstance(summary, dict):
        return any(incomplete(s) for s in summary.values())
    return False


def _size(value: torch.Tensor) -> torch.Size | None:
    """The example's concrete sizes of a (fake) tensor whose dimensions may be symbolic; None when
    one is data-dependent (an unbacked size, such as ``nonzero``'s, has no example value)."""
    if any(isinstance(s, torch.SymInt) and not has_hint(s) for s in value.shape):
        return None
    return torch.Size(symbolic_hint(s) for s in value.shape)


def _from_val(value: Any) -> Any:
    """Summary of export's ``node.meta["val"]`` (None when it does not describe the value)."""
    if isinstance(value, torch.Tensor):
        return _size(value)
    if isinstance(value, (torch.SymInt, int)):
        return "int"
    if isinstance(value, (torch.SymFloat, float)):
        return "float"
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        sizes = [_size(v) for v in value]
        if any(size is None for size in sizes):
            return None
        return type(value)(sizes) if type(value) in (tuple, list) else sizes
    return None


def _from_spec(spec: pytree.TreeSpec, leaves: Iterator[Any]) -> Any:
    """Summary of ``tree_unflatten(leaves, spec)`` built from the spec alone (never unflattens:
    custom pytree types keep state in their spec)."""
    if spec.is_leaf():
        return next(leaves)
    children = [_from_spec(child, leaves) for child in spec.children()]
    kind = node_class(spec)
    if kind in (tuple, list):
        return kind(children)
    if kind is dict:
        return dict(zip(spec.context, children))
    if kind is not None and issubclass(kind, dict):
        return Named(kind.__name__, dict(zip(spec.context, children)))
    if kind is not None and issubclass(kind, (tuple, list)):
        return list(children)
    return getattr(kind, "__name__", "object")


def plain(summary: Any) -> Any:
    """fx's ``immutable_list``/``immutable_dict`` (graph argument containers) as list/dict."""
    if isinstance(summary, list) and type(summary) is not list:
        return [plain(s) for s in summary]
    if isinstance(summary, dict) and type(summary) not in (dict, Named):
        return {k: plain(v) for k, v in summary.items()}
    if type(summary) is tuple:
        return tuple(plain(s) for s in summary)
    return summary


def bind_inputs(module: GraphModuleBase, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """``{placeholder target (the argument's name): value}`` for a call of a compiled graph (None for
    other kinds)."""
    if not hasattr(module, "named_nodes"):
        return None
    placeholders = [str(node.target) for _, node in module.named_nodes() if node.op == "placeholder"]
    bound = dict(zip(placeholders, args))
    bound.update(kwargs)
    return bound


class ExampleSummaries(Interpreter):
    """Propagates summaries through a compiled graph, as fx's ``ShapeProp`` propagates shapes,
    storing each node's in its :class:`~.metadata.NodeMeta` ``example`` (and recursing into the
    child graphs of ``call_module`` nodes).

    Args:
        module: a :class:`~.graph_module.CompiledGraphModule`.
        inputs: ``{placeholder name: summary}`` of the example call.

    :meth:`propagate` returns the output's summary, or None when some value is unknown (an
    opaque child's result, a value export kept no metadata for): callers then record the
    examples by running the module (:func:`nnbridge.graph.hierarchy.record_examples`).
    """

    def __init__(self, module: CompiledGraphModule, inputs: dict[str, Any]):
        super().__init__(module, garbage_collect_values=False)
        self.graph_module = module
        self.inputs = inputs
        self.complete = True
        self._node: Node | None = None

    def propagate(self) -> Any:
        """Summaries for every node; the output's summary, or None when incomplete."""
        output = self.run(enable_io_processing=False)
        return output if self.complete else None

    def run_node(self, n: Node) -> Any:
        self._node = n
        summary = super().run_node(n)
        if n.op != "call_module":
            update_node_meta(n, example=summary)
            self.complete = self.complete and not incomplete(summary)
        return summary

    def fetch_args_kwargs_from_env(self, n: Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Arguments as summaries: a node's summary from the environment, a constant summarized."""
        def load(arg: Argument) -> Any:
            return self.env.get(arg, UNKNOWN) if isinstance(arg, Node) else summarize(arg)
        args = map_aggregate(n.args, load)
        kwargs = map_aggregate(n.kwargs, load)
        assert isinstance(args, tuple) and isinstance(kwargs, dict)
        return args, kwargs

    @property
    def node(self) -> Node:
        assert self._node is not None
        return self._node

    def _val(self) -> Any:
        return _from_val(self.node.meta.get("val"))

    def placeholder(self, target: Target, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.inputs.get(str(self.node.target), self._val())

    def get_attr(self, target: Target, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return summarize(self.fetch_attr(str(target)))

    def call_module(self, target: Target, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        child = self.graph_module.child_graph(self.node)
        child_inputs = bind_inputs(child, args, kwargs)
        summary = None
        if child_inputs is not None:
            summary = ExampleSummaries(child, child_inputs).propagate()  # type: ignore[arg-type]
        if summary is None:
            self.complete = False
            return UNKNOWN
        return summary

    def call_function(self, target: Target, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        summary = self._val()
        if summary is not None:
            return summary
        if target is fx_pytree.tree_flatten_spec:
            return "list"  # custom-pytree plumbing; its leaves carry metadata of their own
        if target is write_state:
            return summarize(None)  # state plumbing (a cache layer's update), returns None
        if target is pytree.tree_unflatten:
            spec = self.fetch_attr(str(self.node.args[1].target))  # type: ignore[union-attr]
            return _from_spec(spec, iter(list(args[0])))
        if target is operator.getitem:
            try:
                return args[0][self.node.args[1]]
            except (KeyError, IndexError, TypeError):
                return UNKNOWN
        return UNKNOWN

    def call_method(self, target: Target, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        summary = self._val()
        return UNKNOWN if summary is None else summary

    def output(self, target: Target, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        summary = plain(args[0])
        update_node_meta(self.node, example=summary)
        return summary


def recording_listener(store: dict[str, Any], name: str) -> Callable[[Any], Any]:
    """An op-point listener that keeps the first value's summary in ``store[name]``."""
    def record(value: Any) -> Any:
        store.setdefault(name, summarize(value))
        return value
    return record
