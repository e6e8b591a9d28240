"""``module.__class__ = Other`` on a model nnbridge.NNsight wraps: every run calls the module's
current class's forward, as eager does (nnsight 0.8.1 keeps the forward it found when it wrapped
the module: ``nnbridge.compat.nnsight.source.follow_classes``)."""

from __future__ import annotations

import nnsight
import pytest
import torch
from torch import nn

import nnbridge
from nnbridge.compat.nnsight.source import NNSIGHT_STATE


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


class Doubled(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


class Unrelated(nn.Module):  # not a Block: same attributes, other code
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sigmoid()


class Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # a Python side effect: the root runs its own code (opaque)
        return self.block(x) + x


def _models() -> tuple[Root, Root]:
    torch.manual_seed(0)
    model = Root()
    eager = Root()
    eager.load_state_dict(model.state_dict())
    return model, eager


def _traced(wrapped: nnsight.NNsight, x: torch.Tensor) -> torch.Tensor:
    with wrapped.trace(x):
        out = wrapped.output.save()
    return out


X = torch.randn(3, 4)


@pytest.mark.parametrize("graphs", [False, True], ids=["module-only", "graphs"])
def test_each_run_calls_the_current_class_as_eager_does(graphs: bool) -> None:
    model, eager = _models()
    wrapped = nnbridge.NNsight(model)
    wrapped.eager_module_traces = not graphs
    assert torch.equal(_traced(wrapped, X), eager(X))
    for cls in (Doubled, Unrelated, Block):  # a subclass, an unrelated class, and back
        model.block.__class__ = eager.block.__class__ = cls
        assert torch.equal(model.block(X), eager.block(X)), cls.__name__  # a direct call, before any run
        assert torch.equal(model(X), eager(X)), cls.__name__  # the model's own call, outside nnsight
        assert torch.equal(_traced(wrapped, X), eager(X)), cls.__name__
    model.block.__class__ = eager.block.__class__ = Doubled
    assert torch.equal(wrapped(X), eager(X))  # the wrapper's plain call


def test_plain_nnsight_keeps_the_old_class() -> None:
    """What nnbridge.NNsight departs from: plain nnsight 0.8.1 runs the class's forward it found."""
    model, eager = _models()
    wrapped = nnsight.NNsight(model)
    model.block.__class__ = eager.block.__class__ = Doubled
    assert not torch.equal(_traced(wrapped, X), eager(X)), "plain nnsight follows class swaps now"


def test_an_instance_forward_the_user_set_is_kept() -> None:
    """A module whose forward was set on the instance runs it whatever its class, in eager as
    through nnbridge.NNsight."""
    model, eager = _models()
    for m in (model, eager):
        m.block.forward = lambda x, m=m: m.block.lin(x) - 1.0
    wrapped = nnbridge.NNsight(model)
    model.block.__class__ = eager.block.__class__ = Doubled
    assert torch.equal(_traced(wrapped, X), eager(X))


def test_a_class_swap_after_source_is_refused_naming_the_module() -> None:
    """nnsight's ``.source`` instruments the class's code once: after a class swap it would keep
    running the old code, so the next run raises, naming the module and both classes, and leaves
    nnsight's body as it was."""
    model, _ = _models()
    wrapped = nnbridge.NNsight(model)
    with wrapped.trace(X):
        out = wrapped.block.source.self_lin_0.output.save()
    assert out.shape == (3, 4)
    state = model.block.__dict__[NNSIGHT_STATE]
    body = state.body
    model.block.__class__ = Doubled
    with pytest.raises(nnbridge.NNBridgeError, match=r"'model\.block'.*from Block to Doubled.*\.source"):
        _traced(wrapped, X)
    assert state.body is body and state.sourced
