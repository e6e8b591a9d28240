"""Modules that write into a container they were passed (``acts.append(h)``, ``store["h"] = h``) run
their own code, and so do the callers the container passed through, up to the one that made it.

A graph rebuilds its arguments' containers around their tensors, so before, a graph wrote into its
own copies: the caller's dict or list stayed as it was (silently), or the caller's graph read an
empty list back (an IndexError eager code never raised). Every test compares with an untouched
copy run eagerly (``torch.equal``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nnbridge
from nnbridge import PatchableGraph


class Recorder(nn.Module):
    """Keeps its output, and a call count, in the dict it is passed."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, store):
        h = self.lin(x)
        store["h"] = h.detach().clone()
        store["calls"] = store.get("calls", 0) + 1
        return h


class Collector(nn.Module):
    """Appends its output to the list it is passed."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, acts):
        h = self.lin(x)
        acts.append(h)
        return h


class PassesStore(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Recorder()
        self.out = nn.Linear(4, 4)

    def forward(self, x, store):
        return self.out(self.inner(x, store))


class MakesList(nn.Module):
    """Makes a list, has a child fill it, and reads it back."""

    def __init__(self):
        super().__init__()
        self.inner = Collector()

    def forward(self, x):
        acts = []
        h = self.inner(x, acts)
        return h + acts[0] * 2.0


class Outer(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.inner = inner
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        return self.out(self.inner(self.pre(x)))


class ReadsList(nn.Module):
    """Reads a list argument without writing it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scales):
        return self.lin(x) * scales[0]


class PassesScales(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = ReadsList()

    def forward(self, x):
        return self.inner(x, [torch.full((4,), 2.0)])


def _opaque(run):
    return set(nnbridge.explain(run).opaque)


@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
def test_a_dict_the_caller_passes_gets_the_writes_eager_code_makes(front):
    torch.manual_seed(0)
    model = PassesStore()
    reference = copy.deepcopy(model)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    run = nnbridge.bridge(model, x, {}) if front == "bridge" else PatchableGraph(model, x, {})
    try:
        got, expected = {}, {}
        outputs = [(run(x, got), reference(x, expected)), (run(y, got), reference(y, expected))]
        assert all(torch.equal(a, b) for a, b in outputs)
        assert got.keys() == expected.keys() and got["calls"] == expected["calls"] == 2
        assert torch.equal(got["h"], expected["h"])
        opaque = _opaque(model if front == "bridge" else run)
    finally:
        if front == "bridge":
            nnbridge.unbridge(model)
    assert opaque == {"", "inner"}


def test_a_list_a_module_makes_and_its_child_fills_keeps_the_callers_above_as_graphs():
    torch.manual_seed(0)
    model = Outer(MakesList())
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        for _ in range(2):
            assert torch.equal(model(x), reference(x))
        explained = str(nnbridge.explain(model))
        opaque = _opaque(model)
    finally:
        nnbridge.unbridge(model)
    assert opaque == {"inner", "inner.inner"}
    assert "writes into a list, dict or set it was passed" in explained


def test_a_list_argument_only_read_keeps_the_graph():
    torch.manual_seed(0)
    model = Outer(PassesScales())
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        assert torch.equal(model(x), reference(x))
        opaque = _opaque(model)
    finally:
        nnbridge.unbridge(model)
    assert opaque == set()
