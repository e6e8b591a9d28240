"""A torch function replaced in its module (``F.softmax = wrapper``) is followed, and traced faithfully or run eagerly.

Researchers wrap torch functions to record or change what a model computes
(``torch.nn.functional.scaled_dot_product_attention = recording_sdpa``). A bridged model must
compute what eager computes with the wrapper in place, whether it was set before bridging or
after (the graphs read the function by identity: a replacement re-extracts). torch.export traces
a wrapper of a function that dispatches ``__torch_function__`` by its own global name
(``F.softmax``, ``F.silu``) once per torch-function mode, so a module calling one runs eagerly;
a wrapper of a built-in (``F.gelu``) is traced and stays a graph.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nnbridge
from utils import Outer, llama

F = torch.nn.functional


def _scaled(original):
    def wrapper(x, *args, **kwargs):
        return original(x, *args, **kwargs) * 1.5
    return wrapper


class Calls(nn.Module):
    """Calls ``torch.nn.functional.<name>`` through the module attribute, as transformers does."""

    def __init__(self, name: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.name = name

    def forward(self, x):
        h = self.lin(x)
        if self.name == "softmax":
            return nn.functional.softmax(h, dim=-1)
        if self.name == "silu":
            return nn.functional.silu(h)
        return nn.functional.gelu(h)


@pytest.mark.parametrize("when", ["before bridging", "after bridging"])
@pytest.mark.parametrize("name", ["softmax", "silu", "gelu"])
def test_a_replaced_torch_function_is_followed(name, when, monkeypatch):
    torch.manual_seed(0)
    model = Outer(Calls(name))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    wrapper = _scaled(getattr(F, name))
    if when == "before bridging":
        monkeypatch.setattr(F, name, wrapper)
    nnbridge.bridge(model, x)
    try:
        if when == "after bridging":
            assert torch.equal(model(x), reference(x))
            monkeypatch.setattr(F, name, wrapper)
        assert torch.equal(model(x), reference(x))
        opaque = nnbridge.explain(model).opaque
        if name == "gelu":  # a built-in: the wrapper is traced into the graph
            assert not opaque
        else:
            assert "torch function whose global in its module was replaced" in opaque["inner"]
            assert "out" not in opaque
    finally:
        nnbridge.unbridge(model)


def test_softmax_replaced_in_a_llama_with_a_cache_runs_its_callers_eagerly(monkeypatch):
    """The attention calls ``nn.functional.softmax`` and is called with the cache: it cannot be a
    stub in its layer's graph, so the layer runs eagerly (as transformers' output collection does)."""
    model = llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(1, 100, (1, 6))
    monkeypatch.setattr(F, "softmax", _scaled(F.softmax))
    with torch.no_grad():
        nnbridge.bridge(model, ids)
        try:
            assert torch.equal(model(ids).logits, reference(ids).logits)
            opaque = nnbridge.explain(model).opaque
        finally:
            nnbridge.unbridge(model)
    assert "model.layers_0" in opaque and "model.layers_0.mlp" not in opaque


def test_sdpa_replaced_after_bridging_a_llama_re_extracts_and_stays_a_graph(monkeypatch):
    """The researcher's way to record attention: wrap ``F.scaled_dot_product_attention`` (a
    built-in, which the wrapper calls; export traces the wrapper once)."""
    model = llama(attn="sdpa")
    reference = copy.deepcopy(model)
    ids = torch.randint(1, 100, (1, 6))
    with torch.no_grad():
        nnbridge.bridge(model, ids)
        try:
            assert torch.equal(model(ids).logits, reference(ids).logits)
            monkeypatch.setattr(F, "scaled_dot_product_attention", _scaled(F.scaled_dot_product_attention))
            assert torch.equal(model(ids).logits, reference(ids).logits)
            explained = nnbridge.explain(model)
        finally:
            nnbridge.unbridge(model)
    assert not explained.opaque
    assert "torch.nn.functional.scaled_dot_product_attention was replaced" in str(explained)
