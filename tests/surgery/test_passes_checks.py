"""Checks after each pass, the rollback when one fails, and every refused argument."""

import pytest
import torch
from torch.fx.passes.infra.pass_manager import PassManager

import nnbridge
from nnbridge import PatchableGraph, ZeroPatch
from nnbridge.errors import PassCheckError
from nnbridge.surgery import apply_passes
from nnbridge.surgery import pass_graphs
from passes_common import (ReplaceAddWithMul, graph_at, insert_relu_after_add, models, node_names,
                           replace_add_with_mul)

aten = torch.ops.aten


@pytest.fixture
def llama_pg():
    model, _, ids = models()
    pg = PatchableGraph(model, ids, use_cache=False)
    return pg, ids, pg(ids, use_cache=False).logits


def _last_add(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == aten.add.Tensor][-1]


def assert_unchanged(pg, ids, logits):
    assert torch.equal(pg(ids, use_cache=False).logits, logits)
    for i in (0, 1):
        graph = graph_at(pg, f"model.layers_{i}")
        assert [n.target for n in graph.graph.nodes if n.name.startswith("add")] == [aten.add.Tensor] * 2
        assert "relu" not in node_names(graph) and "sum" not in node_names(graph)


def test_a_shape_changing_pass_is_rolled_back_in_every_graph(llama_pg):
    pg, ids, logits = llama_pg
    seen = []

    def shrink_the_last_layer(gm):
        seen.append(gm)
        replace_add_with_mul(gm)
        if len(seen) == 2:  # layer 1, after layer 0 was edited and checked
            node = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == aten.mul.Tensor][-1]
            with gm.graph.inserting_after(node):
                summed = gm.graph.call_function(aten.sum.dim_IntList, (node, [-1], True))
            node.replace_all_uses_with(summed, delete_user_cb=lambda user: user is not summed)
    with pytest.raises(PassCheckError) as caught:
        apply_passes(pg, [shrink_the_last_layer], scope="model.layers_*")
    error = caught.value
    assert (error.pass_name, error.graph, error.check) == ("shrink_the_last_layer", "model.layers_1", "shapes")
    assert "Tensor(1, 8, 64)" in str(error) and "Tensor(1, 8, 1)" in str(error)
    assert_unchanged(pg, ids, logits)


def test_a_pass_that_breaks_a_child_call_fails_the_shape_check(llama_pg):
    pg, ids, logits = llama_pg

    def transpose_mlp_input(gm):
        call = next(n for n in gm.graph.nodes if n.op == "call_module" and n.name == "mlp")
        with gm.graph.inserting_before(call):
            flipped = gm.graph.call_function(aten.transpose.int, (call.args[0], 0, 1))
        call.args = (flipped, *call.args[1:])
    with pytest.raises(PassCheckError) as caught:
        apply_passes(pg, transpose_mlp_input, scope="model.layers_0")
    assert caught.value.check == "shapes" and "'mlp'" in str(caught.value)
    assert_unchanged(pg, ids, logits)


def test_a_signature_change_is_refused(llama_pg):
    pg, ids, logits = llama_pg

    def add_input(gm):
        first = next(iter(gm.graph.nodes))
        with gm.graph.inserting_before(first):
            gm.graph.placeholder("extra")
    with pytest.raises(PassCheckError) as caught:
        apply_passes(pg, add_input, scope="model.layers_0")
    assert (caught.value.graph, caught.value.check) == ("model.layers_0", "signature")
    assert_unchanged(pg, ids, logits)


def test_an_output_structure_change_is_refused(llama_pg):
    pg, ids, logits = llama_pg

    def pair_output(gm):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        output.args = ((output.args[0], output.args[0]),)
    with pytest.raises(PassCheckError) as caught:
        apply_passes(pg, pair_output, scope="model.layers_0")
    assert caught.value.check == "signature" and "output" in str(caught.value)
    assert_unchanged(pg, ids, logits)


def test_a_graph_lint_failure_is_refused(llama_pg):
    pg, ids, logits = llama_pg

    def use_before_definition(gm):
        add = _last_add(gm)
        first = next(n for n in gm.graph.nodes if n.op != "placeholder")
        with gm.graph.inserting_before(first):
            gm.graph.call_function(aten.relu.default, (add,))
    with pytest.raises(PassCheckError) as caught:
        apply_passes(pg, use_before_definition, scope="model.layers_0")
    assert caught.value.check == "lint" and "use_before_definition" in str(caught.value)
    assert_unchanged(pg, ids, logits)


