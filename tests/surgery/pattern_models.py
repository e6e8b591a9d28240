"""Seed 003's models for the pattern tests, the patterns and replacements, and hand-written
eager models with the same rewrites."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class CustomLinear(torch.nn.Module):
    """Seed 003's custom linear (no bias)."""

    def __init__(self, size, out=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out or size, size) / size ** 0.5)

    def forward(self, x):
        return F.linear(x, self.weight)


class Block(torch.nn.Module):
    """``ln(l1(l0(x)) + x)``: the seed's residual block with a LayerNorm; ``leak=True`` also adds
    ``l0``'s output to the result (so ``l0``'s value has a user outside ``l1(l0(x))``)."""

    def __init__(self, size=8, leak=False):
        super().__init__()
        self.l0, self.l1 = CustomLinear(size), CustomLinear(size)
        self.ln = torch.nn.LayerNorm(size)
        self.leak = leak

    def forward(self, x):
        h = self.l0(x)
        y = self.l1(h) + x
        if self.leak:
            y = y * h
        return self.ln(y)


class Model(torch.nn.Module):
    def __init__(self, layers=3, size=8, leak_at=None):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([Block(size, leak=i == leak_at) for i in range(layers)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def pattern(x, l0: CustomLinear, l1: CustomLinear):
    return l1(l0(x))


def fused(x, l0, l1):
    return F.linear(x, l1.weight @ l0.weight)


class FusedBlock(Block):
    """Hand-written: ``l1(l0(x))`` is one linear by ``l1.weight @ l0.weight`` (unless leaking)."""

    def forward(self, x):
        if self.leak:
            return super().forward(x)
        return self.ln(F.linear(x, self.l1.weight @ self.l0.weight) + x)


def layer_norm_pattern(x, ln: torch.nn.LayerNorm):
    return ln(x)


def rms_norm(x, ln):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ln.eps) * ln.weight


class RmsBlock(Block):
    """Hand-written: the LayerNorm call is :func:`rms_norm` of its weight."""

    def forward(self, x):
        return rms_norm(self.l1(self.l0(x)) + x, self.ln)


def hand_edited(model, block_class):
    edited = copy.deepcopy(model)
    for block in edited.blocks:
        block.__class__ = block_class
    return edited


@dataclass
class Config:
    """Seed 003's config: ``mlp`` steers the forward's control flow."""

    mlp: bool
    size: int


class ConfigModel(torch.nn.Module):
    """Seed 003's ``CustomModel`` (the dead-code example): ``forward_pattern`` branches on the config."""

    def __init__(self, config: Config):
        super().__init__()
        if config.mlp:
            self.up_proj = CustomLinear(config.size, config.size * 3)
            self.down_proj = CustomLinear(config.size * 3, config.size)
        else:
            self.proj = CustomLinear(config.size)
        self.config = config

    def forward(self, x):
        mlp = self.config.mlp
        return ConfigModel.forward_pattern(x, self.config, self.up_proj if mlp else self.proj,
                                           self.down_proj if mlp else None)

    @staticmethod
    def forward_pattern(x, config: Config, proj, down_proj):
        residual = x
        if config.mlp:
            x = down_proj(proj(x))
        else:
            x = proj(x)
        return x + residual


class ConfigStack(torch.nn.Module):
    def __init__(self, config: Config, layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([ConfigModel(config) for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def source_pattern(x, config: Config, proj: CustomLinear, down_proj: CustomLinear):
    return ConfigModel.forward_pattern(x, config, proj, down_proj)


def doubled_residual(x, proj):
    return proj(x) * 2 + x


def run_with_grads(model, x):
    """Output and every parameter's gradient of ``output.sum()``."""
    model.zero_grad()
    out = model(x)
    out.sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_run(got, want):
    (out, grads), (want_out, want_grads) = got, want
    assert torch.equal(out, want_out)
    assert grads.keys() == want_grads.keys() and grads
    for name in grads:
        assert torch.equal(grads[name], want_grads[name]), name


class LoraAdapter(torch.nn.Module):
    """peft's LoRA on a linear layer: ``base(x) + B(A(x))``, rank 2; ``base`` is the model's own
    layer (shared, not copied)."""

    def __init__(self, base, rank=2):
        super().__init__()
        self.base = base
        self.lora_a = torch.nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = torch.nn.Linear(rank, base.out_features, bias=False)
        torch.nn.init.normal_(self.lora_b.weight)  # peft starts B at zero; non-zero so the adapter shows

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class ProjBlock(torch.nn.Module):
    """``x + o(relu(q(x)))`` with built-in linears."""

    def __init__(self, size=8):
        super().__init__()
        self.q, self.o = torch.nn.Linear(size, size), torch.nn.Linear(size, size)

    def forward(self, x):
        return x + self.o(torch.relu(self.q(x)))


class ProjModel(torch.nn.Module):
    """A linear embedding, then :class:`ProjBlock` layers."""

    def __init__(self, layers=2, size=8):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(size, size)
        self.blocks = torch.nn.ModuleList([ProjBlock(size) for _ in range(layers)])

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x


def linear_pattern(x, base: torch.nn.Linear):
    return base(x)


def with_adapters(model, adapters):
    """Hand-written: ``model`` (an eager copy) with each ``{torch path of a linear: adapter}``'s
    copy wrapping its linear, the adapters' own weights copied."""
    edited = copy.deepcopy(model)
    for path, adapter in adapters.items():
        parent, _, name = path.rpartition(".")
        holder = edited.get_submodule(parent)
        wrapper = LoraAdapter(getattr(holder, name), rank=adapter.lora_a.out_features)
        wrapper.lora_a.load_state_dict(adapter.lora_a.state_dict())
        wrapper.lora_b.load_state_dict(adapter.lora_b.state_dict())
        setattr(holder, name, wrapper)
    return edited


class TwoOutputBlock(torch.nn.Module):
    """``h = tanh(x)``; ``a = h * 2`` and ``b = h + 1`` both used after; ``leak=True`` also uses
    ``h`` itself after (so ``h``, inside the pattern's match, leaks)."""

    def __init__(self, size=8, leak=False):
        super().__init__()
        self.proj = CustomLinear(size)
        self.leak = leak

    def forward(self, x):
        h = torch.tanh(x)
        a, b = h * 2, h + 1
        y = self.proj(a) + torch.sin(b)
        return y * h if self.leak else y


class TwoOutputModel(torch.nn.Module):
    def __init__(self, layers=3, size=8, leak_at=None):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([TwoOutputBlock(size, leak=i == leak_at) for i in range(layers)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def two_outputs(x):
    h = torch.tanh(x)
    return h * 2, h + 1


def two_replaced(x):
    h = torch.sigmoid(x)
    return h * 3, h - 1


class TwoReplacedBlock(TwoOutputBlock):
    """Hand-written: :func:`two_outputs` replaced by :func:`two_replaced` (unless leaking)."""

    def forward(self, x):
        if self.leak:
            return super().forward(x)
        a, b = two_replaced(x)
        return self.proj(a) + torch.sin(b)
