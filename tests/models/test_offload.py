"""``PatchableGraph`` on an accelerate-offloaded model (``device_map`` with ``"disk"``), without
``nnbridge.bridge``: opaque modules run inside the module's accelerate hook, as the eager call does,
so offloaded weights are loaded for the call and offloaded again. Compared with the untouched
offloaded model (same checkpoint, same device map) with ``torch.equal``."""

import pytest
import torch

from nnbridge import CompiledGraphModule, ExtractionOptions, PatchableGraph, ZeroPatch
from nnbridge.compat.accelerate import run_hooked
from utils import assert_same, gpt2

DEVICE_MAP = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.drop": "cpu",
              "transformer.h.0": "cpu", "transformer.h.1": "disk", "transformer.ln_f": "cpu", "lm_head": "cpu"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("offload")
    gpt2().save_pretrained(path / "model")
    return path


def _offloaded(checkpoint, name):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint / "model", device_map=DEVICE_MAP,
                                                 offload_folder=checkpoint / name).eval()
    assert model.transformer.h[1].attn.c_attn.weight.device.type == "meta"
    return model


def _ids():
    torch.manual_seed(1)
    return torch.randint(1, 100, (2, 6))


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("skip_compilation", [True, False], ids=["opaque", "compiled"])
def test_outputs_and_gradients_equal_the_offloaded_eager_model(checkpoint, skip_compilation):
    model, reference = _offloaded(checkpoint, "a"), _offloaded(checkpoint, "b")
    ids = _ids()
    pg = PatchableGraph(model, ExtractionOptions(skip_compilation=skip_compilation), ids, use_cache=False)
    assert model.transformer.h[1].attn.c_attn.weight.device.type == "meta", "weights offloaded again"
    out, expected = pg(ids, use_cache=False), reference(ids, use_cache=False)
    assert_same(out, expected)
    out.logits.sum().backward()
    expected.logits.sum().backward()
    got, want = _grads(model), _grads(reference)
    assert sum(g is not None for g in want.values()) > 0
    for name in want:
        assert (got[name] is None) == (want[name] is None), name
        assert got[name] is None or torch.equal(got[name], want[name]), name
    assert model.transformer.h[1].attn.c_attn.weight.device.type == "meta", "weights offloaded after the call"


def test_opaque_patch_on_an_offloaded_module_equals_a_hook(checkpoint):
    model, reference = _offloaded(checkpoint, "a"), _offloaded(checkpoint, "b")
    ids = _ids()
    pg = PatchableGraph(model, ExtractionOptions(skip_compilation=True), ids, use_cache=False)
    with pg.patch({"transformer.h_1.mlp.output": ZeroPatch()}):
        patched = pg(ids, use_cache=False)
    handle = reference.transformer.h[1].mlp.register_forward_hook(lambda m, a, o: torch.zeros_like(o))
    expected = reference(ids, use_cache=False)
    handle.remove()
    assert_same(patched, expected)
    assert not torch.equal(patched.logits, reference(ids, use_cache=False).logits)


def test_run_hooked_offloads_again_when_the_body_raises(checkpoint):
    model = _offloaded(checkpoint, "a")
    attn = model.transformer.h[1].attn

    def body(args, kwargs):
        assert attn.c_attn.weight.device.type == "cpu", "loaded for the call"
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_hooked(attn.c_attn, (torch.zeros(1, 64),), {}, body=body)
    assert attn.c_attn.weight.device.type == "meta"
    assert run_hooked(torch.nn.Identity(), (3,), {}, body=lambda args, kwargs: args[0]) == 3  # no hook: body alone


def test_a_compiled_graph_keeps_the_gradient_of_an_offloaded_weight_on_its_copy(checkpoint):
    # eager accelerate loads an offloaded weight afresh for each call and drops it, its .grad with it;
    # the compiled graph holds one CPU copy, whose .grad is the plain model's (docs/graphpatch.md)
    from transformers import AutoModelForCausalLM

    model, plain = _offloaded(checkpoint, "a"), AutoModelForCausalLM.from_pretrained(checkpoint / "model").eval()
    ids, name = _ids(), "transformer.h.1.attn.c_attn.weight"
    pg = PatchableGraph(model, ids, use_cache=False)
    assert isinstance(pg.extractions[0].root.get_submodule("transformer.h.1.attn.c_attn"), CompiledGraphModule)
    pg(ids, use_cache=False).logits.sum().backward()
    plain(ids, use_cache=False).logits.sum().backward()
    held = dict(pg.extractions[0].root.named_parameters())[name]
    assert model.get_parameter(name).grad is None and model.get_parameter(name).device.type == "meta"
    assert held.device.type == "cpu" and torch.equal(held.grad, plain.get_parameter(name).grad)
