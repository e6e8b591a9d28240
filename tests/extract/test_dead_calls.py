"""Submodule calls whose outputs the caller drops (dead calls) keep their graphs and run as in eager.

``outputs = self.c(x); return outputs[1]`` with ``c`` calling one linear per output: export removed
the other calls, and unflatten then failed on the signature it still listed for them.
"""

import copy

import pytest
import torch
from torch import nn

from nnbridge import ExtractionOptions, PatchableGraph, RecordPatch


class Fan(nn.Module):
    """Calls one linear three times, returning every result."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y):
        return [self.lin(x), (self.lin(x + y), self.lin(y * 3))]


class UsesMiddle(nn.Module):
    """Uses only the second of ``fan``'s outputs; the first and third calls are dead."""

    def __init__(self):
        super().__init__()
        self.fan = Fan()
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        outputs = self.fan(x, x * 2)
        outputs[0] = self.out(outputs[1][0])  # written into a list nobody reads: a dead call of `out`
        return outputs[1][0] + 1


class UsesLast(nn.Module):
    """Uses only the last output: the first call of the linear is dead."""

    def __init__(self):
        super().__init__()
        self.fan = Fan()

    def forward(self, x):
        return self.fan(x, x)[1][1]


class Nested(nn.Module):
    """Three distinct callers of the pattern, in a ModuleList (graphpatch's deeply nested fixture)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([UsesMiddle() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _made(cls):
    torch.manual_seed(0)
    return cls()


MODES = {"compiled": {}, "opaque": {"skip_compilation": True}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("cls", [UsesMiddle, UsesLast, Nested])
def test_dead_calls_run_as_in_eager(cls, mode):
    x = torch.randn(3, 4)
    eager = _made(cls)
    pg = PatchableGraph(_made(cls), x, options=ExtractionOptions(error_on_compilation_failure=True, **MODES[mode]))
    assert torch.equal(pg(x), eager(x))
    x2 = torch.randn(3, 4)
    assert torch.equal(pg(x2), eager(x2))


def test_dead_calls_keep_their_graphs_and_patch_points():
    x = torch.randn(3, 4)
    eager = _made(UsesMiddle)
    seen = []
    eager.fan.lin.register_forward_hook(lambda _m, _a, out: seen.append(out.detach().clone()))
    eager.out.register_forward_hook(lambda _m, _a, out: seen.append(out.detach().clone()))
    expected = eager(x)
    pg = PatchableGraph(_made(UsesMiddle), x, options=ExtractionOptions(error_on_compilation_failure=True))
    paths = ["fan.lin_0.output", "fan.lin_1.output", "fan.lin_2.output", "out.output"]
    records = {path: RecordPatch() for path in paths}
    with pg.patch({path: [patch] for path, patch in records.items()}):
        result = pg(x)
    assert torch.equal(result, expected)
    assert len(seen) == len(paths)
    for path, value in zip(paths, seen):
        assert torch.equal(records[path].activations[0], value), path


def test_a_patch_on_a_dead_call_leaves_the_output_unchanged():
    x = torch.randn(3, 4)
    expected = _made(UsesMiddle)(x)
    pg = PatchableGraph(_made(UsesMiddle), x)
    with pg.patch({"fan.lin_0.output": [RecordPatch()]}):
        assert torch.equal(pg(copy.copy(x)), expected)
