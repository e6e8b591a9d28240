"""Modules that draw from a random generator object (``random.Random(0)``, numpy's
``default_rng``/``RandomState``, a ``torch.Generator``) they hold (``self.rng``), that a plain
object they hold holds (``self.cfg.rng``), or that their code reads as a module global or from a
closure cell, run their own code, and extraction's runs put the generator's state back.

Before, a graph kept the number drawn while it was extracted (Python's and numpy's generators), and
extraction's runs advanced every such generator, so the first calls drew other numbers than eager
code: silently. Every test compares with an untouched copy run eagerly (``torch.equal``)."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from torch import nn

import nnbridge
from nnbridge import PatchableGraph
from utils import Outer


def _generator(kind):
    return {"random": lambda: random.Random(0), "numpy": lambda: np.random.default_rng(0),
            "RandomState": lambda: np.random.RandomState(0),
            "torch": lambda: torch.Generator().manual_seed(0)}[kind]()


def _draw(kind, rng, h):
    if kind == "torch":
        return h + torch.rand(4, generator=rng)
    if kind == "random":
        return h * rng.random()
    return h * float(rng.normal() if kind == "numpy" else rng.randn())


class Noisy(nn.Module):
    """Adds noise drawn from the generator it holds."""

    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kind = kind
        self.rng = _generator(kind)

    def forward(self, x):
        return _draw(self.kind, self.rng, self.lin(x))


@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
@pytest.mark.parametrize("kind", ["random", "numpy", "RandomState", "torch"])
def test_draws_from_a_held_generator_equal_eager_from_the_first_call(kind, front):
    torch.manual_seed(0)
    model = Outer(Noisy(kind))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    run = nnbridge.bridge(model, x) if front == "bridge" else PatchableGraph(model, x)
    try:
        for _ in range(3):
            assert torch.equal(run(x), reference(x))
        explained = str(nnbridge.explain(model if front == "bridge" else run))
    finally:
        if front == "bridge":
            nnbridge.unbridge(model)
    assert "inner (Noisy): opaque" in explained
    if kind != "torch":  # (export cannot take a torch.Generator argument: it fails first)
        assert "draws from its random generator attribute 'rng'" in explained


#: generators read as module globals (each test gets new ones, see ``fresh_generators``)
PY_RNG, NP_RNG, NP_STATE, TORCH_RNG = (_generator(kind) for kind in ("random", "numpy", "RandomState", "torch"))


class GlobalNoisy(nn.Module):
    """Adds noise drawn from a module global generator."""

    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x):
        h = self.lin(x)
        if self.kind == "torch":
            return h + torch.rand(4, generator=TORCH_RNG)
        if self.kind == "random":
            return h * PY_RNG.random()
        return h * float(NP_RNG.normal() if self.kind == "numpy" else NP_STATE.randn())


def _closure_drawer(kind):
    rng = _generator(kind)

    def draw(h):
        return _draw(kind, rng, h)
    return draw


class ClosureNoisy(nn.Module):
    """Adds noise drawn from a generator in the closure of a helper it holds."""

    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.draw = _closure_drawer(kind)

    def forward(self, x):
        return self.draw(self.lin(x))


_GLOBALS = {"random": "PY_RNG", "numpy": "NP_RNG", "RandomState": "NP_STATE", "torch": "TORCH_RNG"}


def _renew(kind, monkeypatch):
    monkeypatch.setitem(globals(), _GLOBALS[kind], _generator(kind))


class Settings:
    """A plain object a module holds, with a generator among its attributes."""

    def __init__(self, kind):
        self.kind = kind
        self.rng = _generator(kind)


class HeldNoisy(nn.Module):
    """Adds noise drawn from the generator of a plain object it holds (``self.cfg.rng``)."""

    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cfg = Settings(kind)

    def forward(self, x):
        return _draw(self.cfg.kind, self.cfg.rng, self.lin(x))


NOISY = {"global": GlobalNoisy, "closure": ClosureNoisy, "held object": HeldNoisy}


@pytest.fixture
def fresh_generators(monkeypatch):
    """Each global generator new, as seeded, for the test (the old ones back after it)."""
    for kind in _GLOBALS:
        _renew(kind, monkeypatch)
    return monkeypatch


@pytest.mark.parametrize("where", list(NOISY))
@pytest.mark.parametrize("kind", ["random", "numpy", "RandomState", "torch"])
def test_draws_from_a_global_closure_or_held_generator_equal_eager_from_the_first_call(kind, where,
                                                                                      fresh_generators):
    torch.manual_seed(0)
    model = Outer(NOISY[where](kind))
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        got = [model(x) for _ in range(3)]
        explained = str(nnbridge.explain(model))
    finally:
        nnbridge.unbridge(model)
    # the same model unbridged, its generator put back as it was before bridging
    if where == "global":
        _renew(kind, fresh_generators)
    elif where == "closure":
        model.inner.draw = _closure_drawer(kind)
    else:
        model.inner.cfg.rng = _generator(kind)
    expected = [model(x) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert "inner (" in explained and "): opaque" in explained
    if kind != "torch":  # (export cannot take a torch.Generator argument: it fails first)
        named = {"global": f".{_GLOBALS[kind]} (", "closure": ".<closure>.rng (", "held object": "inner.cfg.rng ("}
        assert "writes the state of " in explained and named[where] in explained.split("writes the state of ")[1]
