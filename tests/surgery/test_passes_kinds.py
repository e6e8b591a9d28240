"""fx.Transformer, PassManager and PassBase passes, metadata kept, and fused partitions."""

import torch
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.fx.passes.infra.pass_manager import PassManager, pass_result_wrapper
from torch.fx.passes.operator_support import OperatorSupportBase

import nnbridge
from nnbridge import PatchableGraph, ProbePatch
from nnbridge.graph.metadata import node_meta
from nnbridge.surgery import PassEdit, apply_passes
from passes_common import (MulLayer, MulSubLayer, ReplaceAddWithMul, ReplaceAddWithMulSub, assert_equal_runs, graph_at,
                           hand_edited, models, node_names, replace_add_with_mul, run_with_grads)

aten = torch.ops.aten


def _check_equal_to(layer_class, passes, *, bridged=False):
    model, eager, ids = models()
    target = nnbridge.bridge(model, ids, use_cache=False) if bridged else PatchableGraph(model, ids, use_cache=False)
    apply_passes(target, passes, scope="model.layers_*")
    want = run_with_grads(lambda: hand_edited(eager, layer_class)(ids, use_cache=False), eager)
    assert_equal_runs(run_with_grads(lambda: target(ids, use_cache=False), model), want)
    return target


def test_a_transformer_keeps_names_and_metadata():
    _check_equal_to(MulLayer, ReplaceAddWithMul)
    model, _, ids = models()
    pg = PatchableGraph(model, ids, use_cache=False)
    before = {n.name: dict(n.meta) for n in graph_at(pg, "model.layers_0").graph.nodes}
    apply_passes(pg, ReplaceAddWithMul, scope="model.layers_*")
    graph = graph_at(pg, "model.layers_0")
    assert node_names(graph) == list(before)
    for node in graph.graph.nodes:
        old = before[node_meta(node).name]
        assert node_meta(node) == old["nnbridge"]  # NodePath name, module path, example summary
        for key in ("val", "stack_trace", "nn_module_stack"):
            assert (key in node.meta) == (key in old) and node.meta.get(key) is old.get(key), (node.name, key)
    assert [n.target for n in graph.graph.nodes if n.name.startswith("add")] == [aten.mul.Tensor] * 2


def test_a_transformer_on_a_bridged_model():
    _check_equal_to(MulLayer, ReplaceAddWithMul, bridged=True)


def test_a_one_to_two_transformer_names_the_new_node():
    pg = _check_equal_to(MulSubLayer, ReplaceAddWithMulSub)
    graph = graph_at(pg, "model.layers_1")
    by_name = {node_meta(n).name: n for n in graph.graph.nodes}
    assert by_name["add"].target == aten.sub.Tensor and by_name["mul"].target == aten.mul.Tensor
    assert by_name["add_1"].target == aten.sub.Tensor and by_name["mul_1"].target == aten.mul.Tensor


def test_a_pass_manager():
    _check_equal_to(MulLayer, PassManager(passes=[pass_result_wrapper(replace_add_with_mul)]))


class AddToMul(PassBase):
    def call(self, graph_module):
        replace_add_with_mul(graph_module)
        return PassResult(graph_module, True)


def test_a_pass_base():
    _check_equal_to(MulLayer, AddToMul(), bridged=True)


def test_a_pass_edit_applies_to_one_graph_in_scope_only():
    model, eager, ids = models()
    pg = PatchableGraph(model, ids, use_cache=False)
    edit = PassEdit(ReplaceAddWithMul, scope="model.layers_1")
    edit.apply(graph_at(pg, "model.layers_0"))  # out of scope: nothing
    edit.apply(graph_at(pg, "model.layers_1"))
    eager.model.layers[1].__class__ = MulLayer
    assert torch.equal(pg(ids, use_cache=False).logits, eager(ids, use_cache=False).logits)


class NormOps(OperatorSupportBase):
    def is_node_supported(self, submodules, node):
        return node.op == "call_function" and node.target in (aten.pow.Tensor_Scalar, aten.mean.dim, aten.add.Scalar,
                                                               aten.add.Tensor,
                                                               aten.rsqrt.default, aten.mul.Tensor)


def fuse_norm_ops(gm):
    partitioner = CapabilityBasedPartitioner(gm, NormOps())
    return partitioner.fuse_partitions(partitioner.propose_partitions())


def test_fused_partitions_are_nnbridge_graphs():
    model, _, ids = models()
    pg = PatchableGraph(model, ids, use_cache=False)
    probe = ProbePatch()
    with pg.patch({"model.layers_0.input_layernorm.rsqrt": probe}):
        want = pg(ids, use_cache=False).logits
    apply_passes(pg, fuse_norm_ops, scope="model.layers_*.*_layernorm")
    norm = graph_at(pg, "model.layers_0.input_layernorm")
    assert "fused_0" in node_names(norm) and "rsqrt" not in node_names(norm)
    fused = graph_at(pg, "model.layers_0.input_layernorm.fused_0")
    assert "rsqrt" in node_names(fused)
    fused_probe = ProbePatch()
    with pg.patch({"model.layers_0.input_layernorm.fused_0.rsqrt": fused_probe}):
        assert torch.equal(pg(ids, use_cache=False).logits, want)
    assert torch.equal(fused_probe.activation, probe.activation)


def test_fused_partitions_on_a_bridged_model():
    model, eager, ids = models()
    nnbridge.bridge(model, ids, use_cache=False)
    apply_passes(model, fuse_norm_ops, scope="model.layers_*.*_layernorm")
    assert_equal_runs(run_with_grads(lambda: model(ids, use_cache=False), model),
                      run_with_grads(lambda: eager(ids, use_cache=False), eager))
    pg = PatchableGraph(model, ids, use_cache=False)
    probe = ProbePatch()
    with pg.patch({"model.layers_1.post_attention_layernorm.fused_0.rsqrt": probe}):
        pg(ids, use_cache=False)
    assert probe.activation.shape == (1, 8, 1)


def scale_layer_outputs(gm):
    """Multiplies the layer's output by a tensor constant the pass adds (a new get_attr)."""
    gm.register_buffer("scale", torch.tensor(2.0))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        scale = gm.graph.get_attr("scale")
        scaled = gm.graph.call_function(aten.mul.Tensor, (output.args[0], scale))
    output.args = (scaled,)


def test_a_pass_that_adds_a_tensor_constant():
    model, eager, ids = models()
    nnbridge.bridge(model, ids, use_cache=False)
    apply_passes(model, scale_layer_outputs, scope="model.layers_*")
    for layer in eager.model.layers:
        layer.register_forward_hook(lambda module, args, output: output * torch.tensor(2.0))
    assert_equal_runs(run_with_grads(lambda: model(ids, use_cache=False), model),
                      run_with_grads(lambda: eager(ids, use_cache=False), eager))
    assert "scale" in node_names(graph_at(model, "model.layers_0"))
