"""Tensors a graph would bake in as constants with no guard to see them change run eagerly.

torch.export lifts every tensor the traced code reads that is not a parameter, buffer or input of
the exported module as a constant of the graph. The guards follow such a tensor when it is a tensor
attribute of a module of the tree, a module global or an attribute of an object a module holds
(``tests/guards/test_held_objects.py``). A module kept out of the registry (a sparse autoencoder
held in a plain list so that its weights stay out of ``state_dict``, or set with
``object.__setattr__``) is none of these: before, its weights were baked into the caller's graph,
so an in-place update, a new weight, and its gradient were silently missed, and the disk cache
served one process's weights to another. Its caller now runs its own code (opaque, with the
reason), and every test compares with an untouched copy run eagerly (``torch.equal``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nnbridge


class Box:
    """A plain object holding a module."""

    def __init__(self, module):
        self.module = module


class InList(nn.Module):
    def __init__(self, trainable):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.sae = [nn.Linear(4, 4).requires_grad_(trainable)]

    def forward(self, x):
        return self.sae[0](self.lin(x))

    def hidden(self):
        return self.sae[0]


class SetAround(InList):
    def __init__(self, trainable):
        super().__init__(trainable)
        object.__setattr__(self, "outside", self.sae.pop())

    def forward(self, x):
        return self.outside(self.lin(x))

    def hidden(self):
        return self.outside


class InObject(InList):
    def __init__(self, trainable):
        super().__init__(trainable)
        self.box = Box(self.sae.pop())

    def forward(self, x):
        return self.box.module(self.lin(x))

    def hidden(self):
        return self.box.module


class Model(nn.Module):
    def __init__(self, kind, trainable=False):
        super().__init__()
        self.block = kind(trainable)
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        return self.out(self.block(x)).relu()


KINDS = {"plain_list": InList, "object_setattr": SetAround, "held_object": InObject}


def _write_in_place(model):
    with torch.no_grad():
        model.block.hidden().weight.mul_(2.0)


def _new_weight(model):
    model.block.hidden().weight = nn.Parameter(torch.ones(4, 4), requires_grad=False)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_module_outside_the_registry_is_read_as_it_is_at_each_call(kind):
    torch.manual_seed(0)
    model = Model(KINDS[kind])
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        for edit in (lambda m: None, _write_in_place, _write_in_place, _new_weight):
            edit(model)
            edit(reference)
            assert torch.equal(model(x), reference(x))
        explained = str(nnbridge.explain(model))
    finally:
        nnbridge.unbridge(model)
    assert "block (" in explained and "reads a (4, 4) torch.float32 tensor that is not a parameter" in explained
    assert "out (Linear): graph" in explained, "only the reader runs its own code"


def test_a_trainable_module_outside_the_registry_gets_eagers_gradients():
    torch.manual_seed(0)
    model = Model(InList, trainable=True)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        for _ in range(2):
            for net in (model, reference):
                net(x).sum().backward()
                weight = net.block.hidden().weight
                with torch.no_grad():
                    weight -= 0.1 * weight.grad
                weight.grad = None
            assert torch.equal(model.block.hidden().weight, reference.block.hidden().weight)
    finally:
        nnbridge.unbridge(model)


def test_another_models_weights_outside_the_registry_are_not_served_from_the_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NNBRIDGE_CACHE", str(tmp_path))
    x = torch.randn(2, 4)
    for fill in (1.0, 2.0):  # the same code and registered weights, other weights outside the registry
        torch.manual_seed(0)
        model = Model(InList)
        with torch.no_grad():
            model.block.hidden().weight.fill_(fill)
        expected = model(x)
        nnbridge.bridge(model, x)
        try:
            assert torch.equal(model(x), expected), fill
        finally:
            nnbridge.unbridge(model)


class Literal(nn.Module):
    """Tensors made from Python data in forward are the code's own constants: still a graph."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * torch.tensor([1.0, 2.0, 3.0, 4.0]) + torch.tensor(0.5)


def test_tensors_made_from_data_in_forward_keep_the_graph():
    torch.manual_seed(0)
    model = Literal()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        assert torch.equal(model(x), reference(x))
        explained = str(nnbridge.explain(model))
    finally:
        nnbridge.unbridge(model)
    assert "opaque" not in explained, explained


def _scaler():
    table = torch.ones(4)

    def scale(x):
        return x * table
    return scale


class ClosureScaled(nn.Module):
    """Calls a function that reads a tensor of its closure."""

    def __init__(self, trainable=False):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = _scaler()

    def forward(self, x):
        return self.scale(self.lin(x))


def test_a_tensor_in_a_closure_is_read_as_it_is_at_each_call():
    torch.manual_seed(0)
    model = Model(ClosureScaled)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        assert torch.equal(model(x), reference(x))
        assert reference.block.scale is model.block.scale  # (deepcopy keeps functions: one closure)
        model.block.scale.__closure__[0].cell_contents.mul_(3.0)
        assert torch.equal(model(x), reference(x))
    finally:
        nnbridge.unbridge(model)
