"""Issue 9 items 3 and 4: grad mode inside forward, custom autograd functions."""

from __future__ import annotations

import torch
from torch import nn

from . import Call, Entry, calls


class NoGradInside(nn.Module):
    """Item 3: a ``torch.no_grad()`` block inside forward (a frozen target branch)."""

    def __init__(self):
        super().__init__()
        self.online, self.target = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            target = self.target(x)
        return self.online(x) - target


class BranchOnGradEnabled(nn.Module):
    """Item 3: different code with and without grad (e.g. a checkpointing switch)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if torch.is_grad_enabled():
            return h * 2
        return h - 1


class BranchOnRequiresGrad(nn.Module):
    """Item 3: branch on the input's ``requires_grad``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.requires_grad:
            return self.fc(x) * 3
        return self.fc(x)


class RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class StraightThrough(nn.Module):
    """Item 4: a quantizer with a straight-through estimator (round has zero gradient)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.fc2(RoundSTE.apply(self.fc1(x)))


class ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class GradReversal(nn.Module):
    """Item 4: a gradient-reversal layer (identity forward, negated gradient)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(ScaleGrad.apply(self.fc1(x), 0.5))


class Detach(nn.Module):
    """A stop-gradient inside forward (``.detach()``), as in many RL and SSL losses."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h) + self.fc2(h.detach())


class BranchOnHiddenRequiresGrad(nn.Module):
    """A branch on a computed tensor's ``requires_grad``, read in a helper: True under grad mode,
    False under ``torch.no_grad()`` for the same call."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if _tracked(h):
            return h * 2
        return h - 1


def _tracked(t):
    return t.requires_grad


class BranchOnGradFn(nn.Module):
    """A branch on a computed tensor's ``grad_fn``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h * 3 if h.grad_fn is not None else h + 3


class EnableGradInside(nn.Module):
    """``torch.enable_grad()`` inside forward: a no-op under grad mode, a change under
    ``torch.no_grad()`` (the output then requires grad in eager code)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.enable_grad():
            return self.fc(x) * 2


def _x():
    return torch.randn(2, 4)


def _x_req():
    return torch.randn(2, 4).requires_grad_()


ENTRIES = [
    Entry("no_grad_inside_forward", NoGradInside, calls(lambda: (_x(),)), item=3),
    Entry("branch_is_grad_enabled", BranchOnGradEnabled,
          calls(lambda: (_x(),), lambda: Call((_x(),), grad=False), lambda: (_x(),)), item=3),
    Entry("branch_is_grad_enabled_nograd_first", BranchOnGradEnabled,
          calls(lambda: Call((_x(),), grad=False), lambda: (_x(),)), item=3),
    Entry("branch_requires_grad", BranchOnRequiresGrad, calls(lambda: (_x(),), lambda: (_x_req(),)), item=3),
    Entry("no_grad_inside_grad_then_no_grad", NoGradInside,
          calls(lambda: (_x(),), lambda: Call((_x(),), grad=False), lambda: (_x(),))),
    Entry("branch_hidden_requires_grad", BranchOnHiddenRequiresGrad,
          calls(lambda: (_x(),), lambda: Call((_x(),), grad=False), lambda: (_x(),))),
    Entry("branch_grad_fn", BranchOnGradFn, calls(lambda: (_x(),), lambda: Call((_x(),), grad=False))),
    Entry("enable_grad_inside_forward", EnableGradInside,
          calls(lambda: (_x(),), lambda: Call((_x(),), grad=False), lambda: (_x(),))),
    Entry("straight_through_estimator", StraightThrough, calls(lambda: (_x(),)), item=4),
    Entry("gradient_reversal", GradReversal, calls(lambda: (_x(),)), item=4),
    Entry("detach_inside_forward", Detach, calls(lambda: (_x(),))),
]
