"""A forward that keeps state nnbridge cannot read or put back (``next`` of an ``itertools.count``,
of a Python generator) makes extraction raise, naming the module (see
:mod:`nnbridge.extract.repeat_check`), and leaves the model as it was.

Before, a graph kept the value one of extraction's runs drew (``x * next(self.counter)`` ran as
``x * 3`` for ever), silently."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
from torch import nn

import nnbridge
from nnbridge import ExtractionError, PatchableGraph
from nnbridge.extract import repeat_check
from nnbridge.extract.repeat_check import certain, differing_module, fingerprint, same_fingerprint, same_tensor
from nnbridge.inplace.bridging import bridge_of
from utils import Outer


class Counted(nn.Module):
    """Scales by the next number of an ``itertools.count``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.counter = itertools.count(1)

    def forward(self, x):
        return self.lin(x) * next(self.counter)


def _numbers():
    n = 0
    while True:
        n += 1
        yield n


class Generated(nn.Module):
    """Scales by the next number of a Python generator."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.numbers = _numbers()

    def forward(self, x):
        return self.lin(x) * next(self.numbers)


class CountedBeforeChild(nn.Module):
    """Scales its child's input by the next count: the child's input differs, its own code does not."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.counter = itertools.count(1)

    def forward(self, x):
        return self.lin(x * next(self.counter))


class CountedOnWideCalls(nn.Module):
    """Counts only on calls with more than two rows."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.counter = itertools.count(1)

    def forward(self, x):
        h = self.lin(x)
        return h * next(self.counter) if x.shape[0] > 2 else h


class Stepped(nn.Module):
    """Counts in a plain attribute, which nnbridge reads and puts back."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.step = 0

    def forward(self, x):
        self.step += 1
        return self.lin(x) * self.step


def _untouched(model):
    return {name: (dict(module._forward_hooks), dict(module._forward_pre_hooks), "forward" in module.__dict__)
            for name, module in model.named_modules()}


@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
@pytest.mark.parametrize("inner", [Counted, Generated])
def test_state_out_of_reach_raises_naming_the_module(inner, front):
    torch.manual_seed(0)
    model = Outer(inner())
    before = _untouched(model)
    x = torch.randn(2, 4)
    with pytest.raises(ExtractionError, match=rf"'inner' \({inner.__name__}\) gives other outputs on two runs .*"
                                              r"Keep the state in an attribute of the module"):
        nnbridge.bridge(model, x) if front == "bridge" else PatchableGraph(model, x)
    assert bridge_of(model) is None
    assert _untouched(model) == before


def test_the_module_whose_code_computed_the_difference_is_named():
    model = Outer(CountedBeforeChild())
    with pytest.raises(ExtractionError, match=r"'inner' \(CountedBeforeChild\) gives other outputs"):
        nnbridge.bridge(model, torch.randn(2, 4))


def test_the_root_is_named():
    with pytest.raises(ExtractionError, match=r"'<root>' \(Counted\) gives other outputs"):
        nnbridge.bridge(Counted(), torch.randn(2, 4))


def test_a_later_call_structure_raises_and_the_model_stays_bridged():
    torch.manual_seed(0)
    model = Outer(CountedOnWideCalls())
    reference = copy.deepcopy(model)
    narrow, wide = torch.randn(2, 4), torch.randn(3, 4)
    nnbridge.bridge(model, narrow)
    try:
        with pytest.raises(ExtractionError, match=r"'inner' \(CountedOnWideCalls\) gives other outputs"):
            model(wide)
        assert bridge_of(model) is not None
        assert torch.equal(model(narrow), reference(narrow))
    finally:
        nnbridge.unbridge(model)


def test_state_nnbridge_puts_back_is_bridged_and_equals_eager():
    torch.manual_seed(0)
    model = Outer(Stepped())
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
    finally:
        nnbridge.unbridge(model)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_bridging_draws_nothing_from_torch_rngs_and_warns_nothing(device):
    """Extraction's runs put the CPU's and every CUDA device's RNG back, so the repeat check sees
    the same dropout masks, and the first call after ``bridge()`` draws what eager code draws."""
    torch.manual_seed(0)
    model = Outer(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))).to(device).train()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4, device=device)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", nnbridge.NNBridgeWarning)
        nnbridge.bridge(model, x)
    try:
        bridged = model(x)
        torch.manual_seed(1)
        assert torch.equal(bridged, reference(x))
    finally:
        nnbridge.unbridge(model)


