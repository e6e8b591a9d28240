"""Module globals written by a forward (``global CALLS; CALLS += 1``, ``STORE.append(x)``,
``TOTALS["n"] += 1``): eager code writes them on every call, a graph never does. Before, the
bridged model ran the writer's graph: the list stayed empty and a value computed from the counter
stayed the one seen while extracting, silently. Now the writer runs its own code (opaque, with the
reason), its parent stays a graph, and extraction's own runs leave the globals as they were. Every
test compares with an untouched copy run eagerly (``torch.equal``)."""

from __future__ import annotations

import types

import pytest
import torch

import nnbridge
from nnbridge.inplace.bridging import bridge_of

STORE: list[torch.Tensor] = []
CALLS = 0
TOTALS = {"calls": 0}
STATE = types.SimpleNamespace(calls=0)
ACC = torch.zeros(3)


class Flags:
    calls = 0


class Recorder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        STORE.append(y.detach())
        return y


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global CALLS
        CALLS += 1
        return self.lin(x) * CALLS


class Tally(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        TOTALS["calls"] += 1
        return self.lin(x) + TOTALS["calls"]


class Outer(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.out = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x)).relu()


class StateCounter(Counter):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        STATE.calls += 1
        return self.lin(x) * STATE.calls


class Accumulator(Counter):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ACC.add_(1.0)
        return self.lin(x) * ACC


class ClassCounter(Counter):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Flags.calls += 1
        return self.lin(x) * Flags.calls


WRITERS = {"list": Recorder, "global-statement": Counter, "dict": Tally, "object attribute": StateCounter,
           "class attribute": ClassCounter, "tensor in place": Accumulator}


def _reset() -> None:
    global CALLS
    STORE.clear()
    CALLS = 0
    TOTALS["calls"] = 0
    STATE.calls = 0
    Flags.calls = 0
    ACC.zero_()


def _written() -> tuple[int, int, int, int, int, float]:
    return len(STORE), CALLS, TOTALS["calls"], STATE.calls, Flags.calls, float(ACC.sum())


@pytest.fixture(autouse=True)
def _clean_globals():
    _reset()
    yield
    _reset()


@pytest.mark.parametrize("kind", list(WRITERS))
def test_a_module_writing_a_global_runs_its_own_code_and_equals_eager(kind):
    torch.manual_seed(0)
    x = torch.randn(2, 3)
    model, reference = Outer(WRITERS[kind]()), Outer(WRITERS[kind]())
    reference.load_state_dict(model.state_dict())
    nnbridge.bridge(model, x)
    assert _written() == (0, 0, 0, 0, 0, 0.0), "extraction's own runs and export leave the globals as they were"
    got = [model(x) for _ in range(3)]
    written = _written()
    stored = list(STORE)
    _reset()
    expected = [reference(x) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert written == _written()
    assert all(torch.equal(a, b) for a, b in zip(stored, STORE))
    # the root's code guard leaves out the globals the opaque writer reads: no re-extraction
    assert [str(e.reason) for e in bridge_of(model).dispatcher.history] == ["first call"]
    explained = str(nnbridge.explain(model))
    assert "(a value read through a module global or an object a module holds), a Python side effect a graph does not repeat" in explained
    assert "inner (" in explained and "opaque" in explained
    assert "out (Linear): graph" in explained, "only the writer runs its own code"


def test_gradients_through_a_global_writer_equal_eager():
    torch.manual_seed(0)
    x = torch.randn(2, 3)
    model, reference = Outer(Counter()), Outer(Counter())
    reference.load_state_dict(model.state_dict())
    nnbridge.bridge(model, x)
    model(x)
    model(x).sum().backward()  # computed with CALLS == 2
    _reset()
    reference(x)
    reference(x).sum().backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_a_patchable_graph_and_an_nnsight_trace_repeat_the_write():
    torch.manual_seed(0)
    x = torch.randn(2, 3)
    model, reference = Outer(Recorder()), Outer(Recorder())
    reference.load_state_dict(model.state_dict())
    pg = nnbridge.PatchableGraph(model, x)
    assert len(STORE) == 0
    assert torch.equal(pg(x), reference(x))
    assert len(STORE) == 2  # one call each
    wrapped = nnbridge.NNsight(Outer(Recorder()))
    wrapped._module.load_state_dict(model.state_dict())
    _reset()
    with wrapped.trace(x):
        out = wrapped.output.save()
    assert len(STORE) == 1
    assert torch.equal(out, reference(x))


class CountsThenCalls(torch.nn.Module):
    """Writes a global before calling a child that writes none: the write is its own."""

    def __init__(self) -> None:
        super().__init__()
        self.child = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        TOTALS["calls"] += 1
        return self.child(x) * TOTALS["calls"]


def test_a_write_before_a_child_call_is_the_callers():
    torch.manual_seed(0)
    x = torch.randn(2, 3)
    model, reference = Outer(CountsThenCalls()), Outer(CountsThenCalls())
    reference.load_state_dict(model.state_dict())
    nnbridge.bridge(model, x)
    got = [model(x) for _ in range(3)]
    _reset()
    expected = [reference(x) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert "inner (" in str(nnbridge.explain(model)) and "TOTALS" in str(nnbridge.explain(model))
