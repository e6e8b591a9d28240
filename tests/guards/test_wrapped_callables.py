"""Code a module's forward reaches through a callable that is not a plain function: a global
wrapped by ``functools.lru_cache`` (a C object holding the function as ``__wrapped__``), and a
global instance of the script's own class called like a function (its ``__call__``). A graph
bakes in what that code computed; changing the code after bridging changes what eager computes.
Before, the code walk stopped at such values: the bridged model kept its old graph in-process and
the disk cache keyed two versions of the code alike. Every test compares with an untouched copy
run eagerly (``torch.equal``)."""

from __future__ import annotations

import copy
import functools
import sys

import pytest
import torch

import nnbridge
from nnbridge.guards.code_digest import code_digest

_THIS = sys.modules[__name__]


@functools.lru_cache(maxsize=None)
def factor(n: int) -> float:
    return n * 0.5


class Scale:
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


scale = Scale()


class Cached(torch.nn.Module):
    """Multiplies by a constant a cached helper computes (the graph bakes the constant in)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * factor(3)


class Called(torch.nn.Module):
    """Calls a global callable object."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale(self.lin(x))


def _held_factor(n: int) -> float:
    return n * 0.5


class Held(torch.nn.Module):
    """Holds a cached helper as an attribute (``self.factor = functools.lru_cache(f)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.factor = functools.lru_cache(maxsize=None)(_held_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.factor(3)


def _other_factor(n: int) -> float:
    return n * 0.25


def _other_call(self: Scale, x: torch.Tensor) -> torch.Tensor:
    return x * 3.0


CHANGES = {
    "lru_cache_global_replaced": (Cached, lambda mp: mp.setattr(_THIS, "factor", functools.lru_cache(_other_factor))),
    "lru_cache_code_replaced": (Cached, lambda mp: mp.setattr(factor.__wrapped__, "__code__", _other_factor.__code__)),
    "held_lru_cache_code_replaced": (Held, lambda mp: mp.setattr(_held_factor, "__code__", _other_factor.__code__)),
    "callable_object_method_replaced": (Called, lambda mp: mp.setattr(Scale, "__call__", _other_call)),
    "callable_object_replaced": (Called, lambda mp: mp.setattr(_THIS, "scale", type("Half", (), {
        "__call__": lambda self, x: x * 0.5})())),
}


@pytest.fixture(autouse=True)
def _fresh_cache():
    factor.cache_clear()
    yield
    factor.cache_clear()


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_changed_code_behind_a_callable_extracts_again_and_equals_eager(change, monkeypatch):
    kind, apply = CHANGES[change]
    torch.manual_seed(0)
    model = kind().eval()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 3)
    nnbridge.bridge(model, x)
    try:
        assert torch.equal(model(x), eager(x))
        apply(monkeypatch)
        factor.cache_clear()
        if isinstance(model, Held):
            model.factor.cache_clear()
            eager.factor.cache_clear()
        expected = eager(x)
        assert not torch.equal(expected, model.lin(x) * 1.5), "the change changes nothing eagerly"
        assert torch.equal(model(x), expected)
    finally:
        nnbridge.unbridge(model)


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_the_code_digest_tells_changed_code_behind_a_callable_apart(change, monkeypatch):
    kind, apply = CHANGES[change]
    model = kind()
    before = code_digest(model)
    apply(monkeypatch)
    assert code_digest(model) != before
