"""Let a module called with a string argument keep its own graph (torch 2.13 ``torch.export``).

``torch.export`` brackets every module whose call signature it preserves with the
``_export_tracepoint`` higher-order op, passing the call's flattened arguments through it.
``torch._export.wrappers`` accepts ``str`` leaves there (``check_flattened``), but the proxy
tracer's ``extract_val`` (``torch.fx.experimental.proxy_tensor``), which records each output's
example value, knows tensors, symbolic and plain numbers and ``None`` only, and fails with
``AssertionError: Expected code to be unreachable, but got: 'sliding_attention'``. Gemma 3's
``Gemma3RotaryEmbedding.forward(x, position_ids, layer_type)`` is such a module; without this shim
the export of its caller fails and nnbridge fell back to running the caller (``Gemma3TextModel``)
eagerly.

A string is a constant of the traced call (the graph is specialized to it, like every non-tensor
argument, and nnbridge's call-structure guards check it on each call), so its recorded example
value is the string itself.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental import proxy_tensor
from torch.fx.proxy import TracerBase

from .. import registry


@contextlib.contextmanager
def string_arguments_traced() -> Iterator[None]:
    """While the body runs, ``proxy_tensor.extract_val`` returns ``str`` values unchanged (torch
    2.13 raises ``AssertionError`` on them); restored afterwards, also on error."""
    original = proxy_tensor.extract_val

    def extract_val(val: Any, include_real: bool = False) -> Any:
        if isinstance(val, str):
            return val
        return original(val, include_real)

    with registry.replaced("string_arguments", proxy_tensor, "extract_val", value=extract_val):
        yield


def _tracepoint_node(target: Any, args: tuple[Any, ...]) -> bool:
    """An ``_export_tracepoint`` call, or a ``getitem`` of one's outputs."""
    tracepoint = torch.ops.higher_order._export_tracepoint
    if target is tracepoint:
        return True
    return target is operator.getitem and bool(args) and isinstance(args[0], Node) and args[0].target is tracepoint


@contextlib.contextmanager
def tracepoint_bookkeeping_skipped() -> Iterator[None]:
    """While the body runs, the nodes of ``_export_tracepoint`` calls and of the ``getitem``\\ s of
    their outputs get no recorded stack trace (``TracerBase.create_node``) and no ``tensor_meta``
    (``proxy_tensor.set_meta``; their ``val`` is recorded as usual). Restored afterwards, also on
    error.

    torch 2.13's export passes every leaf of a preserved module's inputs and outputs through a
    tracepoint, so a transformers ``Cache`` handed to each decoder layer and attention makes one
    tracepoint output per cache tensor at each boundary (SmolLM2-135M's decode step: 30 layers,
    60 cache tensors, ~7,000 outputs). Each would capture a Python stack and compute symbolic
    contiguity for every memory format; ``CollectTracepointsPass`` then removes these nodes,
    replacing each ``getitem`` by the tracepoint's input, and reads only their ``nn_module_stack``
    (kept) and their inputs' ``val``, so that bookkeeping is wasted work, and a large share of the
    exports of a ``generate`` with a cache.

    Their recorded ``val`` is the fake tensor that passed through (see :func:`_passed_through`),
    not a detached fake copy of it: a tracepoint returns its inputs themselves, and the pass only
    asks whether these values are tensors.
    """
    original_meta = proxy_tensor.set_meta
    original_node = TracerBase.create_node

    def set_meta(proxy: Any, val: Any) -> Any:
        node = proxy.node
        if node.op == "call_function" and _tracepoint_node(node.target, node.args):
            node.meta["val"] = _passed_through(val)
            return proxy
        return original_meta(proxy, val)

    def create_node(self: TracerBase, kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    name: str | None = None, type_expr: Any | None = None) -> Node:
        if kind == "call_function" and self.record_stack_traces and _tracepoint_node(target, args):
            self.record_stack_traces = False
            try:
                return original_node(self, kind, target, args, kwargs, name, type_expr)
            finally:
                self.record_stack_traces = True
        return original_node(self, kind, target, args, kwargs, name, type_expr)

    with registry.replaced("tracepoint_bookkeeping", proxy_tensor, "set_meta", value=set_meta), \
            registry.replaced("tracepoint_bookkeeping", TracerBase, "create_node", value=create_node):
        yield


def _passed_through(val: Any) -> Any:
    """The example value recorded for a tracepoint node (a tuple of the values it passed through)
    or a ``getitem`` of one (one of them): each fake tensor itself, as the tracepoint returned it,
    where torch's ``extract_val`` makes a detached fake copy of each (``snapshot_fake``) for every
    node. SmolLM2-135M's ``bridge()`` with its cache records 4,290 such values (2,145 tensors pass
    through 96 tracepoints: each layer's and attention's inputs and threaded outputs hold every
    filled cache layer, once in the tracepoint's tuple and once in its ``getitem``), and
    ``extract_val`` of a fake tensor with a symbolic size is costly at that count. Other values are
    ``extract_val``'s."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(val, FakeTensor):
        return val
    if type(val) in (tuple, list):
        return type(val)(_passed_through(item) for item in val)
    return proxy_tensor.extract_val(val)
