"""Issue 48 item 3b: an opaque module calling a child through ``self.child.forward(...)``
(peft's ``return self.model.forward(...)``) has that child extracted, and patches and op-point
hooks on the child's nodes apply, as a torch hook on the module that runs the op does in eager
code. (An nnsight op read extracts the child alone, lazily, and was served before.)
"""

from __future__ import annotations

import copy

import torch

import nnbridge
from nnbridge import PatchableGraph
from nnbridge.patching.patches import RecordPatch, ZeroPatch


class Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.lin2 = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.lin(x).relu())


class Wrapper(torch.nn.Module):
    """Opaque (a branch on data) and calls its child's ``forward`` directly."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.model.forward(x) * 2
        return self.model.forward(x)


def _pair() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Wrapper()
    return model, copy.deepcopy(model), torch.randn(2, 4).abs()


def _zeroed(ref: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Eager output with ``model.lin``'s output zeroed by a torch hook."""
    handle = ref.model.lin.register_forward_hook(lambda mod, args, out: torch.zeros_like(out))
    try:
        return ref(x)
    finally:
        handle.remove()


def test_patches_on_a_child_called_through_forward_apply() -> None:
    model, ref, x = _pair()
    pg = PatchableGraph(model, x)
    assert torch.equal(pg(x), ref(x))
    record = RecordPatch()
    with pg.patch({"model.lin.linear": ZeroPatch(), "model.lin2.linear": record}):
        patched = pg(x)
    expected = _zeroed(ref, x)
    assert not torch.equal(expected, ref(x))
    assert torch.equal(patched, expected)
    assert len(record.activations) == 1
    assert torch.equal(record.activations[0], ref.model.lin2(torch.zeros(2, 4)))
    assert torch.equal(pg(x), ref(x))  # and nothing stays patched


def test_bridged_op_point_hooks_on_a_child_called_through_forward() -> None:
    model, ref, x = _pair()
    fired: list[str] = []
    for m in (model, ref):  # not called through __call__: its own hooks fire in neither
        m.model.register_forward_hook(lambda mod, args, out: fired.append("model"))
    nnbridge.bridge(model, x)
    assert torch.equal(model(x), ref(x))
    point = model.get_submodule("model.lin.linear")
    handle = point.register_forward_hook(lambda mod, args, out: torch.zeros_like(out))
    try:
        assert torch.equal(model(x), _zeroed(ref, x))
    finally:
        handle.remove()
    assert fired == []
