"""Ordinary modules: what every model is made of."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import Call, Entry, calls


def x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class Tied(nn.Module):
    """Embedding and output head share one weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


class CalledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.fc(x)))


class ListLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class DictRoute(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 3)})

    def forward(self, x, which: str = "a"):
        return self.heads[which](x)


class KwargsOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, **kwargs):
        out = self.fc(kwargs["x"])
        if "bias" in kwargs:
            out = out + kwargs["bias"]
        return out


class VarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, *xs):
        return self.fc(sum(xs))


class TupleDictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h, {"mean": h.mean(-1), "parts": [h[:, :2], h[:, 2:]]}


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


class FunctionalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return F.dropout(self.fc(x), 0.3, training=self.training) + F.dropout(x, 0.3, training=self.training)


class RandInForward(nn.Module):
    """Draws from the global generator directly (noise injection)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) + 0.1 * torch.randn_like(x) + torch.rand(()) 


class SoftmaxAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(4, 12)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / 2.0
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


class MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True, dropout=0.1)

    def forward(self, x):
        out, weights = self.attn(x, x, x, need_weights=True)
        return out, weights


class IntArg(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, repeat: int):
        for _ in range(repeat):
            x = torch.sin(self.fc(x))
        return x


class OptionalNone(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask=None, scale: float = 1.0):
        out = self.fc(x) * scale
        if mask is not None:
            out = out.masked_fill(mask, 0.0)
        return out


class Sequential(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.Sigmoid())


class IntOutputs(nn.Module):
    """Non-float outputs: argmax, topk indices, a bool mask, a Python int."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        h = self.fc(x)
        values, idx = h.topk(2, dim=-1)
        return values, idx, h.argmax(-1), h > 0, h.shape[-1]


class EmbeddingBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(16, 4))

    def forward(self, ids):
        h = self.emb(ids) + self.pos[: ids.shape[1]]
        return h.cumsum(1)


ENTRIES = [
    Entry("mlp", MLP, calls(lambda: (x(2, 4),))),
    Entry("residual_layernorm", Residual, calls(lambda: (x(2, 3, 4),))),
    Entry("tied_weights", Tied, calls(lambda: (torch.randint(0, 10, (2, 5)),))),
    Entry("called_twice", CalledTwice, calls(lambda: (x(2, 4),))),
    Entry("modulelist_loop", ListLoop, calls(lambda: (x(2, 4),))),
    Entry("moduledict", DictRoute, calls(lambda: Call((x(2, 4),), {"which": "b"}),
                                         lambda: Call((x(2, 4),), {"which": "a"}))),
    Entry("kwargs_only", KwargsOnly, calls(lambda: Call(kwargs={"x": x(2, 4)}),
                                           lambda: Call(kwargs={"x": x(2, 4), "bias": x(4)}))),
    Entry("varargs", VarArgs, calls(lambda: (x(2, 4), x(2, 4)), lambda: (x(2, 4), x(2, 4)))),
    Entry("tuple_dict_output", TupleDictOut, calls(lambda: (x(2, 4),))),
    Entry("conv_batchnorm", ConvBN, calls(lambda: (x(2, 2, 5, 5),), lambda: (x(2, 2, 5, 5),))),
    Entry("dropout", DropoutNet, calls(lambda: (x(2, 4),), lambda: (x(2, 4),))),
    Entry("functional_dropout", FunctionalDropout, calls(lambda: (x(2, 4),))),
    Entry("rand_in_forward", RandInForward, calls(lambda: (x(2, 4),), lambda: (x(2, 4),))),
    Entry("softmax_attention", SoftmaxAttention, calls(lambda: (x(2, 5, 4),))),
    Entry("multihead_attention", MHA, calls(lambda: (x(2, 5, 8),))),
    Entry("int_argument", IntArg, calls(lambda: (x(2, 4), 2), lambda: (x(2, 4), 3))),
    Entry("optional_none", OptionalNone,
          calls(lambda: (x(2, 4),), lambda: Call((x(2, 4),), {"mask": torch.rand(2, 4) > 0.5, "scale": 2.0}))),
    # (ReLU(inplace=True) edits its input in place: eager refuses full backward hooks on it)
    Entry("sequential_inplace_relu", Sequential, calls(lambda: (x(2, 4),)), backward_hooks=False),
    Entry("int_outputs", IntOutputs, calls(lambda: (x(2, 4),))),
    Entry("embedding_positions", EmbeddingBag, calls(lambda: (torch.randint(0, 10, (2, 6)),))),
]
