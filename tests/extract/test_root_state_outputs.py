"""A module extracted as the root of its own extraction, called with a transformers cache, that
only *stores* a tensor in it (Gemma 3's sliding-window layer keeps the last ``window - 1`` keys, a
slice nothing else reads). The program's outputs now carry the state the module wrote, so export
keeps that tensor; before, export dropped it and extraction raised ("writes a tensor into its
state argument ... that nothing in the traced program reads afterwards"), e.g. for every Gemma 3
call with ``output_attentions=True`` (the model is then opaque and each decoder layer a root).
Everything is compared with the untouched model (``torch.equal``)."""

import copy

import torch
from transformers import DynamicCache

import nnbridge
from nnbridge import PatchableGraph
from utils import CACHE_KWARG, assert_same, cached, gemma3


def _ids() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(2, 100, (1, 6))  # longer than the sliding window (4)


def test_gemma3_output_attentions_with_a_cache_equals_eager_and_decodes_on():
    model, reference = gemma3(), gemma3()
    ids = _ids()
    nnbridge.bridge(model, ids)
    got, want = model(ids, output_attentions=True), reference(ids, output_attentions=True)
    assert_same(got.logits, want.logits)
    assert_same(got.attentions, want.attentions)
    assert_same(cached(got.past_key_values), cached(want.past_key_values))
    step = torch.tensor([[7]])
    assert_same(model(step, past_key_values=got.past_key_values, output_attentions=True).logits,
                reference(step, past_key_values=want.past_key_values, output_attentions=True).logits)
    nnbridge.unbridge(model)


def test_sliding_layer_as_root_writes_its_cache_as_eager():
    """The decoder layer itself, called with a fresh cache: its output and the cache it leaves."""
    model = gemma3()
    layer = model.model.layers[0]
    assert model.config.layer_types[0] == "sliding_attention"
    calls = []
    handle = layer.register_forward_pre_hook(lambda m, a, k: calls.append((a, k)), with_kwargs=True)
    with torch.no_grad():
        model(_ids())
    handle.remove()
    args, kwargs = calls[0]

    def call(module):
        cache = DynamicCache(config=model.config)
        return module(*args, **{**kwargs, CACHE_KWARG: cache}), cache
    reference = copy.deepcopy(layer)
    with torch.no_grad():
        pg = PatchableGraph(layer, *args, **{**kwargs, CACHE_KWARG: DynamicCache(config=model.config)})
        (got, got_cache), (want, want_cache) = call(pg), call(reference)
    assert_same(got, want)
    assert_same(cached(got_cache), cached(want_cache))
    assert want_cache.layers[0].keys.shape[-2] == 3  # only the last window - 1 positions are kept
