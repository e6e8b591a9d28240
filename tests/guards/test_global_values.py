"""Module globals a graph bakes in: a plain value (``SCALE = 2.0``, a flag) or a tensor read by a
module's code. Changing one after bridging changes what eager code computes; before, the bridged
model kept running the old graph, silently. Now the code guard fails and the module is extracted
again (in-process), and the disk cache's code digest tells the values apart (across processes).
Every test compares with an untouched copy run eagerly (``torch.equal``)."""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import sys
import types

import pytest
import torch

import nnbridge
from nnbridge.guards.code_digest import code_digest
from nnbridge.inplace.bridging import bridge_of

SCALE = 2.0
NEGATE = False
WEIGHTS = torch.ones(3)
SHIFTS = [0.0, 0.5]
OPTIONS = {"relu": False}
_THIS = sys.modules[__name__]


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * SCALE * WEIGHTS + SHIFTS[1]
        if OPTIONS["relu"]:
            y = torch.relu(y)
        return -y if NEGATE else y


class Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Scaled()
        self.out = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


def _model() -> Outer:
    torch.manual_seed(0)
    return Outer().eval()


@pytest.fixture
def weights(monkeypatch):
    """A fresh global tensor, list and dict for the test (written in place by some tests)."""
    monkeypatch.setattr(_THIS, "WEIGHTS", torch.ones(3))
    monkeypatch.setattr(_THIS, "SHIFTS", [0.0, 0.5])
    monkeypatch.setattr(_THIS, "OPTIONS", {"relu": False})


CHANGES = {
    "float assigned": lambda monkeypatch: monkeypatch.setattr(_THIS, "SCALE", 3.0),
    "flag assigned": lambda monkeypatch: monkeypatch.setattr(_THIS, "NEGATE", True),
    "tensor assigned": lambda monkeypatch: monkeypatch.setattr(_THIS, "WEIGHTS", torch.full((3,), 0.5)),
    "tensor written in place": lambda monkeypatch: WEIGHTS.mul_(4),
    # global containers of plain values were not followed: the graphs kept the values, silently
    "list assigned": lambda monkeypatch: monkeypatch.setattr(_THIS, "SHIFTS", [0.0, 2.0]),
    "list written in place": lambda monkeypatch: SHIFTS.__setitem__(1, 3.0),
    "dict written in place": lambda monkeypatch: OPTIONS.__setitem__("relu", True),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_global_extracts_again_and_equals_eager(change, weights, monkeypatch):
    model = _model()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3)
    nnbridge.bridge(model, x)
    assert torch.equal(model(x), reference(x))
    CHANGES[change](monkeypatch)
    got, expected = model(x), reference(x)
    assert torch.equal(got, expected)
    extractions = bridge_of(model).dispatcher.all_extractions()
    assert len(extractions) == 2
    name = {"float assigned": "SCALE", "flag assigned": "NEGATE", "dict written in place": "OPTIONS"}.get(
        change, "SHIFTS" if change.startswith("list") else "WEIGHTS")
    assert name in extractions[-1].reason
    if change.endswith("written in place"):
        assert "written in place" in extractions[-1].reason
    assert torch.equal(model(x), reference(x)) and len(bridge_of(model).dispatcher.all_extractions()) == 2
    nnbridge.unbridge(model)


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_code_digest_tells_changed_globals_apart(change, weights, monkeypatch):
    """What keys the disk cache: a changed global value is another digest, an unchanged one the same."""
    model = _model()
    before = code_digest(model)
    assert code_digest(model) == before
    CHANGES[change](monkeypatch)
    assert code_digest(model) != before


# -- objects of settings the code reads through a global: a SimpleNamespace, a dataclass, an
# instance of the script's own class, a class's own attributes, a context variable ---------------
@dataclasses.dataclass
class Settings:
    scale: float = 1.0


class Switches:
    """Read as a class: ``Switches.ablate``."""
    ablate = False


class State:
    def __init__(self) -> None:
        self.shift = 0.0


STATE = types.SimpleNamespace(enabled=False, factor=2.0)
SETTINGS = Settings()
OWN = State()
FACTOR = contextvars.ContextVar("FACTOR", default=1.0)


class Switched(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * SETTINGS.scale + OWN.shift
        if STATE.enabled:
            y = y * STATE.factor
        if Switches.ablate:
            y = torch.zeros_like(y)
        return y * FACTOR.get()


SWITCHES = {
    "SimpleNamespace attribute": (lambda monkeypatch: monkeypatch.setattr(STATE, "enabled", True), "STATE.enabled"),
    "dataclass field": (lambda monkeypatch: monkeypatch.setattr(SETTINGS, "scale", 3.0), "SETTINGS.scale"),
    "own class's instance attribute": (lambda monkeypatch: monkeypatch.setattr(OWN, "shift", 1.5), "OWN.shift"),
    "class attribute": (lambda monkeypatch: monkeypatch.setattr(Switches, "ablate", True), "Switches.ablate"),
    "context variable": (lambda monkeypatch: FACTOR.set(4.0), "FACTOR.get()"),
}


@pytest.fixture
def fresh_settings():
    token = FACTOR.set(1.0)
    yield
    FACTOR.reset(token)


@pytest.mark.parametrize("change", list(SWITCHES))
def test_a_switch_on_a_global_object_extracts_again_and_equals_eager(change, fresh_settings, monkeypatch):
    """Before, the graph kept the switch's value seen while extracting, silently."""
    torch.manual_seed(0)
    model, x = Switched(), torch.randn(2, 3)
    reference = copy.deepcopy(model)
    nnbridge.bridge(model, x)
    before = model(x)
    assert torch.equal(before, reference(x))
    digest = code_digest(model)
    flip, where = SWITCHES[change]
    flip(monkeypatch)
    expected = reference(x)
    assert not torch.equal(expected, before)
    assert torch.equal(model(x), expected)
    assert where in bridge_of(model).dispatcher.all_extractions()[-1].reason
    assert code_digest(model) != digest, "the disk cache's key tells the values apart"
    nnbridge.unbridge(model)
