"""Replacements traced from each match's values: reading ``x.dtype``, ``x.shape``, ``x.size()`` or a
matched module's ``weight.dtype`` gives the match's own, and a branch on them takes the match's
branch (with and without ``example_inputs=``), against hand-written eager models; a replacement
failing on a match's values edits nothing."""

import copy

import pytest
import torch
import torch.nn.functional as F

import nnbridge
from nnbridge import PatternError, surgery
from pattern_models import Block, Model, assert_same_run, hand_edited, pattern, run_with_grads


def dtype_fused(x, l0, l1):
    """The fused linear in float32; in bfloat16, the two linears kept apart (a per-dtype branch)."""
    if x.dtype == torch.bfloat16:
        return F.linear(F.linear(x, l0.weight), l1.weight)
    return F.linear(x, l1.weight @ l0.weight)


class DtypeFusedBlock(Block):
    def forward(self, x):
        return self.ln(dtype_fused(x, self.l0, self.l1) + x)


def scaled_fused(x, l0, l1):
    """Reads sizes of a tensor input and the dtype of a matched module's parameter."""
    scale = x.shape[-1] / x.size(-1) * (2.0 if l0.weight.dtype == torch.float32 else 3.0)
    return F.linear(x, l1.weight @ l0.weight) * scale


class ScaledFusedBlock(Block):
    def forward(self, x):
        return self.ln(scaled_fused(x, self.l0, self.l1) + x)


def weighted_fused(x, l0, l1):
    """Makes a tensor from the match's sizes (a constant of the traced replacement)."""
    return F.linear(x, l1.weight @ l0.weight) * torch.linspace(0.5, 1.5, x.shape[-1])


class WeightedFusedBlock(Block):
    def forward(self, x):
        return self.ln(weighted_fused(x, self.l0, self.l1) + x)


@pytest.mark.parametrize("example", [None, (torch.randn(3, 8),)], ids=["traced-as-written", "example_inputs"])
def test_a_replacement_branching_on_dtype_takes_each_extractions_branch(example):
    x = torch.randn(2, 8)
    model = Model(layers=2)
    eager = copy.deepcopy(model)
    nnbridge.bridge(model, x)
    rewrite = surgery.replace_pattern(model, pattern, dtype_fused, example_inputs=example)
    assert len(rewrite.matches) == 2
    reference = hand_edited(eager, DtypeFusedBlock)
    assert_same_run(run_with_grads(model, x), run_with_grads(reference, x))
    # the float32 branch is one linear of the product: not the unedited model's two linears
    with torch.no_grad():
        assert not torch.equal(model(x), eager(x))
    # the same rewrite, re-applied to the bfloat16 extraction: the replacement's other branch
    model.to(torch.bfloat16)
    reference.to(torch.bfloat16)
    low = x.to(torch.bfloat16)
    assert_same_run(run_with_grads(model, low), run_with_grads(reference, low))
    rewrite.remove()
    eager.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(low), eager(low))


def test_a_replacement_reading_sizes_and_a_parameters_dtype():
    x = torch.randn(2, 8)
    model = Model(layers=3)
    eager = copy.deepcopy(model)
    nnbridge.bridge(model, x)
    surgery.replace_pattern(model, pattern, scaled_fused)
    reference = hand_edited(eager, ScaledFusedBlock)
    assert_same_run(run_with_grads(model, x), run_with_grads(reference, x))
    graph = nnbridge.PatchableGraph(model, x).graph
    # the sizes and the dtype were read as the match's values: no size or getattr op in the graph
    code = str(graph["blocks_0"]._code)
    assert "sym_size" not in code and "getattr" not in code, code


def test_a_replacement_making_a_tensor_from_the_matchs_sizes():
    x = torch.randn(2, 8)
    model = Model(layers=2)
    eager = copy.deepcopy(model)
    nnbridge.bridge(model, x)
    rewrite = surgery.replace_pattern(model, pattern, weighted_fused)
    reference = hand_edited(eager, WeightedFusedBlock)
    assert_same_run(run_with_grads(model, x), run_with_grads(reference, x))
    assert "pattern_constant" not in str(model.state_dict().keys())
    rewrite.remove()
    with torch.no_grad():
        assert torch.equal(model(x), eager(x))


def wrong_shapes(x, l0, l1):
    return x @ torch.ones(x.shape[-1] + 1, 4)  # (2, 8) @ (9, 4): fails on the match's values


def masked(x, l0, l1):
    y = F.linear(x, l1.weight @ l0.weight)
    return y.masked_fill(y.nonzero().numel() == 0, 0.0)  # data-dependent: no fake value


# each is traced on past the failing op; the shape check after the pass refuses it
@pytest.mark.parametrize("replacement, reason", [
    (wrong_shapes, r"wrong_shapes: after the pass .* the check 'shapes' failed on the graph blocks_0: fake propagation"
                   r" fails: matmul.*Nothing was changed"),
    (masked, r"masked: after the pass .* the check 'shapes' failed.*nonzero.*Nothing was changed"),
], ids=["wrong-sizes", "data-dependent"])
def test_a_replacement_failing_on_a_matchs_values_edits_nothing(replacement, reason):
    x = torch.randn(2, 8)
    model = Model(layers=2)
    eager = copy.deepcopy(model)
    nnbridge.bridge(model, x)
    with pytest.raises(nnbridge.NNBridgeError, match=reason):
        surgery.replace_pattern(model, pattern, replacement)
    assert surgery.edits(model) == []
    with torch.no_grad():
        assert torch.equal(model(x), eager(x))