def test_a_pass_that_raises_changes_nothing(llama_pg):
    pg, ids, logits = llama_pg

    def half_done(gm):
        replace_add_with_mul(gm)
        raise ValueError("gave up")
    with pytest.raises(PassCheckError) as caught:
        apply_passes(pg, [insert_relu_after_add, half_done], scope="model.layers_*")
    assert (caught.value.pass_name, caught.value.check) == ("half_done", "run")
    assert isinstance(caught.value.__cause__, ValueError) and "gave up" in str(caught.value)
    assert_unchanged(pg, ids, logits)


def test_a_user_check_that_raises_fails_under_its_name(llama_pg):
    pg, ids, logits = llama_pg

    def no_mul(gm):
        if any(n.target == aten.mul.Tensor for n in gm.graph.nodes):
            raise ValueError("mul found")
    with pytest.raises(PassCheckError) as caught:
        apply_passes(pg, ReplaceAddWithMul, scope="model.layers_*", checks=["lint", no_mul])
    assert caught.value.check == "no_mul" and "mul found" in str(caught.value)
    assert_unchanged(pg, ids, logits)


def test_a_passing_user_check_lets_the_edit_through(llama_pg):
    pg, ids, logits = llama_pg
    apply_passes(pg, replace_add_with_mul, scope="model.layers_0", checks=[lambda gm: None])
    assert not torch.equal(pg(ids, use_cache=False).logits, logits)


class SAE(torch.nn.Module):
    def forward(self, x):
        return x


def test_a_call_of_a_plain_module_is_refused_with_the_fix(llama_pg):
    pg, ids, logits = llama_pg

    def insert_sae(gm):
        gm.add_submodule("sae", SAE())
        add = _last_add(gm)
        with gm.graph.inserting_after(add):
            sae = gm.graph.call_module("sae", (add,))
        add.replace_all_uses_with(sae, delete_user_cb=lambda user: user is not sae)
    with pytest.raises(PassCheckError) as caught:
        apply_passes(pg, insert_sae, scope="model.layers_0")
    assert caught.value.check == "call_module" and "SAE" in str(caught.value) and "insert_after" in str(caught.value)
    assert_unchanged(pg, ids, logits)


def test_a_call_of_a_missing_module_is_refused(llama_pg):
    pg, ids, logits = llama_pg

    def call_nothing(gm):
        add = _last_add(gm)
        with gm.graph.inserting_after(add):
            call = gm.graph.call_module("mlp", (add,))
        call.target = "nowhere"
    with pytest.raises(PassCheckError) as caught:
        apply_passes(pg, call_nothing, scope="model.layers_0", checks=["signature"])
    assert caught.value.check == "call_module" and "nowhere" in str(caught.value)
    assert_unchanged(pg, ids, logits)


def test_removing_a_patched_node_is_refused(llama_pg):
    pg, ids, logits = llama_pg

    def remove_relu(gm):
        for node in list(gm.graph.nodes):
            if node.target == aten.relu.default:
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
    apply_passes(pg, insert_relu_after_add, scope="model.layers_0")
    with pg.patch({"model.layers_0.relu": ZeroPatch()}):
        with pytest.raises(PassCheckError) as caught:
            apply_passes(pg, remove_relu, scope="model.layers_0")
    assert caught.value.check == "listened" and "relu" in str(caught.value)
    apply_passes(pg, remove_relu, scope="model.layers_0")  # nothing listens any more
    assert torch.equal(pg(ids, use_cache=False).logits, logits)


def test_an_install_failure_undoes_the_graphs_already_installed(llama_pg, monkeypatch):
    pg, ids, logits = llama_pg
    installs = []
    real = pass_graphs.install

    def failing_second(work, result, *, where):
        if installs:
            raise RuntimeError("disk full")
        installs.append(where)
        return real(work, result, where=where)
    monkeypatch.setattr("nnbridge.surgery.passes.install", failing_second)
    with pytest.raises(RuntimeError, match="disk full"):
        apply_passes(pg, replace_add_with_mul, scope="model.layers_*")
    assert installs == ["model.layers_0"]
    assert_unchanged(pg, ids, logits)


def test_pass_manager_errors_are_reported_as_the_pass_raising(llama_pg):
    pg, ids, logits = llama_pg
    with pytest.raises(PassCheckError) as caught:
        apply_passes(pg, PassManager(passes=[replace_add_with_mul]), scope="model.layers_*")  # returns None: refused
    assert caught.value.check == "run" and caught.value.pass_name == "PassManager(replace_add_with_mul)"
    assert_unchanged(pg, ids, logits)


