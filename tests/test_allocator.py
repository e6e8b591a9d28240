"""Freed heap memory goes back to the system after an extraction and after ``unbridge``
(``nnbridge.compat.allocator``; the amounts are measured by ``benchmarks/bench_targets.py``)."""

from __future__ import annotations

import platform
import sys

import pytest
import torch

import nnbridge
from nnbridge.bridge import extraction, in_place
from nnbridge.compat import allocator
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
    monkeypatch.setattr(in_place, "release_free_heap", lambda: calls.append("unbridge"))
    model, reference = gpt2(), gpt2()
    ids = torch.randint(0, 100, (1, 6))
    nnbridge.bridge(model, ids)
    assert calls == ["extract"]
    nnbridge.unbridge(model)
    assert calls == ["extract", "unbridge"]
    assert torch.equal(model(ids).logits, reference(ids).logits)
