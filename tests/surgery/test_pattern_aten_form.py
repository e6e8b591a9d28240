"""Patterns extracted by nnbridge's exporter per candidate: matched in the graphs' ATen normal form
(ops by overload, literals as the exporter writes them), against hand-written eager models."""

import copy

import pytest
import torch

import nnbridge
from nnbridge import surgery
from nnbridge.surgery.pattern_export import export_pattern
from pattern_models import CustomLinear, assert_same_run, hand_edited, run_with_grads


class CentredBlock(torch.nn.Module):
    """``l0``, then its output centred (``h - h.mean(-1, keepdim=True)``) and scaled by its width
    after a ``.float()``."""

    def __init__(self, size=8):
        super().__init__()
        self.l0 = CustomLinear(size)

    def forward(self, x):
        h = self.l0(x)
        centred = h - h.mean(-1, keepdim=True)
        return centred.float() / h.shape[-1] + x


class SummedBlock(CentredBlock):
    """Hand-written: the centring written with a sum (the replacement below)."""

    def forward(self, x):
        h = self.l0(x)
        centred = h - torch.sum(h, -1, keepdim=True) / h.shape[-1]
        return centred.float() / h.shape[-1] + x


class HalvedBlock(CentredBlock):
    """Hand-written: the scaling replaced by a halving (the second replacement below)."""

    def forward(self, x):
        h = self.l0(x)
        centred = h - h.mean(-1, keepdim=True)
        return centred * 0.5 + x


