"""What every generated corpus program shares (``tests/corpus/generated.py`` renders the rest): the
plain objects a root reads in forward, the ``Inner`` child a block may call, and
:class:`ProgramRoot`, which gives a root its state before the rendered ``__init__`` adds the children."""

import numpy as np
import torch
from torch import nn


class HParams:
    """A plain object (not a dataclass, not a module) read in forward."""

    def __init__(self, scale=1.0, shift=0.0):
        self.scale = scale
        self.shift = shift
        self.inner = Nested()


class Nested:
    def __init__(self):
        self.bias = 0.5


class Swish:
    """A callable object (not a module)."""

    def __init__(self, beta=1.0):
        self.beta = beta

    def __call__(self, x):
        return x * torch.sigmoid(self.beta * x)


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, p, q):
        return self.proj(p) * torch.sigmoid(q)


class ProgramRoot(nn.Module):
    """A generated root's state: a Python float ``alpha``, a plain object ``hp``, a callable object
    ``act``, a numpy scalar ``k``, a Python counter ``calls`` and the buffers ``running`` (shape
    ``(4,)``) and ``steps`` (a long scalar). The rendered subclass adds the children ``c<i>``."""

    def __init__(self):
        super().__init__()
        self.alpha = 1.0
        self.hp = HParams()
        self.act = Swish(1.0)
        self.k = np.float32(1.0)
        self.calls = 0
        self.register_buffer("running", torch.zeros(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
