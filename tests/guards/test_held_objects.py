"""Objects a module holds and its forward reads are guarded by what the code reads (issue 48, item 2).

A module may hold an instance of any class: a plain class of the script (``self.hp = HParams()``),
a callable object (``self.act = Swish(beta=1.0)``), a numpy scalar, an object with ``__slots__``,
objects nested in objects. Its forward reads their attributes (``self.hp.scale``,
``self.nested.inner.shift``, ``self.act.beta`` inside ``Swish.__call__``, a class attribute of
the object's class). After the first call, each edit below changes eager's output; every
front-end (PatchableGraph, the in-place bridge, an nnsight trace that reads an op) must follow
eager, compared by ``torch.equal``: the guard of an extraction covers whatever attribute its code
reads, whatever the object's type.
"""

from __future__ import annotations

import copy
import numpy as np
import pytest
import torch
from torch import nn

import nnbridge
from nnbridge.guards.code_digest import code_digest
from utils import front_ends


class HParams:
    offset = 0.0  # a class attribute read through the instance

    def __init__(self, scale=1.0):
        self.scale = scale


class Swish:
    """A callable object that is not a module."""

    def __init__(self, beta):
        self.beta = beta

    def __call__(self, x):
        return x * torch.sigmoid(self.beta * x)


class Inner:
    def __init__(self):
        self.shift = 0.25


class Nested:
    def __init__(self):
        self.inner = Inner()


class Slotted:
    __slots__ = ("gain",)

    def __init__(self, gain):
        self.gain = gain


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.hp = HParams()
        self.act = Swish(1.0)
        self.k = np.float32(1.0)
        self.nested = Nested()
        self.slotted = Slotted(1.0)

    def forward(self, x):
        y = self.lin(x) * self.hp.scale + self.hp.offset + self.nested.inner.shift
        return self.act(y) * float(self.k) * self.slotted.gain + getattr(self.nested, "bias", 0.0)


def _holder():
    torch.manual_seed(0)
    return Holder().eval()