def test_dropout_in_train_mode_is_bridged_and_equals_eager():
    torch.manual_seed(0)
    model = Outer(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))).train()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        for seed in range(3):
            torch.manual_seed(seed)
            expected = reference(x)
            torch.manual_seed(seed)
            assert torch.equal(model(x), expected)
        assert not nnbridge.explain(model).opaque
    finally:
        nnbridge.unbridge(model)


def _same(first, second):
    return same_fingerprint(fingerprint(first), fingerprint(second))


def test_fingerprints_of_cpu_tensors_compare_their_bytes():
    t = torch.tensor([1.0, float("nan"), -2.5])
    assert _same(t, t.clone())  # NaN equals NaN
    assert _same(t, torch.tensor([[1.0, float("nan"), -2.5]])[0])
    assert _same(t[::2], torch.tensor([1.0, -2.5]))  # a strided view: its values
    assert _same(torch.ones(2, requires_grad=True), torch.ones(2))
    assert _same(torch.zeros(0), torch.zeros(0))
    assert not _same(t, torch.tensor([1.0 + 1e-7, float("nan"), -2.5]))  # exact
    assert not _same(t, t.double())
    assert not _same(t, t[:2])
    assert not _same(torch.ones(2, 3), torch.ones(3, 2))
    assert not _same(torch.tensor([1, 2]), torch.tensor([1, 3]))
    assert not _same(torch.tensor([1 + 2j]), torch.tensor([1 + 2j]).conj())  # (a conjugate view: its values)
    assert not _same(t, 1.0)


def test_fingerprints_of_python_values():
    assert _same((1, "a", None, float("nan")), (1, "a", None, float("nan")))
    assert not _same(1, 1.0)  # (a type a graph would keep)
    assert not _same("a", "b")
    assert not _same({"n": 3}, {"n": 4})
    assert not _same((torch.ones(2),), [torch.ones(2)])  # another structure
    assert _same(object(), object())  # not compared


