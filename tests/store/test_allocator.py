"""Freed heap memory goes back to the system after an extraction and after ``unbridge``, and the
cyclic garbage collector is off while a call extracts
(``nnbridge.compat.libc``; the amounts are measured by ``benchmarks/bench_targets.py``)."""

from __future__ import annotations

import gc
import platform
import sys

import pytest
import torch

import nnbridge
from nnbridge.dispatch import dispatcher, extraction
from nnbridge.inplace import bridging as in_place
from nnbridge.compat import libc as allocator
from utils import gpt2


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_release_free_heap_trims_on_glibc():
    assert allocator.release_free_heap() is True


def test_release_free_heap_is_a_no_op_without_malloc_trim(monkeypatch):
    allocator._malloc_trim.cache_clear()
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    try:
        assert allocator.release_free_heap() is False
    finally:
        allocator._malloc_trim.cache_clear()


@pytest.mark.no_extraction_cache
def test_extraction_and_unbridge_release_free_heap(monkeypatch):
    calls = []
    monkeypatch.setattr(extraction, "release_free_heap", lambda: calls.append("extract"))
    monkeypatch.setattr(in_place, "release_garbage", lambda: calls.append("unbridge"))  # gc, then the trim
    model, reference = gpt2(), gpt2()
    ids = torch.randint(0, 100, (1, 6))
    nnbridge.bridge(model, ids)
    assert calls == ["extract"]
    nnbridge.unbridge(model)
    assert calls == ["extract", "unbridge"]
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_collection_paused_restores_the_collector_also_nested_and_after_an_error():
    assert gc.isenabled()
    with allocator.collection_paused():
        assert not gc.isenabled()
        with allocator.collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block leaves the outer one's pause in place
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"):
        with allocator.collection_paused():
            raise RuntimeError("boom")
    assert gc.isenabled()


def test_collection_paused_keeps_a_callers_disabled_collector_off():
    gc.disable()
    try:
        with allocator.collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def _collector_states(monkeypatch, owner, name: str) -> list[bool]:
    """Replace ``owner.<name>`` by a wrapper noting ``gc.isenabled()`` at each call; the notes."""
    seen: list[bool] = []
    real = getattr(owner, name)

    def watched(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, watched)
    return seen


@pytest.mark.no_extraction_cache
def test_extraction_runs_without_cyclic_collection_and_equals_eager(monkeypatch):
    """The collector is off while a call extracts (bridge(), a new call structure), on again
    afterwards, also when extraction fails."""
    seen = _collector_states(monkeypatch, dispatcher, "extract")
    model, reference = gpt2(), gpt2()
    ids = torch.randint(0, 100, (1, 6))
    nnbridge.bridge(model, ids)
    assert seen == [False] and gc.isenabled()
    mask = torch.ones_like(ids)  # a new call structure extracts again
    assert torch.equal(model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits)
    assert seen == [False, False] and gc.isenabled()

    def failing(*args, **kwargs):
        raise RuntimeError("export failed")
    monkeypatch.setattr(dispatcher, "extract", failing)
    with pytest.raises(RuntimeError, match="export failed"):
        model(ids, use_cache=False)
    assert gc.isenabled()
    nnbridge.unbridge(model)
    assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.no_extraction_cache
def test_patchable_graph_records_examples_without_cyclic_collection(monkeypatch):
    from nnbridge.patching.patchable_graph import PatchableGraph
    from nnbridge.patching import patchable_graph

    seen = _collector_states(monkeypatch, patchable_graph, "describe_examples")
    model, reference = gpt2(), gpt2()
    ids = torch.randint(0, 100, (1, 6))
    pg = PatchableGraph(model, ids)
    assert seen == [False] and gc.isenabled()
    assert torch.equal(pg(ids).logits, reference(ids).logits)
