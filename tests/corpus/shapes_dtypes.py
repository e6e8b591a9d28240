"""Issue 9 items 6 and 9: dtype changes and autocast after bridging; shape-dependent code."""

from __future__ import annotations

import torch
from torch import nn

from . import Call, Edit, Entry, calls


class ParityBranch(nn.Module):
    """Item 9: Python control flow on a shape (extracted at length 8, called at 7)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if x.shape[1] % 2:
            return h.flip(1)
        return h * 2


class ShapeArithmetic(nn.Module):
    """Item 9: a Python number computed from a shape (a scale and a padded length)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x) / (x.shape[1] ** 0.5)
        pad = (4 - x.shape[1] % 4) % 4
        return torch.nn.functional.pad(h, (0, 0, 0, pad))


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)
        self.register_buffer("shift", torch.full((4,), 0.5))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) + self.shift


class DtypeBranch(nn.Module):
    """Item 6: code that reads the input dtype."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.dtype == torch.float64:
            return h * 10
        return h


def _double(m):
    m.double()


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


ENTRIES = [
    Entry("shape_parity_branch", ParityBranch,
          calls(lambda: (torch.randn(2, 8, 4),), lambda: (torch.randn(2, 7, 4),), lambda: (torch.randn(2, 8, 4),)),
          item=9),
    Entry("shape_arithmetic", ShapeArithmetic,
          calls(lambda: (torch.randn(2, 8, 4),), lambda: (torch.randn(2, 7, 4),)), item=9),
    Entry("batch_size_one_then_three", Plain,
          calls(lambda: (torch.randn(1, 4),), lambda: (torch.randn(3, 4),)), item=9),
    Entry("double_after_bridging", Plain,
          calls(lambda: (torch.randn(2, 4),), Edit(_double), lambda: (torch.randn(2, 4, dtype=torch.float64),)),
          item=6),
    Entry("double_dtype_branch", DtypeBranch,
          calls(lambda: (torch.randn(2, 4),), Edit(_double), lambda: (torch.randn(2, 4, dtype=torch.float64),)),
          item=6),
    Entry("autocast_call", Plain,
          calls(lambda: (torch.randn(2, 4),), lambda: Call((torch.randn(2, 4),), context=_autocast)), item=6),
]
