"""Patterns returning a tuple of values: each output's outside users read the replacement's value
at the same position; against hand-written eager models."""

import copy

import pytest
import torch

import nnbridge
from nnbridge import PatternError, surgery
from pattern_models import (TwoOutputModel, TwoReplacedBlock, assert_same_run, hand_edited, run_with_grads,
                            two_outputs, two_replaced)


def bridged(model, x):
    eager = copy.deepcopy(model)
    nnbridge.bridge(model, x)
    return model, eager


def test_both_outputs_are_rewired_in_every_block():
    x = torch.randn(2, 5, 8)
    model, eager = bridged(TwoOutputModel(), x)
    rewrite = surgery.replace_pattern(model, two_outputs, two_replaced, scope="blocks_*")
    assert rewrite.matches == ["blocks_0.mul", "blocks_1.mul", "blocks_2.mul"]
    reference = hand_edited(eager, TwoReplacedBlock)
    assert_same_run(run_with_grads(model, x), run_with_grads(reference, x))
    other = torch.randn(3, 8)  # another call structure: extracted again, rewritten by the recipe
    assert_same_run(run_with_grads(model, other), run_with_grads(reference, other))
    rewrite.remove()
    assert_same_run(run_with_grads(model, x), run_with_grads(eager, x))


def test_an_inner_value_used_outside_is_rejected_with_its_user():
    x = torch.randn(2, 8)
    model, eager = bridged(TwoOutputModel(leak_at=1), x)
    rewrite = surgery.replace_pattern(model, two_outputs, two_replaced)
    assert rewrite.matches == ["blocks_0.mul", "blocks_2.mul"]
    rejected = [e for e in rewrite.log.verdicts("REJECTED") if e.anchor == "blocks_1.mul"]
    assert len(rejected) == 1
    assert "the value of blocks_1.tanh is also used by blocks_1.mul_1, outside the pattern" in rejected[0].reason
    assert_same_run(run_with_grads(model, x), run_with_grads(hand_edited(eager, TwoReplacedBlock), x))


def test_a_module_per_match_returns_both_values():
    class Replaced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor(3.0))

        def forward(self, x):
            h = torch.sigmoid(x)
            return h * self.scale, h - 1

    x = torch.randn(2, 8)
    model, eager = bridged(TwoOutputModel(layers=2), torch.randn(3, 8))
    with surgery.replace_pattern(model, two_outputs, replacement_module=lambda match: Replaced()) as rewrite:
        assert list(rewrite.modules) == ["blocks_0.replaced", "blocks_1.replaced"]
        reference = hand_edited(eager, TwoReplacedBlock)
        out, grads = run_with_grads(model, x)
        want, want_grads = run_with_grads(reference, x)
        assert torch.equal(out, want)
        for name, grad in want_grads.items():
            assert torch.equal(grads[name], grad), name
        assert all(f"blocks.{i}.replaced.scale" in grads for i in range(2))
    assert_same_run(run_with_grads(model, x), run_with_grads(eager, x))


def one_value(x):
    return torch.sigmoid(x) * 3


def three_values(x):
    h = torch.sigmoid(x)
    return h * 3, h - 1, h


@pytest.mark.parametrize("replacement, message", [
    (one_value, r"returns .*at blocks_0.mul, but the pattern two_outputs returns a tuple of 2 values; return a tuple"
                r" of 2 tensors"),
    (three_values, r"returns a tuple of 3 at blocks_0.mul, but the pattern two_outputs returns a tuple of 2"),
])
def test_a_replacement_of_another_arity_edits_nothing(replacement, message):
    x = torch.randn(2, 8)
    model, eager = bridged(TwoOutputModel(), x)
    with pytest.raises(PatternError, match=message):
        surgery.replace_pattern(model, two_outputs, replacement)
    assert surgery.edits(model) == []
    with torch.no_grad():
        assert torch.equal(model(x), eager(x))


def test_a_module_of_another_arity_edits_nothing():
    x = torch.randn(2, 8)
    model, eager = bridged(TwoOutputModel(), x)
    with pytest.raises(PatternError, match=r"Sigmoid returns one tensor at blocks_0.mul, but the pattern returns a tuple"
                                           r" of 2 values"):
        surgery.replace_pattern(model, two_outputs, replacement_module=lambda match: torch.nn.Sigmoid())
    assert surgery.edits(model) == []
    with torch.no_grad():
        assert torch.equal(model(x), eager(x))


def twice(x):
    h = torch.tanh(x)
    return h, h


def test_a_pattern_returning_one_value_twice_is_refused():
    x = torch.randn(2, 8)
    model, _ = bridged(TwoOutputModel(), x)
    with pytest.raises(PatternError, match=r"or a tuple of distinct ones.*each once"):
        surgery.match(model, twice)


class Chained(torch.nn.Module):
    """``a = x * 2`` is used to compute ``y``, the input of ``b = y + 1``."""

    def forward(self, x):
        a = x * 2
        y = torch.cos(torch.sin(a))
        return a + (y + 1)


def doubled_and_incremented(x, y):
    return x * 2, y + 1


class OtherSecondValue(torch.nn.Module):
    def forward(self, x):
        h = torch.tanh(x)
        return (h * 2) * (h - 1)


@pytest.mark.parametrize("module, pattern, reason", [
    (Chained(), doubled_and_incremented,
     "the input 1.cos is computed after 1.sin, which uses an output of the match; one replacement cannot stand"
     " before that user"),
    (OtherSecondValue(), two_outputs, "no node completes the match as the pattern's output 1 (add): no node of its kind"),
])
def test_the_log_says_why_a_several_output_candidate_is_rejected(module, pattern, reason):
    x = torch.randn(2, 8)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), module)
    nnbridge.bridge(model, x)
    found = surgery.match(model, pattern, scope="1")
    assert found.matches == []
    first = found.log.verdicts("REJECTED")[0]
    assert (first.anchor, first.reason) == ("1.mul", reason)
    assert found.log.verdicts("NEAR-MISS")[0].anchor == "1.mul"


def test_both_outputs_with_a_pattern_specialised_per_candidate():
    """``example_inputs=`` (traced from values, re-traced per candidate) with a tuple pattern."""
    x = torch.randn(2, 5, 8)
    model, eager = bridged(TwoOutputModel(), x)
    rewrite = surgery.replace_pattern(model, two_outputs, two_replaced, scope="blocks_*",
                                      example_inputs=(torch.randn(2, 5, 8),))
    assert rewrite.matches == ["blocks_0.mul", "blocks_1.mul", "blocks_2.mul"]
    assert_same_run(run_with_grads(model, x), run_with_grads(hand_edited(eager, TwoReplacedBlock), x))
