"""Gemma 3 (text): ``rotary_emb`` is called once per layer type with the type as a string argument
(``Gemma3RotaryEmbedding.forward(x, position_ids, layer_type)``). torch 2.13's export failed on a
string passing through a module-call boundary, so ``Gemma3TextModel`` used to fall back to opaque;
``nnbridge.compat.torch.tracepoints`` fixes that. Everything is compared with the untouched model."""

import pytest
import torch
from torch.fx.experimental import proxy_tensor

import nnbridge
from nnbridge import ExtractionOptions, PatchableGraph, ZeroPatch
from nnbridge.compat.torch.tracepoints import string_arguments_traced
from utils import assert_same, gemma3, graph_modules, no_grad_rotary

pytestmark = pytest.mark.integration  # end to end: whole-model generation

GREEDY = dict(max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True)
STRICT = ExtractionOptions(error_on_compilation_failure=True)


def _ids() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(2, 100, (1, 6))


def _assert_same_generation(got, expected) -> None:
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores) == GREEDY["max_new_tokens"]
    assert all(torch.equal(a, b) for a, b in zip(got.scores, expected.scores)), "scores differ from eager"


def _full_attention_rotary(pg: PatchableGraph) -> str:
    """The ``rotary_emb`` invocation computing full-attention positions (the model iterates over a
    ``set`` of layer types, so the call order depends on the process's string hashing)."""
    names = [f"model.rotary_emb_{i}" for i in (0, 1) if f"model.rotary_emb_{i}.full_attention_inv_freq" in pg.graph.keys()]
    assert len(names) == 1, names
    return names[0]


def test_every_module_is_a_graph_under_no_grad():
    model, reference = gemma3(), gemma3()
    ids = _ids()
    with torch.no_grad():
        assert nnbridge.explain(model, ids).opaque == {}
        pg = PatchableGraph(model, STRICT, ids)  # strict: a fallback would raise
        assert_same(pg(ids), reference(ids))
    keys = pg.graph.keys()
    assert {"model.rotary_emb_0.layer_type", "model.rotary_emb_1.layer_type"} <= set(keys)
    assert len(graph_modules(pg)) > 30
    for graph_module in graph_modules(pg):
        graph_module.graph.lint()


def test_with_grad_only_the_no_grad_rotary_embedding_runs_eagerly():
    """As for Llama: ``@torch.no_grad`` on the rotary embedding's forward (transformers < 5.24; set
    here on any version) changes grad mode, which a graph cannot keep, so under grad mode it (and
    only it) runs eagerly."""
    model, reference = no_grad_rotary(gemma3()), gemma3()
    ids = _ids()
    opaque = nnbridge.explain(model, ids).opaque
    assert sorted(opaque) == ["model.rotary_emb_0", "model.rotary_emb_1"], opaque
    assert all("grad mode" in reason for reason in opaque.values())
    pg = PatchableGraph(model, ids)
    out, expected = pg(ids), reference(ids)
    assert_same(out, expected)
    out.logits.sum().backward()
    expected.logits.sum().backward()
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), name


def test_patch_on_one_rotary_invocation_equals_a_hook_on_that_call():
    model, reference = gemma3(), gemma3()
    ids = _ids()
    with torch.no_grad():
        pg = PatchableGraph(model, STRICT, ids)
        target = _full_attention_rotary(pg)
        with pg.patch({f"{target}.output|sub_0": ZeroPatch()}):
            patched = pg(ids)

        def zero_cos(module, args, output):
            return (torch.zeros_like(output[0]), output[1]) if args[2] == "full_attention" else output

        handle = reference.model.rotary_emb.register_forward_hook(zero_cos)
        expected = reference(ids)
        handle.remove()
        assert_same(patched, expected)
        assert not torch.equal(patched.logits, reference(ids).logits), "the patch changed the output"
        assert_same(pg(ids), reference(ids))


@pytest.mark.parametrize("layer_types", [("sliding_attention", "full_attention"), ("sliding_attention",) * 2])
def test_patchable_graph_generate_equals_eager(layer_types):
    model, reference = gemma3(layer_types), gemma3(layer_types)
    ids = _ids()
    pg = PatchableGraph(model, ids)
    _assert_same_generation(pg.generate(ids, **GREEDY), reference.generate(ids, **GREEDY))


def test_bridged_generate_equals_eager():
    model, reference = gemma3(), gemma3()
    ids = _ids()
    nnbridge.bridge(model, ids)
    try:
        _assert_same_generation(model.generate(ids, **GREEDY), reference.generate(ids, **GREEDY))
    finally:
        nnbridge.unbridge(model)
    _assert_same_generation(model.generate(ids, **GREEDY), reference.generate(ids, **GREEDY))


def test_string_shim_is_removed_after_an_error():
    original = proxy_tensor.extract_val
    with pytest.raises(RuntimeError, match="boom"):
        with string_arguments_traced():
            assert proxy_tensor.extract_val("full_attention") == "full_attention"
            raise RuntimeError("boom")
    assert proxy_tensor.extract_val is original
    with pytest.raises(AssertionError, match="unreachable"):  # torch 2.13's own behaviour, which the shim covers
        original("full_attention")


@pytest.mark.xfail(strict=True, reason=(
    "a known silent difference: transformers' sdpa_attention_forward packs a one-token query's GQA heads"
    " (pack_gqa) when not is_torchdynamo_compiling(), and repeats keys and values (repeat_kv) when it is, as"
    " while torch.export traces; nnbridge.compat.torch.capture trusts transformers' compile questions, so"
    " the graph of a decode step with a mask (a sliding layer) keeps the traced branch: 1 ulp off (answering"
    " eager's False to transformers fixes this case and breaks a decode step with a mask of all ones, which"
    " eager code skips: see capture._TRUSTED)"))
def test_sdpa_decode_step_with_a_mask_equals_eager():
    def make():
        model = gemma3()
        config = model.config.to_dict()
        config["attn_implementation"] = "sdpa"
        torch.manual_seed(0)
        return type(model)(type(model.config)(**config)).eval()
    model, reference = make(), make()
    torch.manual_seed(1)
    ids, step = torch.randint(1, 100, (2, 7)), torch.randint(1, 100, (2, 1))
    nnbridge.bridge(model, ids)
    with torch.no_grad():
        out, expected = model(ids), reference(ids)
        assert torch.equal(out.logits, expected.logits)
        after = model(step, past_key_values=out.past_key_values).logits
        assert torch.equal(after, reference(step, past_key_values=expected.past_key_values).logits)