class Stack(torch.nn.Module):
    def __init__(self, layers=3, size=8):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([CentredBlock(size) for _ in range(layers)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def centre(h):
    return h - h.mean(-1, keepdim=True)


def centre_by_sum(h):
    return h - torch.sum(h, -1, keepdim=True) / h.shape[-1]


def scaled(c):
    return c.float() / c.shape[-1]


def halved(c):
    return c * 0.5


@pytest.fixture
def bridged():
    x = torch.randn(2, 8)
    model = Stack()
    eager = copy.deepcopy(model)
    nnbridge.bridge(model, x)
    yield model, eager, x
    assert surgery.edits(model) == []


def test_a_keyword_and_a_dim_list_match_in_aten_form(bridged):
    # traced by torch.fx, h.mean(-1, keepdim=True) has the literal -1 and a keyword; the graph's
    # aten.mean.dim has [-1] and a third positional argument: the pattern extracted per candidate has both
    model, eager, x = bridged
    rewrite = surgery.replace_pattern(model, centre, centre_by_sum, scope="blocks_*")
    assert rewrite.matches == ["blocks_0.sub", "blocks_1.sub", "blocks_2.sub"]
    assert rewrite.edit.rewriter.pattern.specialiser.specialisations == 1  # one extraction for every layer
    assert_same_run(run_with_grads(model, x), run_with_grads(hand_edited(eager, SummedBlock), x))
    rewrite.remove()
    assert_same_run(run_with_grads(model, x), run_with_grads(eager, x))


def test_a_torch_level_op_with_another_aten_name_matches_from_example_inputs(bridged):
    # c.float() is aten.to.dtype and / is aten.div.Tensor in the graph: the pattern extracted from
    # example_inputs= is found by those names, and its size literal is each candidate's own
    model, eager, x = bridged
    rewrite = surgery.replace_pattern(model, scaled, halved, scope="blocks_*", example_inputs=(torch.randn(3, 5),))
    assert rewrite.matches == ["blocks_0.div", "blocks_1.div", "blocks_2.div"]
    assert_same_run(run_with_grads(model, x), run_with_grads(hand_edited(eager, HalvedBlock), x))
    rewrite.remove()
    assert_same_run(run_with_grads(model, x), run_with_grads(eager, x))


def test_an_operator_without_example_inputs_is_found_by_its_torch_name(bridged):
    # without values the last op is found by the name torch.fx traced (operator.truediv): no div node
    # has it; the log says so, and example_inputs= (the test above) finds it
    model, _, _ = bridged

    def eighth(c):
        return c.float() / 8

    found = surgery.match(model, eighth, scope="blocks_0")
    assert found.matches == []
    assert not found.log.verdicts("REJECTED")
    (entry,) = found.log.verdicts("NO-CANDIDATE")
    assert entry.reason.startswith("no node in the graphs in scope 'blocks_0' is an op named truediv (the pattern's"
                                   " last op); without example_inputs= an op is found by the name torch.fx gives it")
    assert "give example_inputs= to find it by its ATen name" in entry.reason
    found = surgery.match(model, eighth, scope="blocks_0", example_inputs=(torch.randn(2, 8),))
    assert [m.anchor for m in found.matches] == ["blocks_0.div"] and not found.log.verdicts("NO-CANDIDATE")


def total(h):
    return h.sum(-1)


def test_another_overload_of_the_same_op_is_rejected_naming_both(bridged):
    model, _, _ = bridged

    def whole_sum(h, l0: CustomLinear):
        return l0(h).sum()

    class Summing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l0 = CustomLinear(8)

        def forward(self, x):
            return self.l0(x).sum(-1)

    other = Summing()
    nnbridge.bridge(other, torch.randn(2, 8))
    found = surgery.match(other, whole_sum)
    assert found.matches == []
    reasons = [e.reason for e in found.log.verdicts("REJECTED")]
    assert reasons == ["specialised for h: float32[2, 8]: sum is the op aten.sum.dim_IntList; the pattern wants"
                       " aten.sum.default"]


def test_a_literal_is_compared_as_the_exporter_writes_it(bridged):
    model, _, _ = bridged

    def centre_other_dim(h):
        return h - h.mean(0, keepdim=True)

    found = surgery.match(model, centre_other_dim, scope="blocks_0")
    assert found.matches == []
    (rejected,) = found.log.verdicts("REJECTED")
    assert rejected.reason == ("specialised for h: float32[2, 8]: literal differs: argument 1 of blocks_0.mean is"
                               " -1; the pattern has 0")


def tanh_doubled(h):
    return torch.tanh(h) * 2


def sigmoid_doubled(h):
    return torch.sigmoid(h) * 2


class TwoActivations(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x) * 2 + torch.sigmoid(x) * 2


def test_patterns_of_one_shape_are_extracted_each_from_its_own_code():
    # the pattern's root module is made per pattern, with one class name: an extraction cache
    # keying it by class and structure would serve the first pattern's graph for the second
    model = TwoActivations()
    nnbridge.bridge(model, torch.randn(2, 8))
    example = (torch.randn(2, 8),)
    first = surgery.match(model, tanh_doubled, example_inputs=example)
    second = surgery.match(model, sigmoid_doubled, example_inputs=example)
    assert [m.anchor for m in first.matches] == ["mul"]
    assert [m.anchor for m in second.matches] == ["mul_1"]


def test_an_extracted_pattern_that_is_an_identity_for_the_values_is_refused():
    def returns_its_input(h):
        return h.contiguous()

    with pytest.raises(nnbridge.PatternError, match=r"returns x, no value it computes|returns h, no value it computes"):
        export_pattern(returns_its_input, constants={}, name="returns_its_input", inputs={"h": torch.randn(2, 3)},
                       calls={})


def scaled_unless_bfloat16(h, y):
    return h / h.shape[-1] if h.dtype == torch.bfloat16 else h / y


def test_an_input_unused_once_specialised_is_dropped_with_a_log_line():
    class Halving(torch.nn.Module):
        def forward(self, x):
            return torch.div(torch.tanh(x), 8)  # (x.shape[-1] would be a dynamic size: no literal)

    model = Halving().to(torch.bfloat16)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    nnbridge.bridge(model, x)
    # from float32 examples the pattern divides by y; the bfloat16 candidate's own pattern divides
    # by its width and leaves y unused
    found = surgery.match(model, scaled_unless_bfloat16, example_inputs=(torch.randn(2, 8), torch.randn(2, 8)))
    assert [m.anchor for m in found.matches] == ["div"]
    assert [(e.anchor, e.reason) for e in found.log.verdicts("DROPPED")] == [
        ("div", "input y unused in the pattern specialised for div")]
