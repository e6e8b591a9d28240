"""Forwards that read autograd state or process-wide torch state no call structure records, set a
tensor hook, or seed torch's RNG, run their own code (opaque, with the reason).

A graph keeps the Python branches its code took while it was extracted. Before, a forward reading
a parameter's ``.grad`` kept the branch of "no gradient yet" after every backward, one branching on
``x.is_leaf`` (or ``x.grad_fn``) kept the extracted argument's answer for every later argument, and
one calling ``torch.manual_seed`` drew new numbers on each call where eager drew the same ones: all
silently; a tensor hook set in forward (``h.register_hook(f)``, ``h.retain_grad()``) was never
registered by a graph, silently. Found from the interpreter's profiling events (``nnbridge.compat.torch.grad_reads``).
Every test compares with an untouched copy run eagerly (``torch.equal``)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import nnbridge
from nnbridge import PatchableGraph
from nnbridge.inplace.bridging import bridge_of
from utils import Outer


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


class GradSaver(nn.Module):
    """Keeps the gradient of its output as attention-attribution code does (a tensor hook set in
    forward, with no check of ``requires_grad``), or the output itself with ``retain_grad()``."""

    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how
        self.grads = []

    def forward(self, x):
        h = self.lin(x)
        if self.how == "register_hook":
            h.register_hook(lambda grad: self.grads.append(grad.clone()))
        else:
            h.retain_grad()
            self.grads.append(h)
        return h * 2.0


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


@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
@pytest.mark.parametrize("how", ["register_hook", "retain_grad"])
def test_a_tensor_hook_set_in_forward_sees_each_backward(how, front):
    """Before, a graph registered no hook: no gradient reached ``grads`` (silently); and the
    extraction's runs without grad raised on ``register_hook``/``retain_grad``."""
    torch.manual_seed(0)
    model = Outer(GradSaver(how))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    run = nnbridge.bridge(model, x) if front == "bridge" else PatchableGraph(model, x)
    saver = model.inner  # (a PatchableGraph's opaque module runs the model's own module)
    try:
        for net, inner in ((run, saver), (reference, reference.inner)):
            inner.grads.clear()
            for weight in (1.0, 3.0):
                (net(x) * weight).sum().backward()
        got, expected = saver.grads, reference.inner.grads
        if how == "retain_grad":
            got, expected = [h.grad for h in got], [h.grad for h in expected]
        assert len(got) == len(expected) == 2 and all(torch.equal(a, b) for a, b in zip(got, expected))
        explained = _explained(model if front == "bridge" else run)
    finally:
        if front == "bridge":
            nnbridge.unbridge(model)
    assert "inner (GradSaver): opaque" in explained and "sets a tensor hook" in explained


def test_extraction_without_grad_raises_as_eager_does_on_a_tensor_hook():
    """Under ``torch.no_grad()`` eager code cannot set the hook: the bridged model raises the same."""
    model = Outer(GradSaver("register_hook"))
    x = torch.randn(2, 4)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="cannot register a hook on a tensor that doesn't require gradient"):
            model(x)
        with pytest.raises(RuntimeError, match="cannot register a hook on a tensor that doesn't require gradient"):
            nnbridge.bridge(model, x)
    assert bridge_of(model) is None, "nothing is left half-bridged"


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


class StateReader(nn.Module):
    """Scales by process-wide torch state that no call structure records."""

    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how

    def forward(self, x):
        if self.how == "get_num_threads":
            scale = torch.get_num_threads()
        elif self.how == "initial_seed":
            scale = torch.initial_seed() % 7
        elif self.how == "get_float32_matmul_precision":
            scale = 2.0 if torch.get_float32_matmul_precision() == "highest" else 3.0
        else:
            scale = 2.0 if FLAGS[self.how][0]() else 3.0
        return self.lin(x) * scale


#: process-wide flags a forward may read, each ``(read, set)``
FLAGS = {
    "is_anomaly_enabled": (torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    "cudnn.enabled": (lambda: torch.backends.cudnn.enabled, lambda on: setattr(torch.backends.cudnn, "enabled", on)),
    "cuda.matmul.allow_tf32": (lambda: torch.backends.cuda.matmul.allow_tf32,
                               lambda on: setattr(torch.backends.cuda.matmul, "allow_tf32", on)),
    "mkldnn.enabled": (lambda: torch.backends.mkldnn.enabled, lambda on: setattr(torch.backends.mkldnn, "enabled", on)),
}


@contextlib.contextmanager
def _flipped_state():
    """Every process-wide value the tests below read set otherwise, and put back after."""
    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    flags = {how: read() for how, (read, _) in FLAGS.items()}
    try:
        torch.set_num_threads(2 if threads == 1 else 1)
        torch.set_float32_matmul_precision("high")
        torch.manual_seed(5)
        for how, (_, put) in FLAGS.items():
            put(not flags[how])
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(precision)
        for how, (_, put) in FLAGS.items():
            put(flags[how])


@pytest.mark.parametrize("how", ["get_num_threads", "initial_seed", "get_float32_matmul_precision", *FLAGS])
def test_a_forward_reading_process_wide_state_reads_it_on_each_call(how):
    """Before, a graph kept the thread count, seed, matmul precision or a flag (anomaly mode,
    ``torch.backends.cudnn.enabled``, ``torch.backends.cuda.matmul.allow_tf32``) read while it was
    extracted, silently."""
    torch.manual_seed(0)
    model = Outer(StateReader(how))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        with _flipped_state():
            assert torch.equal(model(x), reference(x))
        explained = _explained(model)
    finally:
        nnbridge.unbridge(model)
    assert "inner (StateReader): opaque" in explained and "reads process-wide torch state" in explained
    assert "out (Linear): graph" in explained


class Normed(nn.Module):
    """Batch norm as a module and as ``F.batch_norm``: torch's own code reads ``cudnn.enabled``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        y = self.norm(self.lin(x))
        return torch.nn.functional.batch_norm(y, self.norm.running_mean, self.norm.running_var, training=False)


def test_flags_read_by_torchs_own_code_leave_a_graph():
    torch.manual_seed(0)
    model = Outer(Normed()).eval()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        with _flipped_state():
            assert torch.equal(model(x), reference(x))
        assert not nnbridge.explain(model).opaque
    finally:
        nnbridge.unbridge(model)
