"""Modules that draw from a random generator object they hold (``self.rng = random.Random(0)``,
numpy's ``default_rng``/``RandomState``, a ``torch.Generator``) run their own code, and
extraction's runs put the generator's state back.

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


class Noisy(nn.Module):
    """Adds noise drawn from the generator it holds."""

    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kind = kind
        self.rng = _generator(kind)

    def forward(self, x):
        h = self.lin(x)
        if self.kind == "torch":
            return h + torch.rand(4, generator=self.rng)
        if self.kind == "random":
            return h * self.rng.random()
        return h * float(self.rng.normal() if self.kind == "numpy" else self.rng.randn())


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
