"""Fake propagation of a compiled graph: each node's value as a fake tensor (shape, dtype, device).

:class:`FakeValues` is a ``torch.fx.Interpreter``, as fx's ``FakeTensorProp`` is, run under a
fake-tensor mode (:func:`~nnbridge.compat.torch.fake_values.fake_mode`). It starts from what
extraction recorded: a placeholder's value is a fake tensor with the sizes, strides, dtype and
device of its recorded value (:mod:`.pass_inputs`, export's metadata, sizes at their example
values); parameters and buffers become fake copies. A ``call_module`` node runs the child's graph
the same way (an opaque child gives its recorded ``val``, when there is one). A value it cannot
rebuild (a state object such as a cache) is :data:`UNKNOWN`; an op with an unknown input takes its
own recorded ``val`` (fresh), else is unknown too; an op that fails on fake tensors is unknown and
its failure is kept in :attr:`FakeValues.failure` (the first one). Example::

    values = FakeValues(graph_module, fake_mode())
    out = values.propagate()            # the output, with fake tensors as leaves
    values.calls["self_attn"]           # (args, kwargs) the child call received
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.node import Argument, Target, map_aggregate

from ..compat.torch.fake_values import fake_from, is_fake
from ..compat.torch.pytree import pytree
from ..compat.torch.symbolic import has_hint, symbolic_hint
from ..graph.graph_module import CompiledGraphModule
from ..graph.metadata import node_name


class _Unknown:
    """A value fake propagation could not compute."""

    def __repr__(self) -> str:
        return "UNKNOWN"


#: a value :class:`FakeValues` could not compute
UNKNOWN: Any = _Unknown()


def has_unknown(value: Any) -> bool:
    """Whether ``value`` (a pytree of fx arguments) holds :data:`UNKNOWN`."""
    found = False

    def visit(item: Any) -> Any:
        nonlocal found
        found = found or item is UNKNOWN
        return item
    map_aggregate(value, visit)
    return found


def _fake_of_val(val: Any) -> Any:
    """A fresh fake value (under the active fake mode) like export's ``val`` metadata."""
    if isinstance(val, torch.Tensor):
        if not all(has_hint(s) for s in (*val.shape, *val.stride())):
            return UNKNOWN  # a data-dependent size has no example value
        return torch.empty_strided([symbolic_hint(s) for s in val.shape], [symbolic_hint(s) for s in val.stride()],
                                   dtype=val.dtype, device=val.device)
    if isinstance(val, torch.SymInt):
        return symbolic_hint(val) if has_hint(val) else UNKNOWN
    if val is None or isinstance(val, (bool, int, float, str)):
        return val
    if type(val) in (tuple, list):
        return type(val)(_fake_of_val(v) for v in val)
    if type(val) is dict:
        return {k: _fake_of_val(v) for k, v in val.items()}
    return UNKNOWN


class FakeValues(Interpreter):
    """Fake propagation of one graph (see the module docstring).

    Args:
        module: the graph module (a :class:`~nnbridge.graph.graph_module.CompiledGraphModule`, or a
            plain ``GraphModule`` whose ``call_module`` targets are graph modules).
        mode: the fake-tensor mode to run in (children share it).
        inputs: ``{placeholder target: value}`` for a child's call; placeholders not in it start
            from ``recorded`` or, failing that, their own ``node.meta["val"]``.
        recorded: ``{placeholder target: recorded value}`` (:func:`~.pass_inputs.recorded_inputs`:
            fake or real tensors, constants): a fresh fake value like it is the placeholder's.
        where: the graph's NodePath, for :attr:`failure`.

    Attributes:
        failure: the first node that failed, with its error (``"model.layers_0.add: RuntimeError: ..."``).
        calls: ``{call_module node name: (args, kwargs)}`` each child call received.
    """

    def __init__(self, module: GraphModule, mode: Any, *, inputs: dict[str, Any] | None = None,
                 recorded: dict[str, Any] | None = None, where: str = ""):
        super().__init__(module, garbage_collect_values=False)
        self.mode = mode
        self.inputs = inputs or {}
        self.recorded = recorded or {}
        self.where = where
        self.failure: str | None = None
        self.calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self._node: Node | None = None

    def propagate(self) -> Any:
        """Run every node; the output value (:data:`UNKNOWN` leaves where not computed)."""
        with self.mode:
            return self.run(enable_io_processing=False)

    def run_node(self, n: Node) -> Any:
        self._node = n
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if n.op not in ("output", "call_module") and has_unknown((args, kwargs)):
            # an op whose inputs were not rebuilt (a cache's tensors): its recorded value, if any
            return _fake_of_val(n.meta["val"]) if "val" in n.meta else UNKNOWN
        try:
            return getattr(self, n.op)(n.target, args, kwargs)
        except Exception as error:  # noqa: BLE001 - a value not computed; the check decides whether it matters
            if self.failure is None:
                line = (str(error).strip().splitlines() or [""])[0][:300]
                self.failure = f"{self._path(n)}: {type(error).__name__}: {line}"
            return UNKNOWN

    def _path(self, n: Node) -> str:
        return f"{self.where}.{node_name(n)}" if self.where else node_name(n)

    @property
    def node(self) -> Node:
        assert self._node is not None
        return self._node

    def placeholder(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Any]) -> Any:
        if str(target) in self.inputs:
            return self.inputs[str(target)]
        if str(target) in self.recorded:
            return _fake_of_val(self.recorded[str(target)])
        if "val" not in self.node.meta:
            return UNKNOWN
        return _fake_of_val(self.node.meta["val"])

    def get_attr(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Any]) -> Any:
        value = self.fetch_attr(str(target))
        if isinstance(value, torch.Tensor) and not is_fake(value):
            return fake_from(self.mode, value)
        return value

    def call_module(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Any]) -> Any:
        node = self.node
        self.calls[node_name(node)] = (args, kwargs)
        module = self.module
        child = module.child_graph(node) if isinstance(module, CompiledGraphModule) else self.fetch_attr(str(target))
        if not isinstance(child, GraphModule):  # an opaque child runs its own code: its recorded value
            return _fake_of_val(node.meta["val"]) if "val" in node.meta else UNKNOWN
        placeholders = [str(n.target) for n in child.graph.nodes if n.op == "placeholder"]
        inputs = dict(zip(placeholders, args))
        inputs.update(kwargs)
        inner = FakeValues(child, self.mode, inputs=inputs, where=self._path(node))
        result = inner.run(enable_io_processing=False)
        if self.failure is None and inner.failure is not None:
            self.failure = inner.failure
        return result


def leaf_metadata(value: Any) -> tuple[Any, list[Any]]:
    """``(pytree spec, [per leaf: (sizes, dtype, device) of a tensor, UNKNOWN, or the type name])``."""
    leaves, spec = pytree.tree_flatten(value)
    described = []
    for leaf in leaves:
        if leaf is UNKNOWN:
            described.append(UNKNOWN)
        elif isinstance(leaf, torch.Tensor):
            described.append((tuple(leaf.shape), leaf.dtype, leaf.device))
        else:
            described.append(type(leaf).__name__)
    return spec, described


def describe_leaf(leaf: Any) -> str:
    """``Tensor(1, 8, 64) float32 cpu`` for a tensor's metadata; the type name otherwise."""
    if isinstance(leaf, tuple) and len(leaf) == 3:
        sizes, dtype, device = leaf
        return f"Tensor({', '.join(str(s) for s in sizes)}) {str(dtype).removeprefix('torch.')} {device}"
    return str(leaf)
