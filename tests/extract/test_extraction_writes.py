"""Issue 48 item 3: extraction's own eager runs leave no trace of writes through ``.data``.

A forward that, while ``self.merged`` is set, moves a weight through ``.data`` and clears the flag
(peft's LoRA layer unmerging under ``disable_adapter()``) must leave the weight and the flag as
they were after ``bridge()``, ``PatchableGraph()`` and the warm-up of an nnsight op-read trace,
and every later call must equal the untouched model's (``torch.equal``).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import nnbridge
from nnbridge.compat.torch.tensor_data import data_accesses, raw_data


class Unmerging(torch.nn.Module):
    """``self.lin.weight.data -= self.delta`` (or ``.data = ...``) once, while ``merged``."""

    def __init__(self, assign: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.delta = torch.full((4, 4), 0.5)
        self.merged = True
        self.assign = assign

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            if self.assign:
                self.lin.weight.data = self.lin.weight.data - self.delta
            else:
                self.lin.weight.data -= self.delta
            self.merged = False
        return self.lin(x)


class UnmergingBufferFlag(torch.nn.Module):
    """As :class:`Unmerging`, with the flag in a buffer (``self.merged.fill_(False)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.delta = torch.full((4, 4), 0.5)
        self.register_buffer("merged", torch.tensor(True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            self.lin.weight.data -= self.delta
            self.merged.fill_(False)
        return self.lin(x)


def _pair(cls: type[torch.nn.Module], **kwargs: bool) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = cls(**kwargs)
    return model, copy.deepcopy(model), torch.randn(2, 4)


def _same_state(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    for (name, value), (_, expected) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(value, expected), name
    assert bool(model.merged) == bool(ref.merged)


@pytest.mark.parametrize("assign", [False, True], ids=["in-place", "assigned"])
def test_bridge_leaves_data_writes_undone(assign: bool) -> None:
    model, ref, x = _pair(Unmerging, assign=assign)
    nnbridge.bridge(model, x)
    _same_state(model, ref)  # no user call yet: nothing moved
    for _ in range(2):
        assert torch.equal(model(x), ref(x))
        _same_state(model, ref)


@pytest.mark.parametrize("assign", [False, True], ids=["in-place", "assigned"])
def test_patchable_graph_leaves_data_writes_undone(assign: bool) -> None:
    model, ref, x = _pair(Unmerging, assign=assign)
    pg = nnbridge.PatchableGraph(model, x)
    _same_state(model, ref)
    for _ in range(2):
        assert torch.equal(pg(x), ref(x))
        _same_state(model, ref)


def test_op_read_trace_leaves_data_writes_undone() -> None:
    # (with the flag in an attribute, the warm-up left flag and weight both changed, consistently)
    model, ref, x = _pair(UnmergingBufferFlag)
    wrapped = nnbridge.NNsight(model)
    with wrapped.trace(x):
        linear = wrapped.lin.linear.output.save()
        out = wrapped.output.save()
    expected = ref(x)
    assert torch.equal(out, expected)
    assert torch.equal(linear, expected)
    _same_state(model, ref)
    with wrapped.trace(x):
        out = wrapped.output.save()
    assert torch.equal(out, ref(x))
    _same_state(model, ref)


def test_data_accesses_reports_only_its_thread_and_is_removed_after() -> None:
    seen: list[torch.Tensor] = []
    other: list[torch.Tensor] = []
    weight = torch.nn.Parameter(torch.ones(3))

    def elsewhere() -> None:
        weight.data  # noqa: B018 - a read in another thread is not reported
    with data_accesses(seen.append):
        with data_accesses(other.append):
            weight.data += 1
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        raw_data(weight)  # nnbridge's own read is not reported
    # ``weight.data += 1`` reads ``.data``, then assigns it: both are reported, to both watchers
    assert [id(t) for t in seen] == [id(weight)] * 2 and [id(t) for t in other] == [id(weight)] * 2
    assert "data" not in vars(torch.Tensor)
    assert torch.equal(weight, torch.full((3,), 2.0))
