"""Patterns extracted by nnbridge's own exporter, in the ATen normal form of the graphs they are
matched in.

A pattern specialised for one candidate (:mod:`.pattern_spec`) is extracted as any module is
(:func:`nnbridge.dispatch.dispatcher.extract`: non-strict ``torch.export``, cleanup, naming), with
static sizes (the candidate's own, as Dynamo specialises static sizes): ``x.mean(-1, keepdim=True)``
becomes ``aten.mean.dim(x, [-1], True)``, ``x.softmax(-1)`` ``aten.softmax.int(x, -1)``, exactly
as in the extracted graph, and a read of ``x.shape[-1]`` or ``x.dtype`` is a literal. The pattern
runs as the forward of a module whose children are its module slots; each slot is a stand-in
(:class:`SlotStandIn`) returning zeros of the value the candidate's call of the matched module
has, so the slot's call stays one ``call_module`` node (target: the slot's name), the form a
child's call has in nnbridge's per-module graphs. Tensor arguments are zeros of the candidate's
values' sizes, dtypes and devices. Example::

    def pattern(x, l0: CustomLinear):
        return torch.relu(l0(x))

    graph = export_pattern(pattern, constants={}, name="p", inputs={"x": fake_x}, calls={"l0": fake_out})
    [n.target for n in graph.graph.nodes]   # ['x', 'l0', aten.relu.default, 'output']
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from ..compat.torch.pytree import pytree
from ..errors import PatternError
from .pattern_graphs import PatternGraph, annotations_of, function_of, is_module_class, parameters_of, rooted


class SlotStandIn(torch.nn.Module):
    """Stands for a module slot while a pattern is extracted: any call returns zeros shaped as the
    matched call's value (``value``: fake tensors as leaves; other leaves are returned as they are).

    Args:
        value: the value the candidate's call of the matched module has.
    """

    def __init__(self, value: Any):
        super().__init__()
        # only sizes, dtypes and devices are kept: a tensor attribute would be read (and watched) by extraction
        self.value = value if value is LIKE_INPUT else pytree.tree_map(
            lambda v: _Spec(tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else v, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.value is LIKE_INPUT:
            first = next((a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)), None)
            if first is None:
                raise PatternError("a module slot called without a tensor argument has no value to stand for")
            return torch.zeros_like(first)
        return pytree.tree_map(lambda v: torch.zeros(v.shape, dtype=v.dtype, device=v.device)
                               if isinstance(v, _Spec) else v, self.value)


@dataclass(frozen=True)
class _Spec:
    """A tensor's sizes, dtype and device (a pytree leaf)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


#: a slot value standing for "zeros shaped as the call's first tensor argument": the guess a pattern
#: extracted from ``example_inputs=`` makes for a module call whose value it cannot know
LIKE_INPUT: Any = object()


def _real(value: torch.Tensor) -> torch.Tensor:
    return torch.zeros(value.shape, dtype=value.dtype, device=value.device)


def exportable(inputs: Mapping[str, Any], calls: Mapping[str, Any]) -> bool:
    """Whether every value in ``inputs`` is a tensor and every slot call's value is known
    (tensors and plain values, at least one tensor): a pattern is extracted from values; one
    without them is traced by torch.fx instead (:mod:`.pattern_spec`)."""
    def known(value: Any) -> bool:
        leaves = pytree.tree_leaves(value)
        return any(isinstance(v, torch.Tensor) for v in leaves) and all(
            isinstance(v, (torch.Tensor, bool, int, float, type(None))) for v in leaves)
    return all(isinstance(v, torch.Tensor) for v in inputs.values()) and all(known(v) for v in calls.values())


