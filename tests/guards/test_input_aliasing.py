"""A call's aliasing between its tensor arguments is part of its structure (issue 48, item 1).

Export traces one placeholder for a tensor passed twice, so a graph exported from ``block(a, a)``
would compute ``block(h, a)`` as ``block(h, h)``. As Dynamo's duplicate-input guard, the pattern of
which arguments are one tensor (or share a storage) is in the call's structure key: it picks the
extraction of a module, decides whether a sibling layer may take its representative's graph
(layer reuse and sibling roots) and keys the disk cache. Every case is compared with eager by
``torch.equal``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nnbridge
from nnbridge import ExtractionOptions, PatchableGraph
from nnbridge.guards.call_structure import alias_pattern, structure_key
from nnbridge.inplace.bridging import bridge_of



class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, a):
        return self.lin(x + a)


class Blocks(nn.Module):
    """Three identical blocks; the first receives its input twice (``h is a``)."""

    def __init__(self):
        super().__init__()
        self.bs = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, a):
        h = a
        for block in self.bs:
            h = block(h, a)
        return h


class KeywordLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, scale, bias):
        return self.linear(x) * scale + bias


class KeywordLayers(nn.Module):
    """graphpatch's nested-module fixture's shape: layers called with keywords out of order."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([KeywordLayer() for _ in range(3)])

    def forward(self, x, scale):
        for layer in self.layers:
            x = layer(bias=1.5, x=x, scale=scale)
        return x


def _models():
    torch.manual_seed(0)
    return {"blocks": (Blocks(), lambda: (torch.randn(2, 8),)),
            "keyword_layers": (KeywordLayers(), lambda: (torch.ones(2, 4) * 0.5,) * 2)}


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no_reuse"])
@pytest.mark.parametrize("name", ["blocks", "keyword_layers"])
@pytest.mark.parametrize("front_end", ["pg", "bridge"])
def test_siblings_called_without_the_representatives_aliasing_equal_eager(front_end, name, reuse):
    model, make_args = _models()[name]
    torch.manual_seed(1)
    args = make_args()
    expected = model(*args)
    options = ExtractionOptions(reuse_layers=reuse)
    if front_end == "pg":
        actual = PatchableGraph(model, *args, options=options)(*args)
    else:
        nnbridge.bridge(model, options=options)
        try:
            actual = model(*args)
        finally:
            nnbridge.unbridge(model)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("first", ["aliased", "distinct"])
def test_a_graph_exported_for_one_aliasing_is_not_served_to_another(first):
    block = Block()
    torch.manual_seed(2)
    a, h = torch.randn(2, 8), torch.randn(2, 8)
    calls = [(a, a), (h, a)] if first == "aliased" else [(h, a), (a, a)]
    expected = [block(*call) for call in calls]
    nnbridge.bridge(block)
    try:
        actual = [block(*call) for call in calls]
        reasons = [e.reason for e in bridge_of(block).dispatcher.history]
    finally:
        nnbridge.unbridge(block)
    assert all(torch.equal(x, y) for x, y in zip(actual, expected))
    assert reasons == ["first call", "aliasing between tensor arguments changed"]


def test_another_model_of_the_same_code_is_not_served_an_aliased_graph():
    """Two instances of one class: the second's distinct-argument call must not get the graph the
    first exported for an aliased call (a cache shared across models keys on the structure)."""
    torch.manual_seed(3)
    first, second = Block(), Block()
    a, h = torch.randn(2, 8), torch.randn(2, 8)
    expected = second(h, a)
    nnbridge.bridge(first)
    try:
        first(a, a)
        nnbridge.bridge(second)
        actual = second(h, a)
    finally:
        nnbridge.unbridge(first)
        nnbridge.unbridge(second)
    assert torch.equal(actual, expected)


def test_alias_pattern_tells_same_tensor_views_and_distinct_tensors_apart():
    a, b = torch.randn(4), torch.randn(4)
    assert alias_pattern([a, b]) == (None, None)
    assert alias_pattern([a, a]) == (None, (0, True))
    assert alias_pattern([a, a[:2]]) == (None, (0, False))
    assert alias_pattern([b, a, a.view(2, 2), b]) == (None, None, (1, False), (0, True))
    # a tensor without storage counts by identity only
    meta = torch.empty(3, device="meta")
    assert alias_pattern([meta, torch.empty(3, device="meta"), meta]) == (None, None, (0, True))


def test_structure_keys_differ_by_aliasing_only():
    block = Block()
    a, h = torch.randn(2, 8), torch.randn(2, 8)
    modules = list(block.modules())
    assert structure_key(modules, (a, a), {}) != structure_key(modules, (h, a), {})
    assert structure_key(modules, (h, a), {}) == structure_key(modules, (a.clone(), h), {})
