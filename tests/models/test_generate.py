"""transformers ``generate`` through nnbridge: bridged models and ``PatchableGraph.generate``
(graphpatch's), compared with the untouched model token for token and score for score."""

import copy
import inspect

import pytest
import torch

import nnbridge
from nnbridge import NNBridgeError, PatchableGraph, ZeroPatch
from utils import gpt2

pytestmark = pytest.mark.integration  # end to end: whole-model generation

GREEDY = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)


def _ids() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(1, 100, (1, 5))


def _assert_same_generation(got, expected) -> None:
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, expected.scores)), "scores differ from eager"


def test_bridged_generate_equals_eager_and_keeps_the_forward_signature():
    """transformers reads ``inspect.signature(model.forward)`` to choose arguments (``logits_to_keep``):
    the bridged body shows the original signature, so the prefill computes what eager computes."""
    model, reference = gpt2(), gpt2()
    ids = _ids()
    nnbridge.bridge(model, ids)
    assert inspect.signature(model.forward) == inspect.signature(reference.forward)
    _assert_same_generation(model.generate(ids, **GREEDY), reference.generate(ids, **GREEDY))
    nnbridge.unbridge(model)


def test_patchable_graph_generate_equals_eager_with_the_kv_cache():
    model, reference = gpt2(), gpt2()
    ids = _ids()
    pg = PatchableGraph(model, ids)
    _assert_same_generation(pg.generate(ids, **GREEDY), reference.generate(ids, **GREEDY))
    assert "forward" not in model.__dict__, "the module's call is restored after generate"
    # the example call, the prefill and one decode extraction serving every decode step (the cache
    # length guard is evaluated on the cache's leaves, as export addressed them)
    assert len(pg.extractions) == 3


def test_patches_apply_at_every_generation_step():
    model, reference = gpt2(), gpt2()
    ids = _ids()
    pg = PatchableGraph(model, ids)
    with pg.patch({"transformer.h_0.mlp.output": ZeroPatch()}):
        patched = pg.generate(ids, **GREEDY)
    handle = reference.transformer.h[0].mlp.register_forward_hook(lambda module, args, output: torch.zeros_like(output))
    expected = reference.generate(ids, **GREEDY)
    handle.remove()
    _assert_same_generation(patched, expected)
    plain = reference.generate(ids, **GREEDY)
    assert all(not torch.equal(a, b) for a, b in zip(patched.scores, plain.scores)), "the patch applied at every step"
    _assert_same_generation(pg.generate(ids, **GREEDY), plain)


def test_patchable_graph_over_a_bridged_model_generates_with_patches():
    model, reference = gpt2(), gpt2()
    ids = _ids()
    nnbridge.bridge(model, ids)
    pg = PatchableGraph(model, ids)
    with pg.patch({"transformer.h_1.attn.output|sub_0": ZeroPatch()}):
        patched = pg.generate(ids, **GREEDY)
    handle = reference.transformer.h[1].attn.register_forward_hook(
        lambda module, args, output: (torch.zeros_like(output[0]), *output[1:]))
    expected = reference.generate(ids, **GREEDY)
    handle.remove()
    _assert_same_generation(patched, expected)
    nnbridge.unbridge(model)


def test_generation_config_is_a_copy_used_by_generate():
    """As graphpatch: ``pg.generation_config`` is the module's, copied; changing it changes what
    ``pg.generate`` does, not the module."""
    model, reference = gpt2(), gpt2()
    ids = _ids()
    pg = PatchableGraph(model, ids)
    assert pg.config is model.config
    pg.generation_config.max_new_tokens = 2
    pg.generation_config.do_sample = False
    assert hasattr(pg, "generate")
    out = pg.generate(ids)
    assert out.shape == (1, 7) and model.generation_config.max_new_tokens != 2
    assert torch.equal(out, reference.generate(ids, max_new_tokens=2, do_sample=False))


def test_generate_errors():
    pg = PatchableGraph(torch.nn.Linear(3, 3), torch.randn(2, 3))
    assert not hasattr(pg, "generate")  # as graphpatch: only generation models have it
    with pytest.raises(AttributeError, match="Linear has no generate.*in a loop"):
        pg.generate(torch.randn(2, 3))
    model = gpt2()
    ids = _ids()
    pg = PatchableGraph(model, ids)
    with pytest.raises(ValueError):  # transformers rejects the argument; the module is left as it was
        pg.generate(ids, max_new_tokens=-3)
    assert "forward" not in model.__dict__
    assert torch.equal(model(ids).logits, copy.deepcopy(model)(ids).logits)
