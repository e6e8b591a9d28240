"""The process's memory cache (bridge/memory_cache.py): a second instance of the same model, called
the same way, skips torch.export while the first one's graphs live; its graphs equal a fresh
extraction's and eager torch; the cache keeps no model alive; changed code misses."""

from __future__ import annotations

import gc
import importlib
import weakref

import pytest
import torch

from utils import gpt2, llama, replace_gpt2_code, wrap

import nnbridge
from nnbridge import PatchableGraph, ZeroPatch

memory_cache = importlib.import_module("nnbridge.store.memory_cache")


@pytest.fixture(autouse=True)
def disk_cache_off(monkeypatch):
    """The memory cache is what extraction consults when the disk cache is off."""
    monkeypatch.setenv("NNBRIDGE_EXTRACTION_CACHE", "memory")


def _ids():
    return torch.randint(0, 100, (1, 8))


@pytest.mark.parametrize("make", [gpt2, llama])
def test_a_second_instance_skips_export_and_equals_a_fresh_extraction(make, exports, monkeypatch):
    ids = _ids()
    gc.collect()  # no earlier test's model left to serve first
    first = make()
    nnbridge.bridge(first, ids)
    assert exports[0] == 1
    second = make()
    eager = second(ids).logits
    nnbridge.bridge(second, ids)
    assert exports[0] == 1  # served from first's record
    assert torch.equal(second(ids).logits, eager)
    monkeypatch.setenv("NNBRIDGE_EXTRACTION_CACHE", "0")
    fresh = make()
    nnbridge.bridge(fresh, ids)
    assert exports[0] == 2
    point = "mlp.act" if make is gpt2 else "mlp.act_fn"
    for model in (second, fresh):  # a patch and gradients act the same on both
        pg = PatchableGraph(model, ids)
        path = f"{'transformer.h_1' if make is gpt2 else 'model.layers_1'}.{point}.output"
        with pg.patch({path: ZeroPatch()}):
            out = model(ids).logits
        out.sum().backward()
    assert torch.equal(PatchableGraph(second, ids)(ids).logits, PatchableGraph(fresh, ids)(ids).logits)
    for (name, a), (_, b) in zip(second.named_parameters(), fresh.named_parameters()):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), name


def test_the_cache_keeps_no_model_alive_and_an_entry_goes_with_its_graphs(exports):
    ids = _ids()
    gc.collect()  # earlier tests' models
    before = len(memory_cache.memory_cache())
    first = gpt2()
    nnbridge.bridge(first, ids)
    assert len(memory_cache.memory_cache()) == before + 1
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None and len(memory_cache.memory_cache()) == before
    nnbridge.bridge(gpt2(), ids)
    assert exports[0] == 2  # nothing left to serve it


def test_code_replaced_between_instances_misses_and_equals_eager(exports, monkeypatch):
    ids = _ids()
    first = gpt2()
    nnbridge.bridge(first, ids)
    replace_gpt2_code(monkeypatch, "class_method")
    second = gpt2()
    eager = second(ids).logits
    made = exports[0]  # (first may have been served by an earlier test's live model)
    nnbridge.bridge(second, ids)
    assert exports[0] == made + 1
    assert torch.equal(second(ids).logits, eager)


def test_weights_tied_differently_miss_and_equal_eager(exports):
    """A second instance whose ``lm_head`` weight is no longer the embedding's is not served the
    tied program (see test_disk_cache's tying test); nor is a PatchableGraph over a model whose
    tied weight is re-assigned after its first extraction (the guard sees the new tensor; the
    re-extraction must not be served the tied program either)."""
    ids = _ids()
    first = gpt2()
    nnbridge.bridge(first, ids)
    made = exports[0]
    second = gpt2()
    second.lm_head.weight = torch.nn.Parameter(second.lm_head.weight.detach() * 2)
    eager = second(ids).logits
    nnbridge.bridge(second, ids)
    assert exports[0] == made + 1
    assert torch.equal(second(ids).logits, eager)
    model = gpt2()
    pg = PatchableGraph(model, ids)
    pg(ids)
    model.transformer.wte.weight = torch.nn.Parameter(model.transformer.wte.weight.detach() * 2)
    assert model.lm_head.weight is not model.transformer.wte.weight
    eager = model(ids).logits
    assert torch.equal(pg(ids).logits, eager)


def test_switched_off(exports, monkeypatch):
    monkeypatch.setenv("NNBRIDGE_EXTRACTION_CACHE", "0")
    assert memory_cache.memory_cache() is None
    ids = _ids()
    keep = [nnbridge.bridge(gpt2(), ids), nnbridge.bridge(gpt2(), ids)]
    assert exports[0] == 2 and len(keep) == 2


def test_an_nnsight_cache_trace_on_a_second_wrapper_skips_export_and_equals_nnsight(exports):
    """nnsight's test_cache_alias: a new wrapper of the same model (renamed modules) caching every
    module: served from the first wrapper's extraction, values equal nnsight's."""
    import nnsight
    first = wrap(nnbridge, "gpt2")
    with first.trace("Hello world") as tracer:
        tracer.cache(ops=True)
    made = exports[0]
    second, reference = wrap(nnbridge, "gpt2"), wrap(nnsight, "gpt2")
    values = {}
    for name, model in (("bridged", second), ("nnsight", reference)):
        with model.trace("Hello world") as tracer:
            cache = tracer.cache(ops=True) if model is second else tracer.cache()
        values[name] = (cache["model.transformer.h.0"].output[0], cache["model.lm_head"].output)
    assert exports[0] == made  # no export for the second wrapper
    for a, b in zip(values["bridged"], values["nnsight"]):
        assert torch.equal(a, b)
