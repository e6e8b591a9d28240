"""A pattern spanning an MLP's module calls in every layer of a tiny Llama (gate and up projections
fused into one linear), against a hand-written MLP."""

import copy

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaMLP

import nnbridge
from nnbridge import surgery
from passes_common import assert_equal_runs, run_with_grads
from utils import llama


def gated_mlp(x, gate: torch.nn.Linear, up: torch.nn.Linear, down: torch.nn.Linear, act: torch.nn.Module):
    return down(act(gate(x)) * up(x))


def fused_gate_up(x, gate, up, down, act):
    hidden = F.linear(x, torch.cat([gate.weight, up.weight]))
    g, u = hidden.chunk(2, dim=-1)
    return down(act(g) * u)


class FusedMLP(LlamaMLP):
    def forward(self, x):
        return fused_gate_up(x, self.gate_proj, self.up_proj, self.down_proj, self.act_fn)


def test_gate_and_up_projections_are_fused_in_every_layer():
    model = llama()
    eager = copy.deepcopy(model)
    for layer in eager.model.layers:
        layer.mlp.__class__ = FusedMLP
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(3))
    nnbridge.bridge(model, ids, use_cache=False)
    rewrite = surgery.replace_pattern(model, gated_mlp, fused_gate_up, scope="model.layers_*.mlp")
    assert rewrite.matches == ["model.layers_0.mlp.down_proj", "model.layers_1.mlp.down_proj"]
    want = run_with_grads(lambda: eager(ids, use_cache=False), eager)
    assert_equal_runs(run_with_grads(lambda: model(ids, use_cache=False), model), want)
    rewrite.remove()
