"""Layer reuse (``ExtractionOptions(reuse_layers=True)``, issue 13): a sibling layer's graph is its
representative's graph bound to its own parameters, indistinguishable from a full extraction.

Each model is extracted twice, fully and with reuse; the two must have the same graph code and
NodePaths per module, and give ``torch.equal`` outputs, gradients and per-layer patched outputs
(also equal to eager). Gemma 3 with alternating layer kinds must fall back (two layers, one of
each kind) or reuse only within a kind (sliding, sliding, full).
"""

from __future__ import annotations

import logging

import pytest
import torch

import nnbridge
from nnbridge import CompiledGraphModule, ExtractionOptions, PatchableGraph, ProbePatch, ZeroPatch
from nnbridge.bridge.in_place import bridge_of
from utils import gemma3, gpt2, llama

# not strict: Llama's and Gemma's rotary embeddings change grad mode and are opaque either way
REUSE = ExtractionOptions(reuse_layers=True)
FULL = ExtractionOptions()


def _three_layers(factory):
    def make():
        model = factory()
        config = model.config
        torch.manual_seed(0)
        config.num_hidden_layers = 3
        if hasattr(config, "n_layer"):
            config.n_layer = 3
        return type(model)(config).eval()
    return make


def _gemma3_three():
    """Tiny Gemma 3 with layers sliding, sliding, full (as ``utils.gemma3``, three layers)."""
    config = gemma3().config.to_dict()
    config.pop("attn_implementation", None)
    config.update(num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(**config, attn_implementation="eager")).eval()


MODELS = {
    # (factory, layer prefix, expected {sibling: representative}, a node in every layer)
    "gpt2": (_three_layers(gpt2), "transformer.h",
             {"transformer.h.1": "transformer.h.0", "transformer.h.2": "transformer.h.0"}, "attn.softmax"),
    "llama": (_three_layers(llama), "model.layers",
              {"model.layers.1": "model.layers.0", "model.layers.2": "model.layers.0"}, "self_attn.softmax"),
    "gemma3_alternating": (lambda: gemma3(("sliding_attention", "full_attention")), "model.layers", {},
                           "self_attn.softmax"),
    "gemma3_sliding_sliding_full": (_gemma3_three,
                                    "model.layers", {"model.layers.1": "model.layers.0"}, "self_attn.softmax"),
}


def _graphs(pg: PatchableGraph) -> dict[str, CompiledGraphModule]:
    return {name: m for name, m in pg._graph_module.named_modules() if isinstance(m, CompiledGraphModule)}


def _reused(pg: PatchableGraph) -> dict[str, str]:
    return {name: m.graph_meta.reused_from for name, m in _graphs(pg).items() if m.graph_meta.reused_from}


def _layers(model, prefix):
    return len(model.get_submodule(prefix))


def _node_path(prefix: str, i: int, node: str) -> str:
    owner, _, container = prefix.rpartition(".")
    return f"{owner}.{container}_{i}.{node}"


@pytest.fixture(params=list(MODELS), scope="module")
def case(request):
    factory, prefix, expected, node = MODELS[request.param]
    model = factory()
    torch.manual_seed(1)
    ids = torch.randint(1, 100, (2, 7))
    full = PatchableGraph(model, ids, use_cache=False, options=FULL)
    reused = PatchableGraph(model, ids, use_cache=False, options=REUSE)
    return model, ids, prefix, expected, node, full, reused


def test_reuse_happens_where_expected(case):
    model, ids, prefix, expected, node, full, reused = case
    assert _reused(reused) == expected
    assert _reused(full) == {}


def test_same_graphs_and_node_paths(case):
    model, ids, prefix, expected, node, full, reused = case
    assert full.node_paths() == reused.node_paths()
    a, b = _graphs(full), _graphs(reused)
    assert list(a) == list(b)
    for name in a:
        assert a[name].code == b[name].code, name
        assert [n.name for n in a[name].graph.nodes] == [n.name for n in b[name].graph.nodes], name
        # each graph reads its own module's parameters
        assert [(k, v.data_ptr()) for k, v in a[name].named_parameters()] == \
            [(k, v.data_ptr()) for k, v in b[name].named_parameters()], name


def test_outputs_and_grads_equal(case):
    model, ids, prefix, expected, node, full, reused = case
    eager = model(ids, use_cache=False).logits
    outputs, grads = [], []
    for pg in (full, reused):
        model.zero_grad(set_to_none=True)
        out = pg(ids, use_cache=False).logits
        out.pow(2).sum().backward()
        outputs.append(out.detach())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    assert torch.equal(outputs[0], eager) and torch.equal(outputs[1], eager)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for k in grads[0]:
        assert torch.equal(grads[0][k], grads[1][k]), k


def test_per_layer_patches_equal(case):
    model, ids, prefix, expected, node, full, reused = case
    plain = full(ids, use_cache=False).logits
    probes_per_layer = []
    for i in range(_layers(model, prefix)):
        path = _node_path(prefix, i, node)
        results, probes = [], []
        for pg in (full, reused):
            probe = ProbePatch()
            with pg.patch({path: [probe, ZeroPatch()]}):
                results.append(pg(ids, use_cache=False).logits)
            probes.append(probe.activation)
        assert torch.equal(results[0], results[1]), path
        assert torch.equal(probes[0], probes[1]), path
        assert not torch.equal(results[0], plain), path  # the patch took effect
        probes_per_layer.append(probes[1])
    # each layer's op saw its own layer's values (siblings are bound to their own parameters)
    for i in range(1, len(probes_per_layer)):
        assert not torch.equal(probes_per_layer[0], probes_per_layer[i])