def test_tensors_off_the_cpu_compare_within_a_tolerance():
    t = torch.ones(4)
    assert same_tensor(t, t + 1e-7, exact=False)
    assert not same_tensor(t, t + 1e-7, exact=True)
    assert not same_tensor(t, t * 2, exact=False)
    assert same_tensor(torch.tensor([float("nan")]), torch.tensor([float("nan")]), exact=False)
    assert not same_tensor(torch.tensor([1, 2]), torch.tensor([1, 3]), exact=False)
    assert not same_tensor(t, t.double(), exact=False)
    meta = torch.empty(2, device="meta")
    assert same_tensor(meta, torch.empty(2, device="meta"), exact=False)  # no comparison runs on meta tensors
    assert _same(meta, torch.empty(2, device="meta"))
    assert not _same(meta, torch.empty(3, device="meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fingerprints_of_cuda_tensors_compare_within_a_tolerance():
    t = torch.ones(4, device="cuda")
    assert _same(t, t + 1e-7)
    assert not _same(t, t * 2)
    assert not certain(fingerprint(t))


class Marked(torch.Tensor):
    """A tensor subclass (held as a copy, not read as bytes)."""


def test_a_difference_is_certain_on_the_cpu_or_under_deterministic_algorithms():
    assert certain(fingerprint((torch.ones(2), 3)))
    assert certain(fingerprint(torch.ones(2).as_subclass(Marked)))  # a copy, compared exactly on the CPU
    assert not _same(torch.ones(2).as_subclass(Marked), (torch.ones(2) + 1e-7).as_subclass(Marked))
    meta = fingerprint(torch.empty(2, device="meta"))
    assert not certain(meta)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert certain(meta)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def test_an_uncertain_difference_warns_naming_the_module(monkeypatch):
    """Off the CPU a difference may come from the kernels: a warning with the same message."""
    monkeypatch.setattr(repeat_check, "certain", lambda printed: False)
    model = Outer(Counted())
    with pytest.warns(nnbridge.NNBridgeWarning, match=r"'inner' \(Counted\) gives other outputs .*under"
                                                     r" torch.use_deterministic_algorithms\(True\) this is an error"):
        nnbridge.bridge(model, torch.randn(2, 4))
    assert bridge_of(model) is not None
    nnbridge.unbridge(model)


def test_differing_module():
    a, b = fingerprint(torch.zeros(1)), fingerprint(torch.ones(1))
    run = [("enter", "", a), ("enter", "x", a), ("leave", "x", a), ("enter", "y", a), ("leave", "y", a),
           ("leave", "", a)]

    def changed(index, value=b):
        return [event if i != index else (event[0], event[1], value) for i, event in enumerate(run)]
    assert differing_module(run, changed(2)) == "x"  # x's own output
    assert differing_module(run, changed(3)) == ""  # y's input: the root's code computed it
    assert differing_module(run, changed(5)) == ""
    assert differing_module(run, run) == ""
    assert differing_module(run, [*run[:3], ("enter", "z", a), *run[4:]]) == ""  # another callee


class Layer(nn.Module):
    def __init__(self, inner=None):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inner = inner

    def forward(self, x):
        h = torch.relu(self.lin(x))
        return self.inner(h) if self.inner is not None else h


class Stack(nn.Module):
    """Identical layers (layer reuse records their calls: that run is the check's second)."""

    def __init__(self, *inners):
        super().__init__()
        self.layers = nn.ModuleList(Layer(inner) for inner in inners)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class GradScaled(nn.Module):
    """Doubles its output under grad mode."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x):
        h = self.act(self.lin(x))
        return h * 2 if torch.is_grad_enabled() else h


def _runs_of_its_own(monkeypatch):
    from nnbridge.extract import repeat_check
    runs = []
    run = repeat_check.observed_run
    monkeypatch.setattr(repeat_check, "observed_run", lambda *a, **k: runs.append(1) or run(*a, **k))
    return runs


def test_the_recording_run_is_the_second_run(monkeypatch):
    runs = _runs_of_its_own(monkeypatch)
    model = Stack(None, None)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    nnbridge.unbridge(model)
    assert runs == []  # no run of the check's own
    with pytest.raises(ExtractionError, match=r"'layers.0.inner' \(Counted\) gives other outputs"):
        nnbridge.bridge(Stack(Counted(), Counted()), x)
    assert runs == [1, 1]  # the two runs naming the module, none to compare
    runs.clear()
    nnbridge.bridge(Outer(nn.Linear(4, 4)), x)  # nothing recorded: the check runs the call itself
    assert runs == [1]


@pytest.mark.parametrize("grad", [True, False])
def test_a_forward_reading_grad_mode_is_run_again_under_its_grad_mode(grad, monkeypatch):
    """The recording run (made here for the ReLU run eagerly) is made without grad: under grad mode,
    a forward that reads grad mode gets a run of the check's own (comparing the recording run's
    output would raise)."""
    runs = _runs_of_its_own(monkeypatch)
    torch.manual_seed(0)
    model = Outer(GradScaled())
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    with torch.set_grad_enabled(grad):
        nnbridge.bridge(model, x, options=nnbridge.ExtractionOptions(classes_to_skip_compiling={nn.ReLU}))
        try:
            assert torch.equal(model(x), reference(x))
        finally:
            nnbridge.unbridge(model)
    assert runs == ([1] if grad else [])


class RunsOut(nn.Module):
    """Scales by the next of two numbers: a third run raises StopIteration."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.numbers = iter([1.0, 2.0])

    def forward(self, x):
        return self.lin(x) * next(self.numbers)


def test_a_run_naming_the_module_that_raises_names_the_call():
    with pytest.raises(ExtractionError, match=r"'<root>' \(Outer\) gives other outputs .* \(A further run to name"
                                              r" the module raised StopIteration\.\)") as raised:
        nnbridge.bridge(Outer(RunsOut()), torch.randn(2, 4))
    assert isinstance(raised.value.__cause__, StopIteration)
