"""Tiny random GPT-2 and Llama (sdpa and eager): exact outputs, op-level patches, gradients."""

import pytest
import torch

from nnbridge import CompiledGraphModule, PatchableGraph, ProbePatch, ZeroPatch
from utils import EXTRACTION_MODES, ROTARY_UNDER_NO_GRAD, assert_same, gpt2, graph_modules, llama, padded_batch

# cache off: each test extracts for itself, whatever order xdist runs the files in (the key tells sdpa and
# eager apart now, see test_disk_cache.test_attention_implementation_misses)
pytestmark = pytest.mark.no_extraction_cache


MODELS = {"gpt2-eager": lambda: gpt2("eager"), "gpt2-sdpa": lambda: gpt2("sdpa"),
          "llama-eager": lambda: llama("eager"), "llama-sdpa": lambda: llama("sdpa")}


@pytest.fixture(scope="module", params=[(model, mode) for model in MODELS for mode in EXTRACTION_MODES],
                ids=lambda param: "-".join(param))
def model_and_graph(request):
    """A tiny model and a PatchableGraph over it, extracted in one mode (compiled or opaque)."""
    name, mode = request.param
    model = MODELS[name]()
    ids, mask = padded_batch(7)
    if mode == "compiled" and name.startswith("llama") and ROTARY_UNDER_NO_GRAD:
        # Its rotary embedding's @torch.no_grad forward (transformers < 5.24) changes grad mode,
        # which a graph cannot keep: it is traced through and shown opaque, by design. Every other
        # module must compile.
        pg = PatchableGraph(model, ids, attention_mask=mask)
        assert list(pg.extractions[0].opaque) == ["model.rotary_emb"], pg.extractions[0].opaque
    else:
        pg = PatchableGraph(model, ids, attention_mask=mask, options=EXTRACTION_MODES[mode]())
    return f"{name}-{mode}", model, pg


def test_outputs_equal_at_two_lengths_and_padded(model_and_graph):
    """Compiled graphs are dynamic in the sequence length; an opaque root runs its own code and its
    children's dispatchers guard their graphs' sizes, so it accepts any sizes too."""
    _, model, pg = model_and_graph
    for seq in (7, 12):
        ids, mask = padded_batch(seq)
        assert_same(pg(ids, attention_mask=mask), model(ids, attention_mask=mask))
    assert len(pg.extractions) == 1, "one extraction serves other sequence lengths"
    for graph_module in graph_modules(pg):
        graph_module.graph.lint()


def test_other_batch_size_reuses_extraction(model_and_graph):
    _, model, pg = model_and_graph
    ids, mask = padded_batch(9)
    ids, mask = torch.cat([ids, ids[:1]]), torch.cat([mask, mask[:1]])
    assert_same(pg(ids, attention_mask=mask), model(ids, attention_mask=mask))
    assert len(pg.extractions) == 1


def test_gradients_equal(model_and_graph):
    _, model, pg = model_and_graph
    ids, mask = padded_batch(6)

    def grads(fn):
        model.zero_grad()
        fn(ids, attention_mask=mask).logits.pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, got = grads(model), grads(pg)
    assert want.keys() == got.keys() and len(want) > 10
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_weights_are_the_models_own(model_and_graph):
    _, model, pg = model_and_graph
    originals = {p.data_ptr() for p in model.parameters()}
    assert all(p.data_ptr() in originals for p in pg.parameters())
    total = sum(p.numel() for p in pg.parameters())
    assert total <= sum(p.numel() for p in model.parameters())


def test_gpt2_softmax_probe_equals_output_attentions_and_zeroing_changes_logits():
    model = gpt2("eager")
    ids, mask = padded_batch(8)
    pg = PatchableGraph(model, ids, attention_mask=mask)
    assert isinstance(pg._graph_module.transformer.h[0].attn, CompiledGraphModule)
    probe = ProbePatch()
    with pg.patch({"transformer.h_0.attn.softmax": probe}):
        patched = pg(ids, attention_mask=mask)
    reference = model(ids, attention_mask=mask, output_attentions=True)
    assert torch.equal(patched.logits, reference.logits)
    assert torch.equal(probe.activation, reference.attentions[0])
    assert probe.activation.shape == (2, 4, 8, 8)
    with pg.patch({"transformer.h_0.attn.softmax": ZeroPatch()}):
        zeroed = pg(ids, attention_mask=mask).logits
    assert not torch.allclose(zeroed, reference.logits)
    assert torch.equal(pg(ids, attention_mask=mask).logits, reference.logits)


def test_llama_ops_reachable():
    model = llama("eager")
    ids, mask = padded_batch(6)
    pg = PatchableGraph(model, ids, attention_mask=mask)
    paths = set(pg.node_paths())
    for path in ["model.layers_0.input_layernorm.rsqrt", "model.layers_0.self_attn.softmax",
                 "model.layers_1.add", "model.layers_1.mlp.down_proj.linear", "output|logits"]:
        assert path in paths, path
    probe = ProbePatch()
    with pg.patch({"model.layers.1.self_attn.softmax": probe}):
        pg(ids, attention_mask=mask)
    reference = model(ids, attention_mask=mask, output_attentions=True)
    assert torch.equal(probe.activation, reference.attentions[1])
    with pg.patch({"output|logits": ZeroPatch()}):
        assert torch.equal(pg(ids, attention_mask=mask).logits, torch.zeros_like(reference.logits))
