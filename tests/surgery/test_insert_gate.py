"""A gate inserted after an eager attention softmax equals a hand-written attention; the softmax's
NodePath still reads the pre-gate value (patches, torch hooks, nnsight)."""

import copy

import pytest
import torch
from transformers.models.llama import modeling_llama

import nnbridge
from nnbridge import surgery
from nnbridge.inplace.bridging import bridge_of
from surgery_models import HeadGate, assert_grads_equal, gated_attention
from utils import llama

SITE = "model.layers_1.self_attn.softmax"


@pytest.fixture
def setup():
    model = llama()
    ids = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(2))
    nnbridge.bridge(model, ids)
    yield model, ids
    if bridge_of(model) is not None:
        nnbridge.unbridge(model)


def reference_with(gate):
    reference = llama()
    reference.model.layers[1].self_attn.head_gate = copy.deepcopy(gate)
    return reference


def run_reference(reference, ids, monkeypatch):
    with monkeypatch.context() as patched:
        patched.setattr(modeling_llama, "eager_attention_forward", gated_attention)
        return reference(ids).logits


def test_gate_equals_hand_written_attention(setup, monkeypatch):
    model, ids = setup
    gate = HeadGate()
    reference = reference_with(gate)
    edit = surgery.insert_after(model, SITE, gate)
    assert edit.node_path == "model.layers_1.self_attn.head_gate"
    out = model(ids).logits
    expected = run_reference(reference, ids, monkeypatch)
    assert torch.equal(out, expected)
    out.sum().backward()
    with monkeypatch.context() as patched:
        patched.setattr(modeling_llama, "eager_attention_forward", gated_attention)
        reference(ids).logits.sum().backward()
    assert_grads_equal(model, reference)
    assert gate.g.grad is not None


def test_softmax_still_names_the_pre_gate_value(setup):
    model, ids = setup
    pg = nnbridge.PatchableGraph(model, ids)
    probe = nnbridge.ProbePatch()
    with pg.patch({SITE: probe}):
        model(ids)
    before = probe.activation
    gate = HeadGate()
    surgery.insert_after(model, SITE, gate)
    probe = nnbridge.ProbePatch()
    hooked = []
    point = model.get_submodule("model.layers.1.self_attn.softmax")
    handle = point.register_forward_hook(lambda module, args, output: hooked.append(output))
    pg = nnbridge.PatchableGraph(model, ids)
    with pg.patch({SITE: probe}):
        model(ids)
    handle.remove()
    assert torch.equal(probe.activation, before)  # the softmax, not the gated weights
    assert torch.equal(hooked[0], before)
    # the gate's output is a node of its own
    gated = nnbridge.ProbePatch()
    with pg.patch({"model.layers_1.self_attn.head_gate.output": gated}):
        model(ids)
    assert torch.equal(gated.activation, before * gate.g.view(1, -1, 1, 1))


def test_nnsight_target_reads_softmax_and_gate(setup):
    model, ids = setup
    traced = nnbridge.NNsight(model)  # made before the edit: the gate gets its envoy all the same
    gate = HeadGate()
    edit = surgery.insert_after(traced, SITE, gate)
    assert surgery.edits(traced) == [edit]
    traced.extract(ids)  # the edited graphs (and the gate's op envoys) before the trace
    with traced.trace(ids):
        softmax = traced.model.layers[1].self_attn.softmax.output.save()
        product = traced.model.layers[1].self_attn.head_gate.mul.output.save()  # the gate's own op
        gated = traced.model.layers[1].self_attn.head_gate.output.save()
    assert torch.equal(gated, softmax * gate.g.view(1, -1, 1, 1))
    assert torch.equal(product, gated)
    edit.remove()
    with traced.trace(ids):
        plain = traced.model.layers[1].self_attn.softmax.output.save()
    assert torch.equal(plain, softmax)