@pytest.mark.parametrize("passes, check, words", [
    (ReplaceAddWithMul.__new__(ReplaceAddWithMul), "argument", "pass the class"),
    (dict, "argument", "not an fx.Transformer subclass"),
    (42, "argument", "is not a pass"),
    (lambda: None, "argument", "takes no argument"),
    ([], "argument", "no passes"),
], ids=["transformer_instance", "other_class", "not_callable", "no_argument", "empty"])
def test_a_bad_pass_is_refused_before_anything_runs(llama_pg, passes, check, words):
    pg, ids, logits = llama_pg
    with pytest.raises(PassCheckError) as caught:
        apply_passes(pg, passes)
    assert caught.value.check == check and words in str(caught.value)
    assert_unchanged(pg, ids, logits)


@pytest.mark.parametrize("kwargs, check, words", [
    ({"scope": ""}, "argument", "non-empty glob"),
    ({"scope": 3}, "argument", "non-empty glob"),
    ({"scope": "model.layer_*"}, "scope", "matches no compiled graph"),
    ({"checks": ["size"]}, "argument", "unknown check 'size'"),
    ({"checks": [3]}, "argument", "checks= takes names"),
], ids=["empty_scope", "scope_type", "scope_matches_nothing", "unknown_check", "check_type"])
def test_bad_scopes_and_checks_are_refused(llama_pg, kwargs, check, words):
    pg, ids, logits = llama_pg
    with pytest.raises(PassCheckError) as caught:
        apply_passes(pg, replace_add_with_mul, **kwargs)
    assert caught.value.check == check and words in str(caught.value)
    assert_unchanged(pg, ids, logits)


def test_a_target_that_is_neither_bridged_nor_a_patchable_graph_is_refused():
    model, _, _ = models()
    with pytest.raises(PassCheckError, match="PatchableGraph or a bridged model") as caught:
        apply_passes(model, replace_add_with_mul)
    assert caught.value.check == "argument"


def test_a_bridged_model_never_called_is_refused():
    model, _, ids = models()
    nnbridge.bridge(model)
    with pytest.raises(PassCheckError, match="no extracted graph yet"):
        apply_passes(model, replace_add_with_mul)
    model(ids, use_cache=False)
    assert apply_passes(model, replace_add_with_mul, scope="model.layers_0").graphs == ["model.layers_0"]


def test_a_call_of_another_graphs_child_is_refused(llama_pg):
    pg, ids, logits = llama_pg
    borrowed = graph_at(pg, "model.layers_1.mlp")

    def borrow_the_next_mlp(gm):
        gm.add_submodule("borrowed", borrowed)
        next(n for n in gm.graph.nodes if n.op == "call_module" and n.name == "mlp").target = "borrowed"
    with pytest.raises(PassCheckError) as caught:
        apply_passes(pg, borrow_the_next_mlp, scope="model.layers_0")
    assert caught.value.check == "call_module" and "another graph's child" in str(caught.value)
    assert_unchanged(pg, ids, logits)


def test_a_fused_partition_that_calls_modules_is_refused(llama_pg):
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupportBase
    pg, ids, logits = llama_pg

    class Everything(OperatorSupportBase):
        def is_node_supported(self, submodules, node):
            return node.op in ("call_module", "call_function")

    def fuse_everything(gm):
        partitioner = CapabilityBasedPartitioner(gm, Everything())
        return partitioner.fuse_partitions(partitioner.propose_partitions())
    with pytest.raises(PassCheckError) as caught:
        apply_passes(pg, fuse_everything, scope="model.layers_0")
    assert caught.value.check == "call_module" and "calls modules itself" in str(caught.value)
    assert_unchanged(pg, ids, logits)


def test_a_dead_node_that_fake_propagation_cannot_compute_is_refused(llama_pg):
    pg, ids, logits = llama_pg

    def dead_mismatch(gm):
        add = _last_add(gm)
        with gm.graph.inserting_after(add):
            gm.graph.call_function(aten.mm.default, (add, add))  # (1, 8, 64) is no matrix
    with pytest.raises(PassCheckError) as caught:
        apply_passes(pg, dead_mismatch, scope="model.layers_0")
    assert caught.value.check == "shapes" and "fake propagation fails" in str(caught.value)
    assert "model.layers_0" in str(caught.value) and "mm" in str(caught.value)
    assert_unchanged(pg, ids, logits)


def test_a_pass_edit_that_fails_leaves_its_graph_unchanged(llama_pg):
    from nnbridge.surgery import PassEdit
    pg, ids, logits = llama_pg

    def raises(gm):
        replace_add_with_mul(gm)
        raise ValueError("no")
    with pytest.raises(PassCheckError, match="the pass raises raised on the graph model.layers_0"):
        PassEdit(raises).apply(graph_at(pg, "model.layers_0"))
    assert_unchanged(pg, ids, logits)
