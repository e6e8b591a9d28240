"""An SAE inserted at an MLP's output equals a hand-written model whose MLP ends in the SAE:
outputs, every gradient, an Adam step; .remove() restores the unedited model exactly."""

import copy

import pytest
import torch

import nnbridge
from nnbridge import surgery
from nnbridge.inplace.bridging import bridge_of
from surgery_models import SAE, MLPWithSAE, assert_grads_equal, sae_reference
from utils import llama

SITE = "model.layers_1.mlp.output"


@pytest.fixture
def setup():
    model = llama()
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    clean = model(ids).logits
    nnbridge.bridge(model, ids)
    yield model, ids, clean
    if bridge_of(model) is not None:
        nnbridge.unbridge(model)


def test_sae_equals_hand_written_model(setup):
    model, ids, clean = setup
    sae = SAE()
    reference = sae_reference(sae)
    edit = surgery.insert_after(model, SITE, sae)
    assert edit.node_path == "model.layers_1.mlp.sae"
    assert model.model.layers[1].mlp.sae is sae
    assert any(p is sae.enc.weight for p in model.parameters())
    assert "model.layers.1.mlp.sae.enc.weight" in model.state_dict()
    out = model(ids).logits
    expected = reference(ids).logits
    assert torch.equal(out, expected)
    assert not torch.equal(out, clean)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_equal(model, reference)
    # one Adam step on each side keeps them equal
    for m in (model, reference):
        optimizer = torch.optim.Adam(m.parameters(), lr=1e-2)
        optimizer.step()
        optimizer.zero_grad()
    assert torch.equal(model(ids).logits, reference(ids).logits)
    # the SAE's own ops are nodes too, and real op points
    assert hasattr(model.model.layers[1].mlp.sae, "relu")
    assert not hasattr(model.model.layers[0].mlp, "sae")  # layer 0 keeps its (reused) graph unedited


def test_remove_restores_unedited_outputs(setup):
    model, ids, clean = setup
    sae = SAE()
    names = [n for n, _ in model.named_modules()]
    edit = surgery.insert_after(model, SITE, sae)
    assert surgery.edits(model) == [edit]
    assert not torch.equal(model(ids).logits, clean)
    edit.remove()
    assert torch.equal(model(ids).logits, clean)
    assert surgery.edits(model) == []
    assert "sae" not in model.model.layers[1].mlp._modules
    assert [n for n, _ in model.named_modules()] == names
    edit.remove()  # twice: nothing
    # inserted again (same module, another site): the edited extraction of the first edit is not reused
    with surgery.insert_after(model, "model.layers_0.mlp.output", sae) as again:
        assert again.node_path == "model.layers_0.mlp.sae"
        reference = llama()
        reference.model.layers[0].mlp.__class__ = MLPWithSAE
        reference.model.layers[0].mlp.sae = copy.deepcopy(sae)
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert torch.equal(model(ids).logits, clean)


def test_hooks_and_patchable_graph_see_the_sae(setup):
    model, ids, clean = setup
    sae = SAE()
    seen = []
    handle = sae.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    with surgery.insert_after(model, SITE, sae):
        model(ids)
        assert seen == [torch.Size([2, 8, 64])]
        relu = model.get_submodule("model.layers.1.mlp.sae.relu")
        relu_seen = []
        relu_handle = relu.register_forward_hook(lambda module, args, output: relu_seen.append(output.clone()))
        model(ids)
        relu_handle.remove()
        assert relu_seen[0].shape == (2, 8, 32) and bool((relu_seen[0] >= 0).all())
        pg = nnbridge.PatchableGraph(model, ids)
        assert "model.layers_1.mlp.sae.relu" in pg.node_paths()
        assert "model.layers_0.mlp.sae.relu" not in pg.node_paths()
        with pg.patch({"model.layers_1.mlp.sae.relu": nnbridge.ZeroPatch()}):
            zeroed = model(ids).logits
        # a zero code: the SAE's output is its decoder bias
        reference = sae_reference(sae)
        reference.model.layers[1].mlp.sae.enc.weight.data.zero_()
        reference.model.layers[1].mlp.sae.enc.bias.data.fill_(-1.0)
        assert torch.equal(zeroed, reference(ids).logits)
    handle.remove()


def test_patchable_graph_target():
    model = llama()
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(1))
    pg = nnbridge.PatchableGraph(model, ids)
    clean = pg(ids).logits
    sae = SAE()
    edit = surgery.insert_after(pg, "model.layers.1.mlp.output", sae)  # nnsight spelling
    assert "model.layers_1.mlp.sae.relu" in pg.node_paths()
    assert torch.equal(pg(ids).logits, sae_reference(sae)(ids).logits)
    assert any(p is sae.enc.weight for p in model.parameters())
    edit.remove()
    assert torch.equal(pg(ids).logits, clean)
    assert "model.layers_1.mlp.sae.relu" not in pg.node_paths()


def test_unbridge_removes_every_edit(setup):
    model, ids, clean = setup
    surgery.insert_after(model, SITE, SAE())
    surgery.insert_after(model, "model.layers_0.mlp.output", SAE(), name="sae0")
    assert len(surgery.edits(model)) == 2
    model(ids)
    nnbridge.unbridge(model)
    assert "sae" not in model.model.layers[1].mlp._modules
    assert "sae0" not in model.model.layers[0].mlp._modules
    assert torch.equal(model(ids).logits, clean)


def test_clear(setup):
    model, ids, clean = setup
    surgery.insert_after(model, SITE, SAE())
    surgery.insert_before(model, "model.layers_0.mlp", SAE(), name="pre")
    model(ids)
    surgery.clear(model)
    assert surgery.edits(model) == []
    assert torch.equal(model(ids).logits, clean)


@pytest.mark.integration  # end to end: torch.compile
def test_torch_compile_fullgraph_runs_the_edits(setup):
    """Compiled with and without fullgraph=True, the model runs its edited graphs (not its own,
    unedited code), at the extraction's sequence length and another; a call structure never run
    outside torch.compile is refused under fullgraph, naming the edits."""
    model, ids, clean = setup
    sae = SAE()
    surgery.insert_after(model, SITE, sae)
    model(ids)
    expected = sae_reference(sae)(ids).logits
    torch._dynamo.reset()
    try:
        full = torch.compile(model, fullgraph=True, backend="eager")  # (first: no eager lookup ran since the call)
        assert torch.equal(full(ids).logits, expected)
        longer = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(1))
        assert torch.equal(full(longer).logits, sae_reference(sae)(longer).logits)  # the graphs take any length
        with pytest.raises(Exception, match="graph surgery"):  # Dynamo wraps the refusal in its own error types
            full(ids, output_hidden_states=True)  # a call structure with no extraction yet
        torch._dynamo.reset()
        assert torch.equal(torch.compile(model, backend="eager")(ids).logits, expected)
    finally:
        torch._dynamo.reset()


def test_an_insertion_re_extracts_once(setup):
    """The call after an insertion re-extracts (the module tree changed) and the calls after it
    reuse that extraction: it is keyed by the new tree's train/eval flags, as later calls are."""
    model, ids, _ = setup
    dispatcher = bridge_of(model).dispatchers[id(model)]
    surgery.insert_after(model, SITE, SAE())
    before = len(dispatcher.history)
    model(ids)
    model(ids)
    model(ids)
    assert len(dispatcher.history) == before + 1
    assert "were added or removed" in dispatcher.history[-1].reason
