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
        self.vector = torch.ones(4)  # a tensor held by a plain object (a steering vector)


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


class Gather(nn.Module):
    """Appends its projection to the list it is passed (as code collecting activations does) and
    returns half its input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, acts):
        acts.append(self.lin(x))
        return x * 0.5


class ProgramRoot(nn.Module):
    """A generated root's state: a Python float ``alpha``, a plain object ``hp``, a callable object
    ``act``, a numpy scalar ``k``, a numpy array ``arr``, a Python counter ``calls``, the buffers ``running`` (shape
    ``(4,)``) and ``steps`` (a long scalar), and ``outside``, a ``Linear`` kept out of the registry
    in a plain list (as a sparse autoencoder kept out of ``state_dict``), and the child ``gather``
    (:class:`Gather`, which writes into a list it is passed). The rendered subclass adds the
    children ``c<i>``."""

    def __init__(self):
        super().__init__()
        self.alpha = 1.0
        self.hp = HParams()
        self.act = Swish(1.0)
        self.k = np.float32(1.0)
        self.arr = np.ones(1)
        self.calls = 0
        self.register_buffer("running", torch.zeros(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.outside = [nn.Linear(4, 4).requires_grad_(False)]
        self.gather = Gather()


#: what a :class:`CachedLayer` reads back from its cache layer (a generated program picks one)
CACHED_KINDS = ("attend", "values", "length", "index", "first")


class CachedLayer(nn.Module):
    """A decoder-layer-like block called with a transformers ``Cache`` (``forward(x, cache)``,
    ``x`` of shape ``(rows, 4)``): it writes its keys and values, ``(1, 1, rows, 4)`` each, into
    its own cache layer (``cache.update(k, v, self.layer_idx)``, as transformers' attention does)
    and reads what the layer holds back. ``kind`` (one of :data:`CACHED_KINDS`) picks how:
    ``"attend"``, attention of ``x`` over every cached position; ``"values"``, the cached values'
    mean; ``"length"``, the number of cached positions (an int read off the cache); ``"index"``,
    the values' mean and ``layer_idx`` in arithmetic; ``"first"``, the keys of another layer's
    cache (layer 0's, once it holds any: a branch on the cache's state). Keys and values are
    cached detached, so a later call reads them without the earlier call's autograd graph."""

    def __init__(self, layer_idx, kind="attend"):
        super().__init__()
        self.layer_idx = layer_idx
        self.kind = kind
        self.k = nn.Linear(4, 4)
        self.v = nn.Linear(4, 4)
        self.o = nn.Linear(4, 4)

    def forward(self, x, cache):
        keys, values = cache.update(self.k(x).detach()[None, None], self.v(x).detach()[None, None], self.layer_idx)
        out = self.o(x)
        if self.kind == "attend":
            return out + torch.softmax(x @ keys[0, 0].transpose(0, 1), -1) @ values[0, 0]
        if self.kind == "values":
            return out + values[0, 0].mean(0)
        if self.kind == "length":
            return out * cache.get_seq_length(self.layer_idx)
        if self.kind == "first":
            first = cache.layers[0]
            return out + first.keys[0, 0].mean(0) if first.is_initialized else out
        return out * (self.layer_idx + 1) + values[0, 0].mean(0)


def new_cache(layers, sliding=False):
    """A transformers ``DynamicCache`` with ``layers`` cache layers; ``sliding``: every other one
    (the first included) a sliding-window layer of window 2, as Gemma 3 alternates them."""
    from transformers import DynamicCache, PretrainedConfig

    extra = {}
    if sliding:
        extra = {"layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                 "sliding_window": 2}
    return DynamicCache(config=PretrainedConfig(num_hidden_layers=layers, **extra))