def test_gemma3_alternating_falls_back(caplog):
    model = gemma3(("sliding_attention", "full_attention"))
    ids = torch.randint(1, 100, (1, 6))
    with caplog.at_level(logging.INFO, logger="nnbridge.bridge.extraction"):
        pg = PatchableGraph(model, ids, use_cache=False, options=REUSE)
    assert _reused(pg) == {}
    assert "fell back" in caplog.text


def test_cache_argument_exports_every_layer():
    """With ``use_cache`` on (a DynamicCache threads through every layer) nothing is reused."""
    model = _three_layers(gpt2)()
    ids = torch.randint(1, 100, (1, 6))
    pg = PatchableGraph(model, ids, options=REUSE)
    assert _reused(pg) == {}
    torch.testing.assert_close(pg(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_differing_attribute_read_falls_back(caplog):
    """GPT-2 built with ``scale_attn_by_inverse_layer_idx`` scales each layer's attention by its
    own ``scaling`` attribute, read while exporting: the layers differ, so every layer is exported
    (and the graphs stay exact)."""
    torch.manual_seed(0)
    model = type(gpt2())(type(gpt2().config)(n_layer=3, n_embd=64, n_head=4, vocab_size=100,
                                            attn_implementation="eager", scale_attn_by_inverse_layer_idx=True)).eval()
    ids = torch.randint(1, 100, (1, 6))
    with caplog.at_level(logging.INFO, logger="nnbridge.bridge.extraction"):
        pg = PatchableGraph(model, ids, use_cache=False, options=REUSE)
    assert _reused(pg) == {}
    assert "scaling" in caplog.text
    assert torch.equal(pg(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


def test_in_place_op_point_hooks_per_layer():
    """Bridged in place with reuse, every layer's op points are its own: a torch hook on layer k's
    softmax changes the output exactly as with a full extraction."""
    ids = torch.randint(1, 100, (1, 6))
    results = {}
    for label, options in (("full", FULL), ("reuse", REUSE)):
        model = _three_layers(gpt2)()
        nnbridge.bridge(model, ids, use_cache=False, options=options)
        bridge = bridge_of(model)
        assert bridge is not None
        per_layer = []
        for i in range(3):
            point = model.get_submodule(f"transformer.h.{i}.attn.softmax")
            handle = point.register_forward_hook(lambda module, args, output: output * 0.5)
            try:
                per_layer.append(model(ids, use_cache=False).logits)
            finally:
                handle.remove()
        results[label] = per_layer
        nnbridge.unbridge(model)
    for a, b in zip(results["full"], results["reuse"]):
        assert torch.equal(a, b)
    assert not torch.equal(results["reuse"][1], results["reuse"][2])


def test_nnsight_envoys_per_layer():
    """nnsight envoys over a model bridged with reuse see and set each layer's own op values,
    exactly as over a fully extracted one."""
    ids = torch.randint(1, 100, (1, 6))
    results = {}
    for label, options in (("full", FULL), ("reuse", REUSE)):
        model = _three_layers(gpt2)()
        nnbridge.bridge(model, ids, use_cache=False, options=options)
        roots = [e.root for e in bridge_of(model).dispatcher.all_extractions()]
        reused = {name: m.graph_meta.reused_from for root in roots for name, m in root.named_modules()
                  if isinstance(m, CompiledGraphModule) and m.graph_meta.reused_from}
        wrapped = nnbridge.NNsight(model)
        with wrapped.trace(ids, use_cache=False):
            seen_0 = wrapped.transformer.h[0].attn.softmax.output.save()
            seen_1 = wrapped.transformer.h[1].attn.softmax.output.save()
            seen_2 = wrapped.transformer.h[2].attn.softmax.output.save()
            wrapped.transformer.h[2].attn.softmax.output[:] = 0
            logits = wrapped.lm_head.output.save()
        results[label] = ([seen_0, seen_1, seen_2], logits, reused)
        nnbridge.unbridge(model)
    (seen_full, logits_full, reused_full), (seen_reuse, logits_reuse, reused) = results["full"], results["reuse"]
    assert reused_full == {} and reused == {"transformer.h.1": "transformer.h.0", "transformer.h.2": "transformer.h.0"}
    for a, b in zip(seen_full, seen_reuse):
        assert torch.equal(a, b)
    assert torch.equal(logits_full, logits_reuse)


def test_other_sequence_length(case):
    """Dynamic shapes: the reused graphs serve another length exactly, as the full ones do."""
    model, ids, prefix, expected, node, full, reused = case
    other = torch.randint(1, 100, (2, 11))
    eager = model(other, use_cache=False).logits
    assert torch.equal(full(other, use_cache=False).logits, eager)
    assert torch.equal(reused(other, use_cache=False).logits, eager)
    assert len(full.extractions) == len(reused.extractions)
