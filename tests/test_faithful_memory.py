"""Faithful or loud, part "memory": transformers' output capturing (``output_attentions``,
``output_hidden_states``) through bridged models, copies and pickling of bridged models, and that
nothing nnbridge creates keeps a model, a PatchableGraph or generated code alive."""

import copy
import gc
import io
import linecache
import pickle
import weakref

import pytest
import torch

import nnbridge
from nnbridge import NNBridgeError, PatchableGraph
from nnbridge.bridge import bridge_of
from test_caches import cached
from test_transformers import gpt2, llama
from utils import assert_same

MODELS = {"gpt2": gpt2, "llama": llama}
CAPTURE = [{"output_attentions": True}, {"output_hidden_states": True},
           {"output_attentions": True, "output_hidden_states": True}]


def assert_outputs_equal(got, want):
    """Every output leaf ``torch.equal``: logits, hidden states, attentions, cache contents."""
    assert list(got.keys()) == list(want.keys())
    for key in want.keys():
        if key == "past_key_values":
            assert type(got[key]) is type(want[key])
            assert_same(cached(got[key]), cached(want[key]))
        elif isinstance(want[key], tuple):
            assert isinstance(got[key], tuple) and len(got[key]) == len(want[key]), key
            for a, b in zip(got[key], want[key]):
                assert isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a, b), key
        else:
            assert_same(got[key], want[key])


# -- item 10: output_attentions / output_hidden_states ------------------------------------------------
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("capture", CAPTURE, ids=lambda c: "+".join(c))
@pytest.mark.parametrize("name", list(MODELS))
def test_bridged_capture_outputs_equal_eager(name, capture, use_cache):
    ids = torch.randint(1, 100, (1, 6))
    eager, model = MODELS[name](), MODELS[name]()
    want = eager(ids, use_cache=use_cache, **capture)
    nnbridge.bridge(model, ids)  # extracted without capturing; the capturing call is a new structure
    got = model(ids, use_cache=use_cache, **capture)
    assert_outputs_equal(got, want)
    if "output_attentions" in capture:
        assert got.attentions[0].shape == (1, 4, 6, 6)  # (batch, heads, seq, seq)
    # the module that collects is opaque (reason recorded); its decoder layers are still graphs
    reasons = [r for e in bridge_of(model).dispatcher.all_extractions() for r in e.opaque.values()]
    assert any("output_attentions or output_hidden_states" in r for r in reasons)
    layer = model.transformer.h[0] if name == "gpt2" else model.model.layers[0]
    assert any(isinstance(m, nnbridge.OpPoint) for m in layer.modules())
    # the plain call still equals eager, and unbridging leaves capturing working
    assert_outputs_equal(model(ids), eager(ids))
    nnbridge.unbridge(model)
    assert_outputs_equal(model(ids, use_cache=use_cache, **capture), want)


@pytest.mark.parametrize("name", list(MODELS))
def test_bridged_with_capturing_example_call(name):
    ids = torch.randint(1, 100, (1, 6))
    eager, model = MODELS[name](), MODELS[name]()
    kwargs = {"use_cache": False, "output_attentions": True, "output_hidden_states": True}
    nnbridge.bridge(model, ids, **kwargs)
    assert_outputs_equal(model(ids, **kwargs), eager(ids, **kwargs))


@pytest.mark.parametrize("name", list(MODELS))
def test_capturing_hooks_installed_before_bridging_and_user_hooks(name):
    """The model already installed its capturing hooks (an eager call with output_attentions), and
    the user hooked the attention module: extraction keeps both, and eager capturing still works
    after unbridge."""
    ids = torch.randint(1, 100, (1, 5))
    eager, model = MODELS[name](), MODELS[name]()
    want = eager(ids, output_attentions=True, output_hidden_states=True)
    model(ids, output_attentions=True)
    attention = model.transformer.h[0].attn if name == "gpt2" else model.model.layers[0].self_attn
    seen = []
    handle = attention.register_forward_hook(lambda m, a, o: seen.append(type(o)))
    nnbridge.bridge(model, ids)
    assert_outputs_equal(model(ids, output_attentions=True, output_hidden_states=True), want)
    nnbridge.unbridge(model)
    assert_outputs_equal(model(ids, output_attentions=True, output_hidden_states=True), want)
    assert seen and all(t is tuple for t in seen)
    handle.remove()


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("name", list(MODELS))
def test_nnsight_capture_outputs_equal_eager(name, use_cache):
    ids = torch.randint(1, 100, (1, 6))
    eager = MODELS[name]()
    want = eager(ids, use_cache=use_cache, output_attentions=True, output_hidden_states=True)
    model = nnbridge.NNsight(MODELS[name]())
    model.extract(ids, use_cache=False)
    with model.trace(ids, use_cache=use_cache, output_attentions=True, output_hidden_states=True):
        output = model.output.save()
    assert_outputs_equal(output, want)
    with model.trace(ids, use_cache=False):
        plain = model.output.save()
    assert_outputs_equal(plain, eager(ids, use_cache=False))