EDITS = {
    "object_attribute_written": lambda m: setattr(m.hp, "scale", 2.0),
    "object_replaced": lambda m: setattr(m, "hp", HParams(scale=4.0)),
    "callable_object_attribute_written": lambda m: setattr(m.act, "beta", 3.0),
    "callable_object_replaced": lambda m: setattr(m, "act", Swish(5.0)),
    "numpy_scalar_replaced": lambda m: setattr(m, "k", np.float32(2.0)),
    "nested_object_attribute_written": lambda m: setattr(m.nested.inner, "shift", -1.0),
    "nested_object_replaced": lambda m: setattr(m.nested, "inner", Inner().__class__()) or setattr(m.nested.inner, "shift", 3.0),
    "slot_written": lambda m: setattr(m.slotted, "gain", 0.5),
    "instance_shadows_class_attribute": lambda m: setattr(m.hp, "offset", 1.5),
    "attribute_read_by_getattr_added": lambda m: setattr(m.nested, "bias", 1.0),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_edits_of_held_objects_after_extraction_are_honoured(edit):
    x = torch.randn(3, 4)
    for name, run, target, reference in front_ends(_holder, x, op="lin"):
        before = run(x)
        assert torch.equal(before, reference(x)), name
        EDITS[edit](target)
        EDITS[edit](reference)
        assert not torch.equal(reference(x), before), "the edit changes eager's output"
        assert torch.equal(run(x), reference(x)), f"{name}: edit ignored"


def test_a_class_attribute_of_a_held_objects_class_is_guarded(monkeypatch):
    x = torch.randn(3, 4)
    for name, run, target, reference in front_ends(_holder, x):
        before = run(x)
        with monkeypatch.context() as patched:
            patched.setattr(HParams, "offset", 2.0)
            assert not torch.equal(reference(x), before)
            assert torch.equal(run(x), reference(x)), f"{name}: class attribute ignored"


def test_unchanged_held_objects_reuse_the_extraction():
    model = _holder()
    x = torch.randn(3, 4)
    nnbridge.bridge(model, x)
    try:
        from nnbridge.inplace.bridging import bridge_of
        for _ in range(3):
            model(x)
        model.hp.scale = 2.0
        model(x)
        model(x)
        history = [e.reason for e in bridge_of(model).dispatcher.history]
    finally:
        nnbridge.unbridge(model)
    assert len(history) == 2, history
    assert "hp.scale" in history[1], history


def test_the_disk_cache_key_follows_held_objects():
    """A model whose held object has another value must not load the other's program."""
    first, second = _holder(), _holder()
    assert code_digest(first) == code_digest(second)
    second.hp.scale = 3.0
    assert code_digest(first) != code_digest(second)
    second.hp.scale = 1.0
    second.k = np.float32(5.0)
    assert code_digest(first) != code_digest(second)


class ScaledBlock(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.hp = HParams(scale)

    def forward(self, x):
        return self.lin(x) * self.hp.scale


class ScaledBlocks(nn.Module):
    """Identical blocks but for the objects they hold: layer reuse must not serve one block's
    baked-in ``hp.scale`` to another."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ScaledBlock(s) for s in (1.0, 2.0, 1.0)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no_reuse"])
def test_siblings_holding_other_objects_equal_eager_and_follow_edits(reuse):
    torch.manual_seed(0)
    model = ScaledBlocks()
    x = torch.randn(3, 4)
    expected = model(x)
    nnbridge.bridge(model, x, options=nnbridge.ExtractionOptions(reuse_layers=reuse))
    try:
        assert torch.equal(model(x), expected)
        model.blocks[2].hp.scale = 5.0
        actual = model(x)
    finally:
        nnbridge.unbridge(model)
    assert torch.equal(actual, model(x))


class Stats:
    def __init__(self):
        self.calls = 0


class SlottedStats:
    __slots__ = ("calls",)

    def __init__(self):
        self.calls = 0


class Counting(nn.Module):
    """A forward that writes an attribute of an object it holds: a side effect a graph does not repeat."""

    def __init__(self, stats=Stats):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.stats = stats()

    def forward(self, x):
        self.stats.calls += 1
        return self.lin(x) * self.stats.calls


@pytest.mark.parametrize("stats", [Stats, SlottedStats], ids=["dict", "slots"])
def test_a_forward_writing_a_held_objects_attribute_runs_eagerly(stats):
    torch.manual_seed(0)
    model, reference = Counting(stats), Counting(stats)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 4)
    nnbridge.bridge(model)
    try:
        assert model.stats.calls == 0, "extraction's runs leave the object as it was"
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
        assert model.stats.calls == reference.stats.calls == 3
        explained = str(nnbridge.explain(model))
    finally:
        nnbridge.unbridge(model)
    assert "writes <root>.stats.calls in forward" in explained


class Steering:
    """A plain object holding a tensor (a steering vector, an SAE's decoder row) that the forward reads."""

    def __init__(self, vector):
        self.vector = vector


class Steered(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.steering = Steering(torch.ones(4))

    def forward(self, x):
        return self.lin(x) + self.steering.vector


def _steered():
    torch.manual_seed(0)
    return Steered().eval()


TENSOR_EDITS = {
    "written_in_place": lambda m: m.steering.vector.mul_(3.0),
    "replaced": lambda m: setattr(m.steering, "vector", torch.full((4,), 5.0)),
}


@pytest.mark.parametrize("edit", list(TENSOR_EDITS))
def test_a_tensor_a_held_object_holds_is_guarded_by_identity_and_version(edit):
    """export bakes ``self.steering.vector`` into the graph as a constant; before, an in-place write
    or a new tensor kept the extracted values, silently."""
    x = torch.randn(3, 4)
    for name, run, target, reference in front_ends(_steered, x, op="lin"):
        before = run(x)
        assert torch.equal(before, reference(x)), name
        TENSOR_EDITS[edit](target)
        TENSOR_EDITS[edit](reference)
        assert not torch.equal(reference(x), before), "the edit changes eager's output"
        assert torch.equal(run(x), reference(x)), f"{name}: edit ignored"


def test_the_disk_cache_key_follows_a_held_objects_tensor_values():
    first, second = _steered(), _steered()
    assert code_digest(first) == code_digest(second)
    second.steering.vector[2] = 7.0
    assert code_digest(first) != code_digest(second)


class SteeredBlock(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.steering = Steering(torch.full((4,), value))

    def forward(self, x):
        return self.lin(x) * self.steering.vector


class SteeredBlocks(nn.Module):
    def __init__(self, shared=False):
        super().__init__()
        self.blocks = nn.ModuleList([SteeredBlock(v) for v in (1.0, 2.0, 3.0)])
        if shared:  # one object held by every block
            for block in self.blocks:
                block.steering = self.blocks[0].steering

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared"])
@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no_reuse"])
def test_siblings_holding_tensors_equal_eager_and_follow_writes(reuse, shared):
    torch.manual_seed(0)
    model = SteeredBlocks(shared)
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    nnbridge.bridge(model, x, options=nnbridge.ExtractionOptions(reuse_layers=reuse))
    edits = [lambda m: None, lambda m: m.blocks[1].steering.vector.add_(1.0),
             lambda m: setattr(m.blocks[2].steering, "vector", torch.full((4,), 7.0))]
    try:
        for edit in edits:
            edit(model)
            edit(reference)
            assert torch.equal(model(x), reference(x))
    finally:
        nnbridge.unbridge(model)


class Accumulating(nn.Module):
    """A forward that writes a tensor of an object it holds in place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.steering = Steering(torch.zeros(4))

    def forward(self, x):
        self.steering.vector.add_(1.0)
        return self.lin(x) * self.steering.vector


def test_a_forward_writing_a_held_objects_tensor_runs_eagerly_and_extraction_leaves_it_as_it_was():
    torch.manual_seed(0)
    model, reference = Accumulating(), Accumulating()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        assert torch.equal(model.steering.vector, torch.zeros(4)), "extraction's runs put the values back"
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
        assert torch.equal(model.steering.vector, reference.steering.vector)
        explained = str(nnbridge.explain(model))
    finally:
        nnbridge.unbridge(model)
    assert "writes <root>.steering.vector in forward" in explained


class TrainedSteering(nn.Module):
    """A trained steering vector held by a plain object (not a parameter of any module)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.steering = Steering(torch.ones(4, requires_grad=True))

    def forward(self, x):
        return self.lin(x) * self.steering.vector


class Trains(nn.Module):
    def __init__(self):
        super().__init__()
        self.steered = TrainedSteering()
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        return self.out(self.steered(x))


def test_a_held_tensor_requiring_grad_gets_eagers_gradient_in_every_step():
    """export lifts a held object's tensor as a detached constant: before, its gradient was None."""
    torch.manual_seed(0)
    model = Trains()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        for _ in range(3):
            for net in (model, reference):
                net(x).sum().backward()
                vector = net.steered.steering.vector
                with torch.no_grad():
                    vector -= 0.1 * vector.grad
                vector.grad = None
            assert torch.equal(model.steered.steering.vector, reference.steered.steering.vector)
            assert torch.equal(model(x), reference(x))
        explained = str(nnbridge.explain(model))
    finally:
        nnbridge.unbridge(model)
    assert "reads the tensor 'steered.steering.vector', which requires grad" in explained
    assert "out (Linear): graph" in explained
