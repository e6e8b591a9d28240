"""Module attributes that are mutable containers other than lists, dicts and sets: a ``deque``
history a forward appends to, a ``deque`` or ``array`` of step sizes a forward reads by index.

Before, extraction's eager runs left their appends in a ``deque`` (the first call saw a longer
history than eager code, silently), and a write into a ``deque`` or ``array`` of numbers read by a
graph was missed (the graph kept the number it read, silently). Every test compares with an
untouched copy run eagerly (``torch.equal``)."""

from __future__ import annotations

import array
import collections
import copy

import pytest
import torch
from torch import nn

import nnbridge
from utils import Outer


class History(nn.Module):
    """Adds the mean of its last two outputs (a ``deque`` with ``maxlen=2``)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = collections.deque(maxlen=2)

    def forward(self, x):
        h = self.lin(x)
        self.seen.append(h.detach())
        return h + sum(self.seen) / len(self.seen)


class Steps(nn.Module):
    """Scales by the first of its step sizes, held in a ``deque`` or an ``array``."""

    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.steps = collections.deque([2.0, 3.0]) if kind == "deque" else array.array("d", [2.0, 3.0])

    def forward(self, x):
        return self.lin(x) * self.steps[0]


def test_a_deque_a_forward_appends_to_holds_only_the_users_calls():
    torch.manual_seed(0)
    model = Outer(History())
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        assert len(model.inner.seen) == 0, "extraction's runs left their appends"
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
        assert len(model.inner.seen) == len(reference.inner.seen) == 2
        assert model.inner.seen.maxlen == 2
        explained = str(nnbridge.explain(model))
    finally:
        nnbridge.unbridge(model)
    assert "writes inner.seen in forward" in explained


@pytest.mark.parametrize("kind", ["deque", "array"])
def test_a_write_into_a_sequence_of_numbers_a_graph_read_is_seen(kind):
    torch.manual_seed(0)
    model = Outer(Steps(kind))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        assert torch.equal(model(x), reference(x))
        opaque = set(nnbridge.explain(model).opaque)
        for net in (model, reference):
            net.inner.steps[0] = 5.0
        assert torch.equal(model(x), reference(x))
    finally:
        nnbridge.unbridge(model)
    assert opaque == set(), "reading numbers keeps the graph"
