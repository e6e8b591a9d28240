"""Patterns traced from example_inputs= and specialised per candidate (dtype branches, sizes),
against hand-written eager models; every example_inputs= error path edits nothing."""

import copy

import pytest
import torch
import torch.nn.functional as F

import nnbridge
from nnbridge import PatternError, surgery
from pattern_models import CustomLinear, assert_same_run, run_with_grads


def act(h, y):
    """silu for float32, written out for bfloat16: a different op per dtype (of ``h``)."""
    if h.dtype == torch.bfloat16:
        return y * torch.sigmoid(y)
    return F.silu(y)


class ActBlock(torch.nn.Module):
    def __init__(self, size=8):
        super().__init__()
        self.l0, self.l1 = CustomLinear(size), CustomLinear(size)

    def forward(self, x):
        h = self.l0(x)
        return act(h, self.l1(h)) + x


class GeluBlock(ActBlock):
    """Hand-written: the activation after ``l1`` is a gelu, whatever the dtype."""

    def forward(self, x):
        return F.gelu(self.l1(self.l0(x))) + x


class Stack(torch.nn.Module):
    def __init__(self, block, sizes=(8, 8)):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([block(size) for size in sizes])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def act_pattern(h, l1: CustomLinear):
    return act(h, l1(h))


def gelu_replacement(h, l1):
    return F.gelu(l1(h))


def hand_edited(model, block_class):
    edited = copy.deepcopy(model)
    for block in edited.blocks:
        block.__class__ = block_class
    return edited


def test_a_dtype_branch_is_replaced_in_float32_and_bfloat16_extractions():
    x = torch.randn(2, 8)
    model = Stack(ActBlock)
    eager = copy.deepcopy(model)
    low_copy = copy.deepcopy(model).to(torch.bfloat16)
    nnbridge.bridge(model, x)
    rewrite = surgery.replace_pattern(model, act_pattern, gelu_replacement, example_inputs=(torch.randn(3, 8),))
    assert rewrite.matches == ["blocks_0.silu", "blocks_1.silu"]
    reference = hand_edited(eager, GeluBlock)
    assert_same_run(run_with_grads(model, x), run_with_grads(reference, x))
    # the same rewrite, re-applied to the bfloat16 extraction: the pattern's other branch (mul, sigmoid)
    model.to(torch.bfloat16)
    reference.to(torch.bfloat16)
    low = x.to(torch.bfloat16)
    assert_same_run(run_with_grads(model, low), run_with_grads(reference, low))
    assert [e.anchor for e in rewrite.log.verdicts("MATCHED")][2:] == ["blocks_0.mul", "blocks_1.mul"]
    rewrite.remove()
    # a bfloat16 copy bridged on its own, rewritten from float32 example inputs
    nnbridge.bridge(low_copy, low)
    again = surgery.replace_pattern(low_copy, act_pattern, gelu_replacement, example_inputs={"h": torch.randn(3, 8)})
    assert again.matches == ["blocks_0.mul", "blocks_1.mul"]
    assert_same_run(run_with_grads(low_copy, low), run_with_grads(reference, low))


def test_without_example_inputs_a_dtype_branch_is_refused_with_the_fix():
    model = Stack(ActBlock)
    nnbridge.bridge(model, torch.randn(2, 8))
    with pytest.raises(PatternError, match=r"act_pattern cannot be traced by torch.fx.*give example_inputs="):
        surgery.match(model, act_pattern)
    assert surgery.edits(model) == []


class MeanBlock(torch.nn.Module):
    """``h * mean(h)`` over the last dimension, the mean written as a sum divided by the width
    (``divisor``: another number, so the pattern's specialised literal differs)."""

    def __init__(self, size=8, divisor=None):
        super().__init__()
        self.l0 = CustomLinear(size)
        self.divisor = divisor

    def forward(self, x):
        h = self.l0(x)
        return torch.sum(h, [-1], True) / (self.divisor or h.shape[-1]) * h


class MeanByTorch(MeanBlock):
    def forward(self, x):
        h = self.l0(x)
        return torch.mean(h, [-1], True) * h


