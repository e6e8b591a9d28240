"""A module whose graph reads an input ``torch.export.unflatten`` added is called with the
arguments eager passes it.

Layers reading their cache's length, looped over twice in one forward, get graphs that take an
extra leading input (a cache tensor of the root's, for a size: see
``nnbridge.extract.cleanup.drop_unused_extras``). The parent's graph passes it first; the call
site takes it off before calling the user's module, so torch hooks see eager's arguments, and gives
it back to the graph. Before, hooks saw four arguments where eager passes two, and a module that
fell back to its own extraction (a cache not in the state its parent's extraction saw) was called
with them: a TypeError where eager runs.

A forward pre-hook may replace a module's arguments. The graph the caller's extraction chose still
serves the call when only tensor values changed (``guards.call_structure.call_difference``); else
the module runs its own extraction for the new arguments, as a module called on its own.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nnbridge
from nnbridge.graph.metadata import node_meta
from nnbridge.inplace.bridging import bridge_of
from corpus.program_parts import CachedLayer, new_cache


class _Twice(nn.Module):
    """Two cached layers reading the cache's length, looped over twice."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([CachedLayer(0, "length"), CachedLayer(1, "length")])

    def forward(self, x, cache):
        for layer in self.layers:
            x = layer(x, cache)
        for layer in self.layers:
            x = layer(x, cache)
        return x


def _models():
    torch.manual_seed(0)
    model = _Twice().eval()
    return model, copy.deepcopy(model)


def _inputs():
    torch.manual_seed(1)
    return torch.randn(3, 4), torch.randn(2, 4)


def _decode(model):
    """A prefill call and a decode step on one cache; the outputs."""
    prefill, step = _inputs()
    cache = new_cache(2)
    with torch.no_grad():
        return [model(prefill, cache), model(step, cache)]


def _bridged(model):
    prefill, step = _inputs()
    cache = new_cache(2)
    with torch.no_grad():
        model(prefill, cache)  # unbridged: the example call is a decode step, as the failing one
    nnbridge.bridge(model, step, cache)
    return model


def _extra_calls(model):
    """The number of call sites that pass their callee's graph extra leading inputs."""
    found = 0
    for dispatcher in bridge_of(model).dispatchers.values():
        for extraction in dispatcher.all_extractions():
            graph = extraction.root
            found += sum(1 for n in graph.graph.nodes if n.op == "call_module" and node_meta(n).extra_args)
    return found


def _seen(log):
    def hook(module, args):
        log.append((module.layer_idx, len(args), [a.clone() if isinstance(a, torch.Tensor) else type(a) for a in args]))
    return hook


def test_hooks_see_the_arguments_eager_passes_a_graph_with_extra_inputs():
    model, ref = _models()
    _bridged(model)
    assert _extra_calls(model) > 0  # the case under test: some layer graph takes extra inputs
    logs = [], []
    for module, log in zip((ref, model), logs):
        for layer in module.layers:
            layer.register_forward_pre_hook(_seen(log))
    outputs = [_decode(ref), _decode(model)]
    for expected, actual in zip(*outputs):
        assert torch.equal(expected, actual)
    assert len(logs[0]) == len(logs[1]) == 8
    for (index, count, args), (index_b, count_b, args_b) in zip(*logs):
        assert (index_b, count_b) == (index, count) == (index, 2)
        assert torch.equal(args[0], args_b[0]) and args_b[1] is args[1]


def test_a_pre_hook_replacing_the_arguments_of_a_graph_with_extra_inputs_equals_eager():
    model, ref = _models()
    _bridged(model)

    def doubled(module, args):
        return (args[0] * 2, *args[1:])

    for module in (ref, model):
        module.layers[1].register_forward_pre_hook(doubled)
    for expected, actual in zip(_decode(ref), _decode(model)):
        assert torch.equal(expected, actual)


def test_a_fallback_from_a_graph_with_extra_inputs_calls_the_module_with_its_own_arguments():
    """A pre-hook empties cache layer 0 before the second loop: the layers' graphs see a cache
    they were not extracted for, and run their own extractions with eager's arguments."""
    model, ref = _models()
    _bridged(model)
    assert _extra_calls(model) > 0

    def emptied(module, args):
        module.calls = getattr(module, "calls", 0) + 1
        if module.calls % 2 == 0:  # the second loop of each forward
            cache = args[1]
            cache.layers[0] = type(cache.layers[0])()

    for module in (ref, model):
        module.layers[0].register_forward_pre_hook(emptied)
    expected = _decode(ref)
    actual = _decode(model)
    for e, a in zip(expected, actual):
        assert torch.equal(e, a)


@pytest.mark.parametrize("front_end", ["bridge", "nnsight"])
def test_the_corpus_check_compares_what_hooks_saw(front_end):
    """The differential corpus's check with ``hooks=True`` passes on the entry that found this."""
    from corpus import all_entries
    from corpus.harness import check

    entry = next(e for e in all_entries() if e.name == "fuzz_cached_length_read_twice")
    assert check(entry, front_end, "eval", nnsight_graphs=True, hooks=True) == []


class _SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)[0]