def export_pattern(pattern: Any, *, constants: Mapping[str, Any], name: str, inputs: Mapping[str, torch.Tensor],
                   calls: Mapping[str, Any]) -> PatternGraph:
    """``pattern`` extracted for one candidate (see the module docstring).

    Args:
        constants: the bound constants.
        name: the pattern's name, for messages.
        inputs: ``{tensor argument: the candidate's value}`` (fake or real tensors); an argument
            without one is passed as None (a pattern that uses it fails to extract).
        calls: ``{module slot: the value of the candidate's call of the matched module}``; a slot
            not given stands for zeros shaped as its call's first tensor argument (:data:`LIKE_INPUT`).

    Returns:
        A :class:`~.pattern_graphs.PatternGraph` of the extracted graph (ATen ops, ``call_module``
        nodes for slots, placeholders named by the tensor arguments); ``dropped``: the tensor
        arguments unused for these values.

    Raises:
        PatternError: extraction failed, or the extracted pattern returns no computed value (for
            this candidate's values it is an identity, as ``x.float()`` of a float32 ``x``).
    """
    from ..dispatch.dispatcher import extract  # surgery runs above the dispatch layer
    from ..extract.options import ExtractionOptions

    function = function_of(pattern, "pattern")
    names = [p.name for p in parameters_of(function, name)]
    hints = annotations_of(function)
    slots = {n: hints[n] for n in names if n not in constants and is_module_class(hints.get(n))}
    free = [n for n in names if n not in constants and n not in slots and isinstance(inputs.get(n), torch.Tensor)]
    holder = torch.nn.Module()
    for slot in slots:
        holder.add_module(slot, SlotStandIn(calls.get(slot, LIKE_INPUT)))

    def bound(*tensors: Any) -> Any:
        values = dict(zip(free, tensors))
        values.update(constants)
        values.update((slot, getattr(holder, slot)) for slot in slots)
        return function(*(values.get(n) for n in names))  # a tensor argument without a value is None

    root = rooted(holder, bound, free)
    options = ExtractionOptions(error_on_compilation_failure=True, allow_unused_submodules=True, dynamic_shapes=False,
                                reuse_layers=False, progress=False)
    try:
        extraction = extract(root, tuple(_real(inputs[n]) for n in free), {}, options=options)
    except Exception as error:  # noqa: BLE001 - any failure of the pattern's own code, said with its cause
        raise PatternError(f"the pattern {name} cannot be extracted with these values ({type(error).__name__}:"
                           f" {(str(error).splitlines() or [''])[0][:300]})") from error
    if not isinstance(extraction.root, GraphModule):
        raise PatternError(f"the pattern {name} has no graph for these values (it runs eagerly)")
    made = _pattern_graph(extraction.root.graph, name=name, free=free, slots=slots, keep=extraction.root)
    # (extracted with None for them: unused for these values)
    made.dropped += [n for n in names if n not in constants and n not in slots and n not in free]
    return made


def _pattern_graph(graph: Graph, *, name: str, free: list[str], slots: Mapping[str, type[torch.nn.Module]],
                   keep: Any) -> PatternGraph:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(free):
        raise PatternError(f"the extracted pattern {name} takes {len(placeholders)} inputs, not its {len(free)}"
                           f" tensor arguments {free}")
    for node, argument in zip(placeholders, free):
        node.target = argument  # the matcher binds inputs by argument name
    output = next(n for n in graph.nodes if n.op == "output")
    value = output.args[0]
    values = list(value) if isinstance(value, (tuple, list)) else [value]
    if not values or any(not isinstance(v, Node) or v.op == "placeholder" for v in values) \
            or len(set(values)) != len(values):
        raise PatternError(f"for these values the pattern {name} returns {value!r}, no value it computes (an"
                           " identity: an op the exporter drops for these dtypes or sizes)")
    dropped = [str(n.target) for n in placeholders if not n.users]
    called = {str(n.target) for n in graph.nodes if n.op == "call_module"}
    used = [a for n, a in zip(placeholders, free) if n.users]
    result = PatternGraph(name, graph, {s: c for s, c in slots.items() if s in called}, used, dropped)
    result.exported = keep
    return result
