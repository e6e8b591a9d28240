"""Calls that eager PyTorch hands to ``__torch_function__`` (a tensor subclass of the user's, an
active TorchFunctionMode) are refused: graph code calls aten operators, which skip it, and the
numbers differed from eager without an error. Each front-end is compared with an untouched model."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import nnbridge
from nnbridge import PatchableGraph
from nnbridge.inplace.bridging import bridge_of
from nnbridge.compat.torch.overrides import function_override, overrides_torch_function
from nnbridge.errors import NNBridgeError
from utils import front_ends


class Doubled(torch.Tensor):
    """Doubles what ``F.linear`` returns (as a quantization or scaling subclass would change it)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 2 if func is nn.functional.linear else out


class Tagged(torch.Tensor):
    """A subclass that keeps torch.Tensor's ``__torch_function__``: values as a plain tensor's."""


class Doubling(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is nn.functional.linear else out


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) + x)


def _front_ends(example):
    """``(name, run)`` per front-end; the nnsight trace reads the op ``add`` (so the graphs run)."""
    return [(name, run) for name, run, _, _ in front_ends(TwoLinears, example, op="add")]


def test_a_subclass_with_its_own_torch_function_is_refused_by_every_front_end():
    x = torch.randn(2, 4)
    eager = TwoLinears()
    assert not torch.equal(eager(x.as_subclass(Doubled)).as_subclass(torch.Tensor), eager(x)), "the subclass counts"
    for name, run in _front_ends(x):
        with pytest.raises(NNBridgeError, match=r"argument tensor 0 is a Doubled.*x\.as_subclass\(torch\.Tensor\)"):
            run(x.as_subclass(Doubled))
        assert torch.equal(run(x), eager(x)), f"{name}: a plain call after the refusal equals eager"


def test_an_active_torch_function_mode_is_refused_and_a_device_context_is_not():
    x = torch.randn(2, 4)
    eager = TwoLinears()
    plain = eager(x)
    with Doubling():
        assert not torch.equal(eager(x), plain), "the mode counts"
    for name, run in _front_ends(x):
        with Doubling(), pytest.raises(NNBridgeError, match=r"'TwoLinears'.*TorchFunctionMode \(Doubling\) is active"):
            run(x)
        with torch.device("cpu"):
            assert torch.equal(run(x), eager(x)), f"{name}: torch.device(...) only fills in factory devices"
        assert torch.equal(run(x), eager(x)), name


def test_a_subclass_keeping_torch_tensors_function_runs_the_graphs_and_equals_eager():
    x = torch.randn(2, 4)
    eager = TwoLinears()
    for name, run in _front_ends(x):
        got = run(x.as_subclass(Tagged))
        assert type(got) is Tagged, name
        assert torch.equal(got.as_subclass(torch.Tensor), eager(x.as_subclass(Tagged)).as_subclass(torch.Tensor)), name


def test_a_subclass_example_extracts_graphs_that_equal_eager_on_plain_calls():
    """Extraction from a subclass example is not refused: export traces plain tensors, so the
    graphs serve plain calls exactly; subclass calls are then refused."""
    x = torch.randn(2, 4)
    for made in (nnbridge.bridge(TwoLinears(), x.as_subclass(Doubled)), PatchableGraph(TwoLinears(), x.as_subclass(Doubled))):
        assert torch.equal(made(x), TwoLinears()(x))
        with pytest.raises(NNBridgeError, match="argument tensor 0 is a Doubled"):
            made(x.as_subclass(Doubled))


def test_an_nnsight_trace_reading_no_op_runs_eagerly_and_keeps_the_subclass_semantics():
    x = torch.randn(2, 4)
    traced = nnbridge.NNsight(TwoLinears())
    with traced.trace(x.as_subclass(Doubled)):
        out = traced.output.save()
    assert torch.equal(out.as_subclass(torch.Tensor), TwoLinears()(x.as_subclass(Doubled)).as_subclass(torch.Tensor))


def test_a_refused_child_call_names_the_child():
    """A subclass tensor made inside the model (its root runs opaque: export cannot trace the
    subclass) reaches a child's graphs: bridging refuses, naming the child, and leaves the model
    unbridged."""

    class MakesDoubled(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = TwoLinears()

        def forward(self, x):
            return self.inner(x.as_subclass(Doubled)).as_subclass(torch.Tensor)

    x = torch.randn(2, 4)
    expected = MakesDoubled()(x)
    model = MakesDoubled()
    with pytest.raises(NNBridgeError, match=r"Module 'inner' \(TwoLinears\).*Doubled"):
        nnbridge.bridge(model, x)
    assert bridge_of(model) is None and torch.equal(model(x), expected)


def test_function_override_in_words():
    x = torch.randn(2)
    assert function_override([x, nn.Parameter(x)]) is None
    assert function_override([x.as_subclass(Tagged)]) is None
    assert function_override([x, x.as_subclass(Doubled)]) == (
        "argument tensor 1 is a Doubled, a torch.Tensor subclass with its own __torch_function__")
    with Doubling():
        assert function_override([x]) == "a TorchFunctionMode (Doubling) is active"
    with torch.device("cpu"):
        assert function_override([x]) is None
    assert overrides_torch_function(Doubled) and not overrides_torch_function(nn.Parameter)
    assert not overrides_torch_function(torch.Tensor) and not overrides_torch_function(Tagged)
