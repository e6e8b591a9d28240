"""Objects held by a global object the code reads (``CFG.sub.scale``), followed as the objects a
module holds are (:mod:`nnbridge.guards.held_objects`): through the attribute names the code
reads. A graph bakes in ``CFG.sub.scale``; writing a new value there, or giving ``CFG`` a new
``sub``, changes what eager code computes. Before, only the global object's own plain attributes
counted, so the bridged model kept its old graph and the disk cache keyed both alike. Every test
compares with an untouched copy run eagerly (``torch.equal``)."""

from __future__ import annotations

import copy

import pytest
import torch

import nnbridge
from nnbridge.guards.code_digest import code_digest


class Sub:
    def __init__(self, scale: float) -> None:
        self.scale = scale


class Settings:
    def __init__(self) -> None:
        self.sub = Sub(2.0)


CFG = Settings()


class Nested(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * CFG.sub.scale


CHANGES = {
    "nested_value_written": lambda mp: mp.setattr(CFG.sub, "scale", 3.0),
    "nested_object_replaced": lambda mp: mp.setattr(CFG, "sub", Sub(0.5)),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_object_under_a_global_extracts_again_and_equals_eager(change, monkeypatch):
    torch.manual_seed(0)
    model = Nested().eval()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 3)
    nnbridge.bridge(model, x)
    try:
        assert torch.equal(model(x), eager(x))
        before = eager(x)
        CHANGES[change](monkeypatch)
        expected = eager(x)
        assert not torch.equal(expected, before), "the change changes nothing eagerly"
        assert torch.equal(model(x), expected)
    finally:
        nnbridge.unbridge(model)


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_the_code_digest_tells_a_changed_object_under_a_global_apart(change, monkeypatch):
    model = Nested()
    before = code_digest(model)
    CHANGES[change](monkeypatch)
    assert code_digest(model) != before
