"""replace_pattern across module boundaries (seed 003), against hand-written eager models."""

import copy

import torch

import nnbridge
from nnbridge import surgery
from pattern_models import (Block, Config, ConfigStack, FusedBlock, Model, RmsBlock, assert_same_run, doubled_residual,
                            fused, hand_edited, layer_norm_pattern, pattern, rms_norm, run_with_grads, source_pattern)


def bridged(model, x):
    eager = copy.deepcopy(model)
    nnbridge.bridge(model, x)
    return model, eager


def test_two_custom_linears_are_fused_in_every_block():
    x = torch.randn(2, 5, 8)
    model, eager = bridged(Model(), x)
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    rewrite = surgery.replace_pattern(model, pattern, fused, scope="blocks_*")
    assert rewrite.matches == ["blocks_0.l1", "blocks_1.l1", "blocks_2.l1"]
    assert_same_run(run_with_grads(model, x), run_with_grads(hand_edited(eager, FusedBlock), x))
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers
    assert surgery.edits(model) == [rewrite]
    # new nodes have NodePaths by nnbridge's rules; the fused weight's product is patchable
    assert isinstance(model.get_submodule("blocks.0.matmul"), torch.nn.Module)
    rewrite.remove()
    assert surgery.edits(model) == []
    assert_same_run(run_with_grads(model, x), run_with_grads(eager, x))


def test_the_rewrite_is_applied_to_later_extractions():
    x = torch.randn(2, 5, 8)
    model, eager = bridged(Model(), x)
    with surgery.replace_pattern(model, pattern, fused):
        reference = hand_edited(eager, FusedBlock)
        for other in (torch.randn(3, 8), torch.randn(1, 7, 8)):  # other call structures: extracted again
            assert_same_run(run_with_grads(model, other), run_with_grads(reference, other))
    assert_same_run(run_with_grads(model, x), run_with_grads(eager, x))


def test_a_block_whose_intermediate_value_leaks_is_left_alone():
    x = torch.randn(2, 8)
    model, eager = bridged(Model(leak_at=1), x)
    rewrite = surgery.replace_pattern(model, pattern, fused)
    assert rewrite.matches == ["blocks_0.l1", "blocks_2.l1"]
    rejected = [e for e in rewrite.log.verdicts("REJECTED") if e.anchor == "blocks_1.l1"]
    assert len(rejected) == 1
    assert "blocks_1.l0 is also used by blocks_1.mul" in rejected[0].reason
    assert "blocks_1.mul" in str(rewrite.log)
    assert_same_run(run_with_grads(model, x), run_with_grads(hand_edited(eager, FusedBlock), x))


def test_a_built_in_layer_norm_is_replaced_in_every_layer():
    x = torch.randn(2, 5, 8)
    model, eager = bridged(Model(), x)
    rewrite = surgery.replace_pattern(model, layer_norm_pattern, rms_norm)
    assert rewrite.matches == ["blocks_0.ln", "blocks_1.ln", "blocks_2.ln"]
    assert_same_run(run_with_grads(model, x), run_with_grads(hand_edited(eager, RmsBlock), x))


def test_a_patchable_graph_is_rewritten_too():
    x = torch.randn(2, 8)
    model = Model()
    eager = copy.deepcopy(model)
    pg = nnbridge.PatchableGraph(model, x)
    surgery.replace_pattern(pg, layer_norm_pattern, rms_norm, scope="blocks_1")
    want = copy.deepcopy(eager)
    want.blocks[1].__class__ = RmsBlock
    with torch.no_grad():
        assert torch.equal(pg(x), want(x))
    probe = nnbridge.ProbePatch()
    with pg.patch({"blocks_1.rsqrt": probe}):
        pg(x)
    assert probe.activation.shape == (2, 1)
    surgery.clear(pg)
    with torch.no_grad():
        assert torch.equal(pg(x), eager(x))




def test_the_config_pattern_with_a_dead_input():
    x = torch.randn(2, 8)
    model, eager = bridged(ConfigStack(Config(mlp=False, size=8)), x)
    rewrite = surgery.replace_pattern(model, source_pattern, doubled_residual,
                                      constants={"config": Config(mlp=False, size=8)})
    assert [(e.anchor, e.verdict) for e in rewrite.log.verdicts("DROPPED")] == [("down_proj", "DROPPED")]
    assert rewrite.matches == ["layers_0.add", "layers_1.add"]
    for layer in eager.layers:
        layer.forward = lambda h, layer=layer: doubled_residual(h, layer.proj)
    assert_same_run(run_with_grads(model, x), run_with_grads(eager, x))


def test_the_config_pattern_with_mlp():
    x = torch.randn(2, 8)
    model, eager = bridged(ConfigStack(Config(mlp=True, size=8)), x)

    def fused_mlp(x, proj, down_proj):
        return torch.nn.functional.linear(x, down_proj.weight @ proj.weight) + x

    rewrite = surgery.replace_pattern(model, source_pattern, fused_mlp, constants={"config": Config(True, 8)})
    assert rewrite.matches == ["layers_0.add", "layers_1.add"] and not rewrite.log.verdicts("DROPPED")
    for layer in eager.layers:
        layer.forward = lambda h, layer=layer: fused_mlp(h, layer.up_proj, layer.down_proj)
    assert_same_run(run_with_grads(model, x), run_with_grads(eager, x))


def test_one_pattern_matches_float32_and_bfloat16_extractions():
    x = torch.randn(2, 8)
    model, eager = bridged(Model(), x)
    rewrite = surgery.replace_pattern(model, pattern, fused)
    reference = hand_edited(eager, FusedBlock)
    assert_same_run(run_with_grads(model, x), run_with_grads(reference, x))
    model.to(torch.bfloat16)
    reference.to(torch.bfloat16)
    low = x.to(torch.bfloat16)
    assert_same_run(run_with_grads(model, low), run_with_grads(reference, low))
    assert sum(e.verdict == "MATCHED" for e in rewrite.log) == 6  # three blocks, two extractions


def doubled_norm(x, ln):
    return ln(x) * 2


class DoubledNormBlock(Block):
    """Hand-written: the LayerNorm's output is doubled."""

    def forward(self, x):
        return self.ln(self.l1(self.l0(x)) + x) * 2


def test_a_replacement_calling_the_matched_module_is_applied_once_per_graph():
    x = torch.randn(2, 8)
    model, eager = bridged(Model(), x)
    rewrite = surgery.replace_pattern(model, layer_norm_pattern, doubled_norm)
    reference = hand_edited(eager, DoubledNormBlock)
    for call in (x, torch.randn(4, 8), x, torch.randn(1, 3, 8), torch.randn(4, 8)):
        assert_same_run(run_with_grads(model, call), run_with_grads(reference, call))
    # the LayerNorm call is re-used: its NodePath and op point stay, readable in the rewritten graph
    assert "blocks_0.ln" in rewrite.matches
    assert isinstance(model.get_submodule("blocks.0.ln.layer_norm"), torch.nn.Module)
