"""torch.func transforms through a bridged model whose call structure is new (issue 48, item 3d):
the extraction runs outside the transform, from plain tensors holding the inputs' logical values,
and ``grad`` / ``jacrev`` / ``jvp`` / ``hessian`` equal eager; per-sample gradients (``vmap`` of
``grad``) and transforming the module's own parameters (``functional_call``) are refused loudly."""

import pytest
import torch
from torch.func import functional_call, grad, hessian, jacrev, jvp, vmap

import nnbridge
from nnbridge.inplace.bridging import bridge_of
from utils import gpt2

# torch's forward-mode AD (jvp, hessian) scripts its decompositions on first use (eager torch too),
# with torch's own deprecation warning of torch.jit.script: a DeprecationWarning on torch 2.13, a
# FutureWarning from 2.14 on
pytestmark = [pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")]


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(4, 8)
        self.down = torch.nn.Linear(8, 3)

    def forward(self, x):
        return torch.softmax(self.down(torch.tanh(self.up(x))), dim=-1)


def mlp():
    torch.manual_seed(0)
    return Mlp()


def _x():
    torch.manual_seed(1)
    return torch.randn(5, 4)


TRANSFORMS = {
    "grad": lambda model, x: grad(lambda x: model(x).sum())(x),
    "jacrev": lambda model, x: jacrev(model)(x),
    "hessian": lambda model, x: hessian(lambda row: model(row).sum())(x[0]),  # jacfwd(jacrev): jvp over vjp
}


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_transform_of_a_new_call_structure_equals_eager(transform):
    x = _x()
    expected = TRANSFORMS[transform](mlp(), x)
    model = nnbridge.bridge(mlp())  # nothing extracted: the transform's call is the first
    assert torch.equal(TRANSFORMS[transform](model, x), expected)
    assert torch.equal(TRANSFORMS[transform](model, x), expected)  # served by the same extraction
    assert len(bridge_of(model).dispatcher.history) == 1
    assert any(isinstance(m, nnbridge.OpPoint) for m in model.modules())


@pytest.mark.parametrize("transform", ["grad", "jvp"])
def test_transforms_through_gpt2_equal_eager(transform):
    torch.manual_seed(2)
    embeds = torch.randn(1, 5, 64)

    def logits(model):
        return lambda e: model(inputs_embeds=e, use_cache=False).logits

    reference = gpt2()
    if transform == "grad":
        expected = grad(lambda e: logits(reference)(e).sum())(embeds)
        model = nnbridge.bridge(gpt2(), torch.randint(0, 100, (1, 5)))  # extracted for token ids only
        assert torch.equal(grad(lambda e: logits(model)(e).sum())(embeds), expected)
    else:
        tangent = torch.ones_like(embeds)
        expected = jvp(logits(reference), (embeds,), (tangent,))
        model = nnbridge.bridge(gpt2())
        got = jvp(logits(model), (embeds,), (tangent,))
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_per_sample_gradients_are_loud_until_extracted_outside():
    x = _x()
    reference = mlp()
    expected = vmap(grad(lambda row: reference(row).sum()))(x)
    model = nnbridge.bridge(mlp())
    with pytest.raises(nnbridge.NNBridgeError, match=r"Module 'Mlp'.*vmap of a gradient transform.*once outside"):
        vmap(grad(lambda row: model(row).sum()))(x)
    model(x[0].clone().requires_grad_())  # one sample, the same structure, outside the transforms
    assert torch.equal(vmap(grad(lambda row: model(row).sum()))(x), expected)


def test_grad_with_an_op_hook_and_through_patchable_graph():
    x = _x()
    reference = mlp()
    reference.down.register_forward_hook(lambda module, args, output: output * 0.5)
    expected = grad(lambda x: reference(x).sum())(x)
    model = nnbridge.bridge(mlp(), x[0])  # op points exist; the batched call is a new structure
    model.get_submodule("down.linear").register_forward_hook(lambda module, args, output: output * 0.5)
    assert torch.equal(grad(lambda x: model(x).sum())(x), expected)
    pg = nnbridge.PatchableGraph(mlp(), x[0])
    assert torch.equal(grad(lambda x: pg(x).sum())(x), grad(lambda x: mlp()(x).sum())(x))


def test_transformed_parameters_are_refused_loudly():
    x = _x()
    model = nnbridge.bridge(mlp())
    params = {name: p.detach() * 2 for name, p in mlp().named_parameters()}
    with pytest.raises(nnbridge.NNBridgeError, match=r"Module 'Mlp'.*torch.func transform.*functional_call"):
        grad(lambda p: functional_call(model, p, (x,)).sum())(params)


@pytest.mark.no_extraction_cache
def test_vmap_served_from_the_disk_cache_equals_eager(tmp_path, monkeypatch):
    """A disk-cache hit inside ``vmap`` reads the entry outside the transform (torch.export.load
    sets requires_grad, which functorch refuses inside one): the entry is used, not deleted."""
    monkeypatch.setenv("NNBRIDGE_CACHE", str(tmp_path))
    monkeypatch.setenv("NNBRIDGE_EXTRACTION_CACHE", "1")
    ids = torch.randint(0, 100, (3, 1, 8))
    for _ in range(2):  # the second model is served by the first one's entry
        model = gpt2()
        expected = vmap(lambda i: model(i).logits)(ids)
        nnbridge.bridge(model)
        try:
            actual = vmap(lambda i: model(i).logits)(ids)
        finally:
            nnbridge.unbridge(model)
        assert torch.equal(actual, expected)
    assert len(list((tmp_path / "extractions").glob("*.nnbridge"))) >= 1
