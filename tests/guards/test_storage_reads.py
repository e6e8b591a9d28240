"""A forward that reads where a tensor lies in memory runs eagerly.

A call structure holds each input's shape, strides, dtype, device and which inputs alias; it does
not hold a view's storage offset, its storage, or its version counter. Code branching on them
(``x.storage_offset() == 0``) keeps, in a graph, the branch of the extracted call. Each module
below branches so; called after bridging with an input on which the branch goes the other way,
it must equal eager, and ``nnbridge.explain`` names the cause.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nnbridge
from nnbridge import PatchableGraph
from utils import Outer

#: ``kind: (the branch, an input of shape (2, 4) on which it differs from a fresh tensor's)``
READS = {
    "storage_offset": (lambda x: x.storage_offset() == 0, lambda: torch.randn(3, 4)[1:]),
    "untyped_storage": (lambda x: x.untyped_storage().nbytes() == x.numel() * 4, lambda: torch.randn(3, 4)[1:]),
    "_version": (lambda x: x._version == 0, lambda: torch.randn(2, 4).add_(1)),
    "is_shared": (lambda x: not x.is_shared(), lambda: torch.randn(2, 4).share_memory_()),
}


class Branches(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x):
        y = self.lin(x)
        return y * 2 if READS[self.kind][0](x) else y * 3


@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
@pytest.mark.parametrize("kind", list(READS))
def test_a_forward_branching_on_where_a_tensor_lies_follows_eager(kind, front):
    torch.manual_seed(0)
    model = Outer(Branches(kind))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    run = nnbridge.bridge(model, x) if front == "bridge" else PatchableGraph(model, x)
    try:
        other = READS[kind][1]()
        assert READS[kind][0](x) != READS[kind][0](other)
        assert torch.equal(run(other), reference(other))
        explained = str(nnbridge.explain(run))
        assert "inner (Branches): opaque" in explained and "reads where a tensor lies in memory" in explained
        assert "out (Linear): graph" in explained
    finally:
        if front == "bridge":
            nnbridge.unbridge(model)


def test_a_view_passed_to_a_module_that_does_not_read_its_offset_stays_a_graph():
    torch.manual_seed(0)
    model = Outer(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    reference = copy.deepcopy(model)
    nnbridge.bridge(model, torch.randn(2, 4))
    try:
        view = torch.randn(3, 4)[1:]
        assert torch.equal(model(view), reference(view))
        assert not nnbridge.explain(model).opaque
    finally:
        nnbridge.unbridge(model)
