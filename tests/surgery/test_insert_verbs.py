"""insert_before and replace_node against hand-written models: a module transforming an MLP's
input, and a transcoder replacing an MLP (outputs and every gradient equal)."""

import copy

import torch
from transformers.models.llama.modeling_llama import LlamaMLP

import nnbridge
from nnbridge import surgery
from surgery_models import SAE, assert_grads_equal
from utils import llama


class Transcoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x):
        return torch.tanh(self.proj(x))


class Redirected(LlamaMLP):
    """Hand-written: the MLP's call runs the layer's transcoder instead (the MLP's weights unused)."""

    def forward(self, x):
        return self.__dict__["instead"](x)


class Preceded(LlamaMLP):
    """Hand-written: the layer's ``pre`` transforms the MLP's input."""

    def forward(self, x):
        return super().forward(self.__dict__["pre"](x))


def ids():
    return torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(9))


def test_replace_node_equals_hand_written_model():
    model, reference = llama(), llama()
    x = ids()
    nnbridge.bridge(model, x)
    transcoder = Transcoder()
    edit = surgery.replace_node(model, "model.layers.1.mlp", transcoder)
    assert edit.node_path == "model.layers_1.transcoder"
    reference.model.layers[1].transcoder = copy.deepcopy(transcoder)
    reference.model.layers[1].mlp.__class__ = Redirected
    reference.model.layers[1].mlp.__dict__["instead"] = reference.model.layers[1].transcoder
    out, expected = model(x).logits, reference(x).logits
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_equal(model, reference)
    assert model.model.layers[1].mlp.down_proj.weight.grad is None
    edit.remove()
    nnbridge.unbridge(model)


def test_insert_before_equals_hand_written_model():
    model, reference = llama(), llama()
    x = ids()
    clean = model(x).logits
    nnbridge.bridge(model, x)
    pre = SAE()
    with surgery.insert_before(model, "model.layers_0.mlp", pre, name="pre") as edit:
        assert edit.node_path == "model.layers_0.pre"
        reference.model.layers[0].pre = copy.deepcopy(pre)
        reference.model.layers[0].mlp.__class__ = Preceded
        reference.model.layers[0].mlp.__dict__["pre"] = reference.model.layers[0].pre
        out, expected = model(x).logits, reference(x).logits
        assert torch.equal(out, expected)
        out.sum().backward()
        expected.sum().backward()
        assert_grads_equal(model, reference)
    assert torch.equal(model(x).logits, clean)
    nnbridge.unbridge(model)
