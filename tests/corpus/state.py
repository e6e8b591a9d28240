"""Issue 9 items 7 and 8, and buffer kinds: state a forward changes."""

from __future__ import annotations

import torch
from torch import nn

from . import Entry, calls


def _x():
    return torch.randn(3, 4)


class EMA(nn.Module):
    """Item 7: a buffer re-assigned (not mutated) in forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        h = self.fc(x)
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        return h - self.ema


class InPlaceBuffer(nn.Module):
    """A buffer updated in place in forward (a step counter and a running sum)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        h = self.fc(x)
        self.steps.add_(1)
        self.total.add_(h.detach().sum(0))
        return h * self.steps


class TrainBatchNorm(nn.Module):
    """Item 8: BatchNorm1d in train mode updates running stats on every call, and only then."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4, momentum=None)  # cumulative average: num_batches_tracked matters

    def forward(self, x):
        return self.bn(self.fc(x))


class NonPersistent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.arange(1.0, 5.0), persistent=False)

    def forward(self, x):
        return self.fc(x) * self.scale


class FrozenParams(nn.Module):
    """Some parameters do not require grad (a frozen backbone)."""

    def __init__(self):
        super().__init__()
        self.backbone, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
        self.backbone.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.relu(self.backbone(x)))


ENTRIES = [
    Entry("ema_buffer", EMA, calls(lambda: (_x(),), lambda: (_x(),)), item=7),
    Entry("inplace_buffer_update", InPlaceBuffer, calls(lambda: (_x(),), lambda: (_x(),))),
    Entry("train_batchnorm", TrainBatchNorm, calls(lambda: (_x(),), lambda: (_x(),)), item=8),
    Entry("non_persistent_buffer", NonPersistent, calls(lambda: (_x(),))),
    Entry("frozen_parameters", FrozenParams, calls(lambda: (_x(),))),
]
