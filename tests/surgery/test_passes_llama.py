"""Seed 004's passes over every decoder layer of a tiny Llama equal a hand-written eager model."""

import pytest
import torch

import nnbridge
from nnbridge import PatchableGraph, ProbePatch, ZeroPatch
from nnbridge.surgery import apply_passes
from passes_common import (ReluMulLayer, RemoveDetachPass, assert_equal_runs, graph_at, hand_edited,
                           insert_relu_after_add, models, node_names, replace_add_with_mul, run_with_grads)

SEED_PASSES = [insert_relu_after_add, replace_add_with_mul, RemoveDetachPass]


def test_seed_passes_over_every_layer_of_a_patchable_graph():
    model, eager, ids = models()
    pg = PatchableGraph(model, ids, use_cache=False)
    applied = apply_passes(pg, SEED_PASSES, scope="model.layers_*")
    assert applied.graphs == ["model.layers_0", "model.layers_1"]
    want = run_with_grads(lambda: hand_edited(eager, ReluMulLayer)(ids, use_cache=False), eager)
    assert_equal_runs(run_with_grads(lambda: pg(ids, use_cache=False), model), want)


def test_seed_passes_over_every_layer_of_a_bridged_model():
    model, eager, ids = models()
    nnbridge.bridge(model, ids, use_cache=False)
    apply_passes(model, SEED_PASSES, scope="model.layers_*")
    want = run_with_grads(lambda: hand_edited(eager, ReluMulLayer)(ids, use_cache=False), eager)
    assert_equal_runs(run_with_grads(lambda: model(ids, use_cache=False), model), want)


def test_new_nodes_get_nodepath_names_and_retargeted_nodes_keep_theirs():
    model, _, ids = models()
    pg = PatchableGraph(model, ids, use_cache=False)
    apply_passes(pg, SEED_PASSES, scope="model.layers_*")
    graph = graph_at(pg, "model.layers_0")
    names = node_names(graph)
    assert "relu" in names and "relu_1" in names and not any("default" in name for name in names)
    adds = [node for node in graph.graph.nodes if node.name in ("add", "add_1")]
    assert [node.target for node in adds] == [torch.ops.aten.mul.Tensor] * 2  # retargeted, names kept
    assert "model.layers_1.relu_1" in pg.node_paths()


def test_a_new_node_is_patchable_by_nodepath():
    model, eager, ids = models()
    pg = PatchableGraph(model, ids, use_cache=False)
    apply_passes(pg, SEED_PASSES, scope="model.layers_*")
    hand_edited(eager, ReluMulLayer)
    eager.model.layers[0].register_forward_hook(lambda module, args, output: torch.zeros_like(output))
    probe = ProbePatch()
    with pg.patch({"model.layers_0.relu_1": ZeroPatch(), "model.layers_1.relu": probe}):
        got = pg(ids, use_cache=False).logits
    assert torch.equal(got, eager(ids, use_cache=False).logits)
    assert probe.activation.shape == (1, 8, 64)


def test_a_new_node_is_an_op_point_of_a_bridged_model():
    model, eager, ids = models()
    nnbridge.bridge(model, ids, use_cache=False)
    apply_passes(model, SEED_PASSES, scope="model.layers_*")
    point = model.get_submodule("model.layers.0.relu_1")
    handle = point.register_forward_hook(lambda module, args, output: torch.zeros_like(output))
    hand_edited(eager, ReluMulLayer)
    eager_handle = eager.model.layers[0].register_forward_hook(lambda module, args, output: torch.zeros_like(output))
    assert torch.equal(model(ids, use_cache=False).logits, eager(ids, use_cache=False).logits)
    handle.remove()
    eager_handle.remove()
    assert torch.equal(model(ids, use_cache=False).logits, eager(ids, use_cache=False).logits)


class Detaching(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.outer = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.outer(self.inner(x).detach() + x)


class NotDetaching(Detaching):
    def forward(self, x):
        return self.outer(self.inner(x) + x)


@pytest.mark.parametrize("bridged", [False, True], ids=["patchable_graph", "bridged"])
def test_remove_detach_gives_the_gradients_of_the_model_without_detach(bridged):
    torch.manual_seed(0)
    model, x = Detaching(), torch.randn(3, 4)
    eager = NotDetaching()
    eager.load_state_dict(model.state_dict())
    target = nnbridge.bridge(model, x) if bridged else PatchableGraph(model, x)
    assert any(node.target == torch.ops.aten.detach.default for node in graph_at(target, "").graph.nodes)
    if bridged:
        assert isinstance(model.get_submodule("detach"), nnbridge.OpPoint)
    apply_passes(target, [RemoveDetachPass])
    assert "detach" not in node_names(graph_at(target, ""))
    assert "detach" not in dict(model.named_children())  # a bridged model's op point is gone with its node

    def run(call, module):
        module.zero_grad()
        with torch.enable_grad():
            out = call()
            out.sum().backward()
        return out.detach(), {name: p.grad.clone() for name, p in module.named_parameters()}
    got, want = run(lambda: target(x), model), run(lambda: eager(x), eager)
    assert torch.equal(got[0], want[0])
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name


def test_with_a_kv_cache_through_the_layers_passes_apply_and_shape_changes_are_caught():
    from nnbridge.errors import PassCheckError
    model, eager, ids = models()
    pg = PatchableGraph(model, ids)  # use_cache: a DynamicCache flows through every layer graph
    want_unedited = pg(ids).logits

    def sum_last_dim(gm):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(output):
            summed = gm.graph.call_function(torch.ops.aten.sum.dim_IntList, (output.args[0], [-1], True))
        output.args = (summed,)
    with pytest.raises(PassCheckError) as caught:
        apply_passes(pg, sum_last_dim, scope="model.layers_*")
    assert (caught.value.graph, caught.value.check) == ("model.layers_0", "shapes")
    assert torch.equal(pg(ids).logits, want_unedited)
    apply_passes(pg, SEED_PASSES, scope="model.layers_*")
    assert torch.equal(pg(ids).logits, hand_edited(eager, ReluMulLayer)(ids).logits)
