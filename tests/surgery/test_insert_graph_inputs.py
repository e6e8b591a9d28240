"""Insertions at a graph's inputs, and into modules whose forward runs every child they hold.

A module call taking the graph's own input (``self.first(x)`` in the root) is replaced with the
input's recorded sizes (before: refused, with no caller to edit instead). A module whose forward
runs every child it holds (``nn.Sequential``, or a loop over ``self.children()``) would run an
inserted child itself: the edit is refused (before: the model computed something else, silently).
"""

import pytest
import torch
from torch import nn

import nnbridge
from nnbridge import SurgeryError, surgery


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


class Chain(nn.Module):
    """Runs its children in registration order (its code reads the registry, as Sequential's)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        for child in self.children():
            x = torch.relu(child(x))
        return x


def _made(cls):
    torch.manual_seed(0)
    return cls()


X = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))


def test_replace_node_at_a_call_of_the_models_own_input():
    model, reference = _made(Root), _made(Root)
    nnbridge.bridge(model, X)
    torch.manual_seed(5)
    new = nn.Linear(4, 4)
    edit = surgery.replace_node(model, "first", new)
    want = reference.second(torch.relu(new(X)))
    got = model(X)
    assert torch.equal(got, want)
    got.sum().backward()
    want_new = [p.grad.clone() for p in new.parameters()]
    for p in new.parameters():
        p.grad = None
    reference.second(torch.relu(new(X))).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(want_new, new.parameters()))
    edit.remove()
    assert torch.equal(model(X), reference(X))


def test_insert_after_a_graph_input():
    model, reference = _made(Root), _made(Root)
    nnbridge.bridge(model, X)
    gate = nn.Linear(4, 4)
    surgery.insert_after(model, "first.input", gate, name="pre")
    assert torch.equal(model(X), reference.second(torch.relu(reference.first(gate(X)))))


def test_a_sequential_owner_is_refused_before_anything_changes():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    nnbridge.bridge(model, X)
    want = model(X)
    inserted = nn.Linear(4, 4)
    with pytest.raises(SurgeryError, match="Sequential, whose forward runs every child it holds"):
        surgery.insert_after(model, "0", inserted)
    assert not any(child is inserted for child in model.modules())
    assert surgery.edits(model) == []
    assert torch.equal(model(X), want)


def test_an_owner_running_its_children_itself_raises_instead_of_running_the_module_twice():
    model, reference = _made(Chain), _made(Chain)
    nnbridge.bridge(model, X)
    gate = nn.Linear(4, 4)
    with pytest.raises(SurgeryError, match="calls the inserted module 'gate' itself"):
        edit = surgery.insert_after(model, "a", gate, name="gate")
        model(X)  # the extraction that applies the edit
    for edit in surgery.edits(model):
        edit.remove()
    assert "gate" not in dict(model.named_children())
    assert torch.equal(model(X), reference(X))


def test_insert_after_a_child_graphs_input_in_a_llama():
    """``model.layers_1.mlp.x`` (the MLP graph's input) takes an SAE: the MLP reads the SAE's
    output, as a hand-written pre-hook feeding the MLP through the same SAE."""
    import copy

    from surgery_models import SAE
    from utils import llama

    model, reference = llama(), llama()
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    nnbridge.bridge(model, ids)
    sae = SAE()
    twin = copy.deepcopy(sae)
    reference.model.layers[1].mlp.register_forward_pre_hook(lambda module, args: (twin(args[0]),))
    edit = surgery.insert_after(model, "model.layers_1.mlp.x", sae)
    assert torch.equal(model(ids).logits, reference(ids).logits)
    edit.remove()
    assert torch.equal(model(ids).logits, llama()(ids).logits)