class Widening(torch.nn.Module):
    """A width-8 block, a projection to 16, a width-16 block and one dividing by 3."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([MeanBlock(8), MeanBlock(16), MeanBlock(16, divisor=3)])
        self.up = CustomLinear(8, 16)

    def forward(self, x):
        return self.blocks[2](self.blocks[1](self.up(self.blocks[0](x))))


def mean_pattern(h):
    return torch.div(torch.sum(h, [-1], True), h.shape[-1])


def mean_replacement(h):
    return torch.mean(h, [-1], True)


def test_a_size_specialised_pattern_matches_each_width():
    x = torch.randn(2, 8)
    model = Widening()
    eager = copy.deepcopy(model)
    nnbridge.bridge(model, x)
    found = surgery.match(model, mean_pattern, scope="blocks_*", example_inputs=(torch.randn(1, 4),))
    assert [m.anchor for m in found.matches] == ["blocks_0.div", "blocks_1.div"]
    rejected = [e for e in found.log.verdicts("REJECTED") if e.anchor == "blocks_2.div"]
    assert len(rejected) == 1
    assert "specialised for h: float32[2, 16]: literal differs: argument 1 of blocks_2.div is 3; the pattern has 16" \
        in rejected[0].reason
    rewrite = surgery.replace_pattern(model, mean_pattern, mean_replacement, scope="blocks_*",
                                      example_inputs=(torch.randn(1, 4),))
    assert rewrite.matches == ["blocks_0.div", "blocks_1.div"]
    want = copy.deepcopy(eager)
    want.blocks[0].__class__ = want.blocks[1].__class__ = MeanByTorch
    assert_same_run(run_with_grads(model, x), run_with_grads(want, x))
    # one specialised trace per width, whatever the number of layers
    assert rewrite.edit.rewriter.pattern.specialiser.specialisations == 2


def reads_module_result_dtype(h, l1: CustomLinear):
    y = l1(h)
    return y * 2 if y.dtype == torch.float32 else y


def mismatched(h):
    return h @ torch.ones(3, 3)


@pytest.fixture
def bridged():
    x = torch.randn(2, 8)
    model = Stack(ActBlock)
    eager = copy.deepcopy(model)
    nnbridge.bridge(model, x)
    yield model
    assert surgery.edits(model) == []
    with torch.no_grad():
        assert torch.equal(model(x), eager(x))


@pytest.mark.parametrize("pattern, example, message", [
    (act_pattern, (torch.randn(2, 8), torch.randn(2, 8)),
     r"example_inputs= gives the pattern act_pattern a tensor per tensor argument \['h'\].*got 2 value\(s\)\. Give 1"),
    (act_pattern, {"x": torch.randn(2, 8)}, r"got the names \['x'\]\. Give exactly \['h'\]"),
    (act_pattern, (3,), r"got \['h: int'\]\. Give a real tensor for each"),
    (act_pattern, torch.randn(2, 8), r"got a Tensor\. Pass \(x,\) or \{'x': x\}"),
    (mismatched, (torch.randn(2, 8),),
     r"the pattern mismatched cannot be traced with the values \{h: float32\[2, 8\]\}: matmul fails.*"
     r"example_inputs= are the values the pattern is first traced with"),
    (reads_module_result_dtype, (torch.randn(2, 8),),
     r"reads_module_result_dtype cannot be traced with the values .*reads \.dtype of l1, whose value is unknown"
     r" here \(in the trace from example_inputs=, a module call's result"),
])
def test_example_inputs_errors_edit_nothing(bridged, pattern, example, message):
    with pytest.raises(PatternError, match=message):
        surgery.replace_pattern(bridged, pattern, gelu_replacement, example_inputs=example)
    with pytest.raises(PatternError, match=message):
        surgery.match(bridged, pattern, example_inputs=example)


def test_a_symbolic_pattern_reading_sizes_is_refused(bridged):
    with pytest.raises(PatternError, match=r"mean_pattern reads h\.shape, which a symbolic trace leaves.*give example_inputs="):
        surgery.replace_pattern(bridged, mean_pattern, mean_replacement)


def test_an_extraction_input_has_the_value_it_was_extracted_with():
    from pattern_models import FusedBlock, Model, fused, pattern

    x = torch.randn(2, 8)
    model = Model()
    eager = copy.deepcopy(model)
    nnbridge.bridge(model, x)
    # blocks_0's x is the extraction's own input: its value is the call's (sizes, dtype, device)
    rewrite = surgery.replace_pattern(model, pattern, fused, example_inputs=(torch.randn(3, 8),))
    assert rewrite.matches == ["blocks_0.l1", "blocks_1.l1", "blocks_2.l1"]
    assert_same_run(run_with_grads(model, x), run_with_grads(hand_edited(eager, FusedBlock), x))
    rewrite.remove()
    model(x)  # extracted again, unedited

    def float_only(x, l0: CustomLinear, l1: CustomLinear):
        return l1(l0(x)) if x.dtype == torch.float32 else l0(x)

    found = surgery.match(model, float_only, example_inputs=(torch.randn(3, 8),))
    assert [m.anchor for m in found.matches] == ["blocks_0.l1", "blocks_1.l1", "blocks_2.l1"]
