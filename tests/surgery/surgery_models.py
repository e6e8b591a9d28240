"""Modules the surgery tests insert, and hand-written eager models with the same changes."""

import copy

import torch
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaMLP

from utils import llama


class SAE(torch.nn.Module):
    """Tiny sparse autoencoder, width 64 -> 32 -> 64: Linear, ReLU, Linear."""

    def __init__(self, width=64, hidden=32):
        super().__init__()
        torch.manual_seed(1)
        self.enc = torch.nn.Linear(width, hidden)
        self.dec = torch.nn.Linear(hidden, width)

    def forward(self, x):
        return self.dec(torch.relu(self.enc(x)))


class HeadGate(torch.nn.Module):
    """Scales each attention head's weights: ``(batch, heads, q, k) * g[heads]``."""

    def __init__(self, heads=4):
        super().__init__()
        self.g = torch.nn.Parameter(torch.linspace(0.5, 1.5, heads))

    def forward(self, weights):
        return weights * self.g.view(1, -1, 1, 1)


class MLPWithSAE(LlamaMLP):
    """Hand-written: the MLP's forward ends in its ``sae``."""

    def forward(self, x):
        return self.sae(super().forward(x))


def sae_reference(sae):
    """A fresh tiny Llama whose layer 1 MLP ends in a copy of ``sae``."""
    model = llama()
    mlp = model.model.layers[1].mlp
    mlp.__class__ = MLPWithSAE
    mlp.sae = copy.deepcopy(sae)
    return model


def gated_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention with ``module.head_gate`` (when set) applied after the softmax."""
    key_states = modeling_llama.repeat_kv(key, module.num_key_value_groups)
    value_states = modeling_llama.repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32)
    if "head_gate" in module._modules:
        attn_weights = module.head_gate(attn_weights)
    attn_weights = attn_weights.to(query.dtype)
    attn_weights = torch.nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


def grads(model):
    return {name: p.grad for name, p in model.named_parameters()}


def assert_grads_equal(model, reference):
    mine, theirs = grads(model), grads(reference)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert (mine[name] is None) == (theirs[name] is None), name
        if mine[name] is not None:
            assert torch.equal(mine[name], theirs[name]), name
