"""Issue 9 item 11: Python side effects in forward must happen once per call, as in eager (the
harness compares each call's stdout too)."""

from __future__ import annotations

import torch
from torch import nn

from . import Entry, calls


class Logging(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.log: list[tuple[int, ...]] = []

    def forward(self, x):
        self.log.append(tuple(x.shape))
        return self.fc(x)


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x) * self.calls


class Cache(nn.Module):
    """Caches an activation on ``self`` (what activation-capture code does)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.last = None

    def forward(self, x):
        h = self.fc(x)
        self.last = h.detach()
        return h.relu()


class ChildCounter(nn.Module):
    """A counter in a child module called twice per forward."""

    def __init__(self):
        super().__init__()
        self.inner = Counter()

    def forward(self, x):
        return self.inner(self.inner(x))


class Printing(nn.Module):
    """Prints what it computes (a debugging print left in forward)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        print("h", tuple(h.shape), round(float(h.detach().sum()), 3))
        return h.relu()


def _x():
    return torch.randn(2, 4)


ENTRIES = [
    Entry("side_effect_list_append", Logging, calls(lambda: (_x(),), lambda: (torch.randn(3, 4),)), item=11,
          attrs=lambda m: list(m.log)),
    Entry("side_effect_counter", Counter, calls(lambda: (_x(),), lambda: (_x(),)), item=11,
          attrs=lambda m: m.calls),
    Entry("side_effect_cached_tensor", Cache, calls(lambda: (_x(),), lambda: (_x(),)), item=11,
          attrs=lambda m: m.last),
    Entry("side_effect_print", Printing, calls(lambda: (_x(),), lambda: (torch.randn(3, 4),)), item=11),
    Entry("side_effect_child_counter", ChildCounter, calls(lambda: (_x(),), lambda: (_x(),)), item=11,
          attrs=lambda m: m.inner.calls),
]