def test_a_pre_hook_replacing_aliased_arguments_by_distinct_ones_runs_what_eager_runs():
    """The root's graph passes one tensor as query, key and value (so the attention's graph takes the
    packed self-attention path); a pre-hook passes three distinct tensors, for which eager takes the
    other path: the module runs its own extraction for them (before, the root's choice: results
    off by rounding, 1e-7)."""
    torch.manual_seed(0)
    model = _SelfAttention().eval()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 5, 8)
    nnbridge.bridge(model, x)

    def apart(module, args, kwargs):
        return tuple(a + 0.5 for a in args), kwargs

    for m in (ref, model):
        m.attn.register_forward_pre_hook(apart, with_kwargs=True)
    expected, actual = ref(x), model(x)
    assert torch.equal(expected, actual)
    expected.sum().backward()
    actual.sum().backward()
    assert torch.equal(ref.attn.in_proj_weight.grad, model.attn.in_proj_weight.grad)


def test_call_difference_tells_sizes_from_what_the_callee_branches_on():
    from nnbridge.guards.call_structure import call_difference

    a, b = torch.randn(2, 3), torch.randn(2, 3)
    call = ((a, a, 2), {"mask": None})

    def kind(after):
        difference = call_difference(call, after)
        return None if difference is None else ("sized" if difference.sized else "unsized")

    assert kind(call) is None
    assert kind(((b, b, 2), {"mask": None})) is None  # values only
    assert kind(((a, b, 2), {"mask": None})) == "unsized"  # aliasing
    held = nn.Parameter(b, requires_grad=False)
    assert kind(((held, held, 2), {"mask": None})) == "unsized"  # class
    needs = b.clone().requires_grad_()
    assert kind(((needs, needs, 2), {"mask": None})) == "unsized"  # requires_grad
    square = torch.randn(3, 3)
    assert call_difference(((square,), {}), ((square.t(),), {})).sized is False  # memory layout
    assert kind(((b, b, 3), {"mask": None})) == "sized"  # a plain value
    assert kind(((b[:1], b[:1], 2), {"mask": None})) == "sized"  # sizes
    assert kind(((b.double(), b.double(), 2), {"mask": None})) == "sized"  # dtype
    assert kind(((b.t(), b.t(), 2), {"mask": None})) == "sized"  # sizes and layout
    assert kind(((b, b, 2), {})) == "sized"  # structure
    assert kind(((b, b, 2), {"mask": b})) == "sized"  # a tensor for a plain value
    assert kind(((b[:1], b, 2), {"mask": None})) == "sized"  # sizes win over aliasing
    assert kind(((needs, b[:1], 2), {"mask": None})) == "sized"  # sizes after requires_grad
    assert "leaf 1: a (1, 3) torch.float32 tensor" in call_difference(call, ((needs, b[:1], 2), {"mask": None})).text


class _Branching(nn.Module):
    """A branch on the size of a child's output: export bakes the example's side into the root's graph."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if h.shape[0] > 2:
            h = h * 3
        return self.b(h).sum(0)


def _branching():
    torch.manual_seed(0)
    model = _Branching()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    return model, ref, x


def test_a_forward_hook_replacing_the_output_by_other_values_equals_eager():
    model, ref, x = _branching()
    for m in (ref, model):
        m.a.register_forward_hook(lambda module, args, out: out * 2 - 1)
    assert torch.equal(ref(x), model(x))


def test_a_forward_hook_returning_other_sizes_raises_naming_the_module_and_the_sizes():
    """The root's graph took the branch for 2 rows; eager takes the other one for the hook's 4: before,
    a silent difference."""
    model, ref, x = _branching()
    handle = model.a.register_forward_hook(lambda module, args, out: torch.cat([out, out]))
    with pytest.raises(nnbridge.NNBridgeError, match=r"forward hook, wrapper or nnsight edit .* of 'a' \(Linear\)"
                                                     r" replaced its output .*"
                                                     r"\(4, 4\) torch.float32 tensor on cpu where it was \(2, 4\)"):
        model(x)
    handle.remove()
    assert torch.equal(ref(x), model(x))  # nothing left behind


@pytest.mark.parametrize("replaced", ["sizes", "dtype", "structure"])
def test_a_pre_hook_passing_other_sizes_dtypes_or_structure_raises_naming_the_module(replaced):
    model, ref, x = _branching()
    new = {"sizes": lambda args: (torch.cat([args[0], args[0]]),),
           "dtype": lambda args: (args[0].double(),),
           "structure": lambda args: (args[0], None)}[replaced]
    handle = model.b.register_forward_pre_hook(lambda module, args: new(args))
    with pytest.raises(nnbridge.NNBridgeError,
                       match=r"forward pre-hook, wrapper or nnsight edit .* of 'b' \(Linear\) replaced the arguments"):
        model(x)
    handle.remove()
    assert torch.equal(ref(x), model(x))


def test_an_nnsight_output_edit_of_other_sizes_raises_naming_the_module():
    """nnsight's ``.output = value`` acts as a forward hook does: plain nnsight takes the root's
    other branch for 4 rows, the root's graph was extracted for 2."""
    model, ref, x = _branching()
    wrapped = nnbridge.NNsight(model)
    wrapped.eager_module_traces = False
    with pytest.raises(nnbridge.NNBridgeError, match=r"nnsight edit .* of 'a' \(Linear\) replaced its output"):
        with wrapped.trace(x):
            wrapped.a.output = torch.cat([wrapped.a.output, wrapped.a.output])
    with wrapped.trace(x):
        wrapped.a.output = wrapped.a.output * 2
        out = wrapped.output.save()
    ref.a.register_forward_hook(lambda module, args, output: output * 2)
    assert torch.equal(out, ref(x))
