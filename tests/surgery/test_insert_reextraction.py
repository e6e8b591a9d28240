"""Edits are recipes: every extraction made after the edit has it (a new call structure, .train(),
another sequence length), and an edit whose op vanished raises SurgeryError saying why."""

import pytest
import torch

import nnbridge
from nnbridge import ExtractionOptions, SurgeryError, surgery
from nnbridge.inplace.bridging import bridge_of
from surgery_models import SAE, sae_reference
from utils import llama

SITE = "model.layers_1.mlp.output"


def reasons(model):
    return [e.reason for e in bridge_of(model).dispatcher.history]


@pytest.fixture
def edited():
    model = llama()
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    nnbridge.bridge(model, ids, options=ExtractionOptions(dynamic_shapes=False))
    sae = SAE()
    surgery.insert_after(model, SITE, sae)
    yield model, ids, sae_reference(sae)
    nnbridge.unbridge(model)


def test_new_call_structure(edited):
    model, ids, reference = edited
    assert torch.equal(model(ids).logits, reference(ids).logits)
    out = model(ids, output_hidden_states=True)
    expected = reference(ids, output_hidden_states=True)
    assert torch.equal(out.logits, expected.logits)
    assert torch.equal(out.hidden_states[2], expected.hidden_states[2])
    assert len(reasons(model)) == 3


def test_train_mode(edited):
    model, ids, reference = edited
    model.train()
    reference.train()
    assert torch.equal(model(ids).logits, reference(ids).logits)
    assert model.model.layers[1].mlp.sae.training
    assert any("train" in reason for reason in reasons(model))


def test_other_sequence_length(edited):
    model, ids, reference = edited
    longer = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(4))
    assert torch.equal(model(longer).logits, reference(longer).logits)
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_edit_that_no_longer_applies():
    model = llama()
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(5))
    clean = model(ids).logits
    nnbridge.bridge(model, ids)
    from surgery_models import HeadGate
    edit = surgery.insert_after(model, "model.layers_0.self_attn.softmax", HeadGate())
    model(ids)
    model.set_attn_implementation("sdpa")
    with pytest.raises(SurgeryError, match=r"no longer applies.*no node 'softmax'.*attn_implementation") as raised:
        model(ids)
    assert "model.layers_0.self_attn" in str(raised.value)
    edit.remove()
    assert torch.allclose(model(ids).logits, clean, atol=1e-5)  # sdpa, unedited
    nnbridge.unbridge(model)
