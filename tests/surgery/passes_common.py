"""Seed passes (torch's ATen-IR guide, seeds/004) and the hand-written eager models they must equal."""

from __future__ import annotations

import copy

import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from nnbridge.graph.metadata import node_meta
from nnbridge.surgery.pass_targets import target_graphs
from utils import llama

aten = torch.ops.aten


def replace_add_with_mul(gm):
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == aten.add.Tensor:
            node.target = aten.mul.Tensor


def insert_relu_after_add(gm):
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == aten.add.Tensor:
            with gm.graph.inserting_after(node):
                new_relu_node = gm.graph.call_function(aten.relu.default, args=(node,))
                node.replace_all_uses_with(new_relu_node, delete_user_cb=lambda user: user is not new_relu_node)


class ReplaceAddWithMul(torch.fx.Transformer):
    def call_function(self, target, args, kwargs):
        if target != aten.add.Tensor:
            return super().call_function(target, args, kwargs)
        return super().call_function(aten.mul.Tensor, args, kwargs)


class ReplaceAddWithMulSub(torch.fx.Transformer):
    def call_function(self, target, args, kwargs):
        if target != aten.add.Tensor:
            return super().call_function(target, args, kwargs)
        x, y = args
        mul_res = super().call_function(aten.mul.Tensor, args, {})
        return super().call_function(aten.sub.Tensor, (mul_res, y), {})


class RemoveDetachPass(torch.fx.Transformer):
    def call_function(self, target, args, kwargs):
        if target not in (aten.detach.default, aten.detach_copy.default):
            return super().call_function(target, args, kwargs)
        assert len(args) == 1
        return args[0]


class ReluMulLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer whose residual adds are ``relu(residual * hidden)`` (relu after add, add -> mul)."""

    def forward(self, hidden_states, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        hidden_states = torch.relu(residual * hidden_states)
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return torch.relu(residual * hidden_states)


class MulLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer whose residual adds are ``residual * hidden``."""

    def forward(self, hidden_states, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        hidden_states = residual * hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual * hidden_states


class MulSubLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer whose residual adds ``x + y`` are ``x * y - y``."""

    def forward(self, hidden_states, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        hidden_states = residual * hidden_states - hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual * hidden_states - hidden_states


def models():
    """A tiny random Llama, an eager copy to hand-edit, and token ids ``(1, 8)``."""
    model = llama()
    torch.manual_seed(1)
    return model, copy.deepcopy(model), torch.randint(0, 100, (1, 8))


def hand_edited(eager, layer_class):
    """``eager`` with every decoder layer of class ``layer_class``."""
    for layer in eager.model.layers:
        layer.__class__ = layer_class
    return eager


def run_with_grads(call, model):
    """Logits of ``call()`` and every parameter's gradient of ``logits.sum()``."""
    model.zero_grad()
    with torch.enable_grad():
        logits = call().logits
        logits.sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_equal_runs(got, want):
    (logits, grads), (want_logits, want_grads) = got, want
    assert torch.equal(logits, want_logits)
    assert grads.keys() == want_grads.keys() and grads
    for name in grads:
        assert torch.equal(grads[name], want_grads[name]), name


def graph_at(target, path):
    """The compiled graph at NodePath ``path`` (the first extraction's) of a PatchableGraph or bridged model."""
    return next(graph for found, graph in target_graphs(target).graphs if found == path)


def node_names(graph):
    return [node_meta(node).name for node in graph.graph.nodes]
