"""Forwards that read autograd state no call structure records, or that seed torch's RNG, run their
own code (opaque, with the reason).

A graph keeps the Python branches its code took while it was extracted. Before, a forward reading
a parameter's ``.grad`` kept the branch of "no gradient yet" after every backward, one branching on
``x.is_leaf`` (or ``x.grad_fn``) kept the extracted argument's answer for every later argument, and
one calling ``torch.manual_seed`` drew new numbers on each call where eager drew the same ones: all
silently. Found from the interpreter's profiling events (``nnbridge.compat.torch.grad_reads``).
Every test compares with an untouched copy run eagerly (``torch.equal``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nnbridge


class GradScaled(nn.Module):
    """Adds the sum of its weight's gradient once there is one (as a gradient-aware regulariser)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        grad = self.lin.weight.grad
        return self.lin(x) if grad is None else self.lin(x) + grad.sum()


class LeafBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * (2.0 if x.is_leaf else 3.0)


class GradFnBranch(LeafBranch):
    def forward(self, x):
        return self.lin(x) * (2.0 if x.grad_fn is None else 3.0)


class Seeded(nn.Module):
    """Seeds torch's RNG in forward, then draws: eager draws the same numbers on every call."""

    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how

    def forward(self, x):
        if self.how == "manual_seed":
            torch.manual_seed(123)
        else:
            torch.set_rng_state(_STATE)
        return torch.dropout(self.lin(x), 0.5, True) + torch.rand(4)


_STATE = torch.Generator().manual_seed(7).get_state()


class Outer(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        return self.out(self.inner(x))


def _explained(model):
    return str(nnbridge.explain(model))


def test_a_forward_reading_a_parameters_grad_follows_each_backward():
    torch.manual_seed(0)
    model = Outer(GradScaled())
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        for _ in range(3):
            outputs = [net(x) for net in (model, reference)]
            assert torch.equal(*outputs)
            for out in outputs:
                out.sum().backward()
        explained = _explained(model)
    finally:
        nnbridge.unbridge(model)
    assert "inner (GradScaled): opaque" in explained and "reads a tensor's grad, grad_fn or is_leaf" in explained
    assert "out (Linear): graph" in explained


@pytest.mark.parametrize("kind", [LeafBranch, GradFnBranch], ids=["is_leaf", "grad_fn"])
def test_a_branch_on_whether_an_argument_is_a_leaf_follows_each_argument(kind):
    torch.manual_seed(0)
    model = Outer(kind())
    reference = copy.deepcopy(model)
    leaf = torch.randn(2, 4, requires_grad=True)
    nnbridge.bridge(model, leaf)
    try:
        for x in (leaf, leaf * 1.0, leaf):
            assert torch.equal(model.inner(x), reference.inner(x))
            assert torch.equal(model(x), reference(x))
    finally:
        nnbridge.unbridge(model)


@pytest.mark.parametrize("how", ["manual_seed", "set_rng_state"])
def test_a_forward_seeding_torchs_rng_draws_what_eager_draws(how):
    torch.manual_seed(0)
    model = Outer(Seeded(how)).train()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        got, expected = [], []
        for net, outputs in ((model, got), (reference, expected)):
            torch.manual_seed(1)
            outputs.extend([net(x), net(x), torch.rand(3)])
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        explained = _explained(model)
    finally:
        nnbridge.unbridge(model)
    assert "sets the state of a torch random generator in forward" in explained
