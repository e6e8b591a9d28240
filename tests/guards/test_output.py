"""A forward that writes output runs eagerly, so each call writes it as eager does.

A graph replays tensor operations; a ``print``, a write to ``sys.stdout``, a shown warning or a
log record handed to handlers happened once, while the graph was traced, and never again. Each
module below writes output in forward; bridged, every call must write what the untouched model's
call writes, and ``nnbridge.explain`` names the cause. Output a graph stays faithful to (a debug
record below the logger's level, a once-only log helper) leaves a graph.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import logging
import sys
import warnings

import pytest
import torch
from torch import nn

import nnbridge
from nnbridge import PatchableGraph
from utils import Outer, llama

log = logging.getLogger("nnbridge-tests.output")


class Writes(nn.Module):
    """Writes output in forward, by ``how``."""

    def __init__(self, how: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how

    def forward(self, x):
        y = self.lin(x)
        if self.how == "print":
            print("norm", round(float(y.norm()), 3))
        elif self.how == "sys.stdout.write":
            sys.stdout.write("inner ran\n")
        elif self.how == "warning":
            warnings.warn("inner warns", UserWarning)
        elif self.how == "log record":
            log.warning("inner logs")
        elif self.how == "debug record below the level":
            log.debug("not written")
        elif self.how == "once-only log helper":
            _log_once("written once")
        return y * 2


@functools.lru_cache(None)
def _log_once(message: str) -> None:
    """A memoised helper, as transformers' ``logger.warning_once``."""
    log.warning(message)


@contextlib.contextmanager
def _written():
    """``[stdout, warnings (nnbridge's own left out), log records]`` written in the body."""
    stdout, records = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(records)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    got: list = []
    try:
        with contextlib.redirect_stdout(stdout), warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            yield got
    finally:
        log.removeHandler(handler)
    got.extend([stdout.getvalue(), [str(w.message) for w in shown if not issubclass(w.category, nnbridge.NNBridgeWarning)], records.getvalue()])


REPEATED = ["print", "sys.stdout.write", "warning", "log record"]


@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
@pytest.mark.parametrize("how", REPEATED)
def test_a_forward_writing_output_writes_it_on_every_call(how, front):
    torch.manual_seed(0)
    model = Outer(Writes(how))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    with _written():
        run = nnbridge.bridge(model, x) if front == "bridge" else PatchableGraph(model, x)
    try:
        for _ in range(2):
            with _written() as mine:
                out = run(x)
            with _written() as theirs:
                expected = reference(x)
            assert torch.equal(out, expected)
            assert mine == theirs and any(theirs), "the graph dropped the forward's output"
        explained = str(nnbridge.explain(run))
        assert "inner (Writes): opaque" in explained and "writes output in forward" in explained
        assert "out (Linear): graph" in explained
    finally:
        if front == "bridge":
            nnbridge.unbridge(model)


@pytest.mark.parametrize("how", ["debug record below the level", "once-only log helper"])
def test_output_eager_would_not_write_again_leaves_a_graph(how):
    torch.manual_seed(0)
    model = Outer(Writes(how))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    with _written():
        nnbridge.bridge(model, x)
    try:
        with _written() as mine:
            out = model(x)
        with _written() as theirs:
            expected = reference(x)
        assert torch.equal(out, expected) and mine == theirs
        assert not nnbridge.explain(model).opaque
    finally:
        nnbridge.unbridge(model)


def test_extractions_own_runs_print_nothing_and_the_first_lazy_call_prints_once():
    torch.manual_seed(0)
    model = Outer(Writes("print"))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    with _written() as bridging:
        nnbridge.bridge(model)
    try:
        with _written() as mine:
            out = model(x)  # extracts, then runs
        with _written() as theirs:
            expected = reference(x)
        assert torch.equal(out, expected)
        assert bridging[0] == "" and mine == theirs and theirs[0].count("norm") == 1
    finally:
        nnbridge.unbridge(model)


def test_a_llama_attention_that_prints_runs_its_layer_eagerly_and_prints_once_a_call(monkeypatch):
    """The attention is called with the cache: it cannot be a stub in its layer's graph, so the
    layer runs eagerly (before, calling the bridged model raised a TypeError from the stub)."""
    from transformers.models.llama import modeling_llama
    original = modeling_llama.eager_attention_forward

    def printing(*args, **kwargs):
        print("attention")
        return original(*args, **kwargs)
    monkeypatch.setattr(modeling_llama, "eager_attention_forward", printing)
    model = llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(1, 100, (1, 6))
    with torch.no_grad():
        with _written():
            nnbridge.bridge(model, ids)
        try:
            with _written() as mine:
                out = model(ids).logits
            with _written() as theirs:
                expected = reference(ids).logits
            opaque = nnbridge.explain(model).opaque
        finally:
            nnbridge.unbridge(model)
    assert torch.equal(out, expected) and mine == theirs and theirs[0] == "attention\n" * 2
    assert "model.layers_0" in opaque and "model.layers_0.mlp" not in opaque
