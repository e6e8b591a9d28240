"""Calls of layers only compared for layer reuse (issue 54, extraction memory): recorded as
outlines (``reuse_plan.compared_call``), taken while the layer runs, holding none of its tensors.

Before, each compared layer's inputs and outputs were kept (tensors shared) until the recording
run ended: every decoder layer's hidden states at once, 242 MB for SmolLM2 at ids (4, 512). The
comparisons themselves are unchanged (``test_layer_reuse``, ``guards/test_input_aliasing``); here:
no tensor is kept, and what an outline compares is the call's state when it was made.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import torch
from transformers import DynamicCache, GPT2Config

from nnbridge.compat.torch.export import register_cache_pytrees
from nnbridge.extract.recording import record_calls
from nnbridge.extract.reuse_plan import ComparedCall, ReusePlan, _same_cache_call, cache_index, compared_call
from nnbridge.extract.sibling_compare import outline, same_outline
from utils import llama


def _parts(value):
    """Every object inside ``value`` through dataclasses, tuples, lists and dicts."""
    yield value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for item in dataclasses.fields(value):
            yield from _parts(getattr(value, item.name))
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _parts(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _parts(key)
            yield from _parts(item)


def test_compared_calls_hold_no_tensor_and_let_each_layers_output_go():
    model = llama()
    register_cache_pytrees(model)  # as extraction does: the cache is then a stateful argument
    layers = {f"model.layers.{i}" for i in range(len(model.model.layers))}
    outputs = []
    handle = model.model.layers[0].register_forward_hook(lambda mod, a, out: outputs.append(weakref.ref(
        out[0] if isinstance(out, tuple) else out)))
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    try:
        calls = record_calls(model, layers, (ids,), kwargs={"use_cache": True},
                             outlined={fqn: compared_call(int(fqn.rsplit(".", 1)[1])) for fqn in layers})
    finally:
        handle.remove()
    gc.collect()
    assert set(calls) == layers and all(len(calls[fqn]) == 1 for fqn in layers)
    for fqn in layers:
        call = calls[fqn][0]
        assert isinstance(call, ComparedCall) and call.output is not None
        assert call.cache is not None and call.cache.layer is not None  # the DynamicCache, by its layer's state
        assert not any(isinstance(part, torch.Tensor) for part in _parts(call)), fqn
    assert outputs and outputs[0]() is None  # nothing recorded keeps layer 0's output alive


def test_compared_calls_of_siblings_compare_as_the_recorded_calls_do():
    model = llama()
    layers = {f"model.layers.{i}" for i in range(len(model.model.layers))}
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    outlined = record_calls(model, layers, (ids,), kwargs={"use_cache": False},
                            outlined={fqn: compared_call(None) for fqn in layers})
    copied = record_calls(model, layers, (ids,), kwargs={"use_cache": False})
    first, second = (outlined[f"model.layers.{i}"][0] for i in (0, 1))
    (a0, k0, out0), (a1, k1, out1) = (copied[f"model.layers.{i}"][0] for i in (0, 1))
    assert same_outline(first.inputs, second.inputs) == same_outline(outline((a0, k0)), outline((a1, k1))) is True
    assert same_outline(first.output, second.output) == same_outline(outline(out0), outline(out1)) is True


def test_an_outline_tells_aliasing_apart():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    assert same_outline(outline((a, b)), outline((b, a)))
    assert not same_outline(outline((a, a)), outline((a, b)))  # one tensor passed twice
    assert not same_outline(outline((a, a[:])), outline((a, b)))  # a view of the first tensor
    assert not same_outline(outline((a, a[:])), outline((a, a)))  # a view is not the tensor itself
    assert not same_outline(outline((a,)), outline((a.t().contiguous().t(),)))  # another memory layout


def test_an_outline_keeps_an_objects_state_when_it_was_taken():
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2)
    x = torch.randn(2, 16)
    before = outline(((x,), {"config": config}))
    assert same_outline(before, outline(((x,), {"config": config})))  # compared by value (to_dict)
    config.n_head = 4  # changed between two calls: the first outline still has 2
    assert not same_outline(before, outline(((x,), {"config": config})))


def test_a_compared_call_keeps_the_state_of_its_own_cache_layer_only():
    """The representative (layer 0, called first) and a sibling (layer 1, called after layer 0
    wrote its cache layer) compare the state of their own cache layer, each at its index: the
    other layers may differ. A sibling whose own layer is not in the representative's state is
    refused."""
    model = llama()
    register_cache_pytrees(model)  # as extraction does: the cache is then a stateful argument
    config = model.config
    cache = DynamicCache(config=config)
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    x, k = torch.randn(1, 3, config.hidden_size), torch.randn(1, heads, 3, dim)
    rep = compared_call(0)((x,), {"past_key_values": cache})(x)
    cache.update(k, k, 0)  # layer 0 writes its cache layer
    sibling = compared_call(1)((x,), {"past_key_values": cache})(x)
    assert rep.cache.layers == sibling.cache.layers == len(cache.layers)
    assert rep.cache.layer == sibling.cache.layer  # layer 1's own layer is as layer 0's was
    assert _same_cache_call(sibling, rep, 1, rep_index=0) is not None
    cache.update(k, k, 1)
    late = compared_call(1)((x,), {"past_key_values": cache})(x)  # layer 1's own layer written already
    assert late.cache.layer != rep.cache.layer
    assert _same_cache_call(late, rep, 1, rep_index=0) is None
    assert compared_call(len(cache.layers))((x,), {"past_key_values": cache})(x).cache.layer is None  # no such layer


def test_a_negative_cache_index_names_no_layer():
    """A layer index is counted from the front: an int attribute that differs between siblings
    and is negative is no cache index (``cache.layers[-1]`` is another layer than the sibling's), so
    a compared call compares no cache layer and two such calls are not the same cache call."""
    plan = ReusePlan(distinct={"layers.0": {("", "layer_idx"): 0, ("self_attn", "layer_idx"): 0},
                               "layers.1": {("", "layer_idx"): -1, ("self_attn", "layer_idx"): -1}})
    assert cache_index(plan, "layers.0") == 0
    assert cache_index(plan, "layers.1") is None
    model = llama()
    register_cache_pytrees(model)
    cache = DynamicCache(config=model.config)
    x = torch.randn(1, 3, model.config.hidden_size)
    rep = compared_call(0)((x,), {"past_key_values": cache})(x)
    last = compared_call(-1)((x,), {"past_key_values": cache})(x)
    assert rep.cache.layer is not None and last.cache.layer is None
    assert _same_cache_call(rep, rep, -1, rep_index=0) is None
    assert _same_cache_call(rep, rep, 0, rep_index=-1) is None
    assert _same_cache_call(rep, rep, 0, rep_index=0) is not None
