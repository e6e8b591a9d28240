"""Every refusal of the insertion verbs: each names the site, the rule and the fix, and leaves the
model unedited."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaMLP

import nnbridge
from nnbridge import ExtractionOptions, SurgeryError, surgery
from nnbridge.inplace.bridging import bridge_of
from surgery_models import SAE
from utils import llama

SITE = "model.layers_1.mlp.output"


class Doubling(torch.nn.Module):
    def forward(self, x):
        return x.double()


class Narrowing(torch.nn.Module):
    def forward(self, x):
        return x[..., :32]


class Failing(torch.nn.Module):
    def forward(self, x):
        raise RuntimeError("broken on purpose")


class Pair(torch.nn.Module):
    def forward(self, x):
        return x, x


@pytest.fixture
def setup():
    model = llama()
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(6))
    clean = model(ids).logits
    nnbridge.bridge(model, ids)
    names = [n for n, _ in model.named_modules()]
    yield model, ids, clean
    assert surgery.edits(model) == []
    assert [n for n, _ in model.named_modules()] == names  # nothing half-edited
    assert torch.equal(model(ids).logits, clean)
    nnbridge.unbridge(model)


@pytest.mark.parametrize("site, module, kwargs, message", [
    ("model.layers_1.mlp.outptu", SAE(), {}, r"'model.layers_1.mlp.outptu' is not a node.*Closest valid NodePaths"),
    ("model.layers_1.mlp.output|sub_0", SAE(), {}, r"digs into a container value"),
    (SITE, Doubling(), {}, r"Doubling at 'model.layers_1.mlp.output' returns \(1, 6, 64\) float64.*keep the value's"
                           r" shape, dtype and device"),
    (SITE, Narrowing(), {}, r"returns \(1, 6, 32\) float32 on cpu where the graph expects \(1, 6, 64\)"),
    (SITE, Failing(), {}, r"Failing fails on the value at .*broken on purpose"),
    (SITE, Pair(), {}, r"returns tuple, not a tensor"),
    (SITE, SAE(), {"name": "output"}, r"name='output' cannot name"),
    (SITE, SAE(), {"name": "not a name"}, r"cannot name a child module"),
    (SITE, SAE(), {"name": "down_proj"}, r"already has a node or attribute 'down_proj'"),
    (SITE, SAE(), {"name": "mul"}, r"already has a node or attribute 'mul'"),
])
def test_insert_after_refusals(setup, site, module, kwargs, message):
    model, _, _ = setup
    with pytest.raises(SurgeryError, match=message):
        surgery.insert_after(model, site, module, **kwargs)


def test_insert_before_refusals(setup):
    model, _, _ = setup
    with pytest.raises(SurgeryError, match=r"has 2 positional input\(s\); arg=5 is out of range"):
        surgery.insert_before(model, "model.layers_1.mlp.mul", SAE(), arg=5)
    with pytest.raises(SurgeryError, match=r"input 1 is the constant"):
        surgery.insert_before(model, "model.layers_1.self_attn.transpose", SAE(), arg=1)


def test_replace_node_refusals(setup):
    model, _, _ = setup
    with pytest.raises(SurgeryError, match=r"is an op \(call_function\), not a module call"):
        surgery.replace_node(model, "model.layers_1.mlp.mul", SAE())


def test_module_and_target_refusals(setup):
    model, _, _ = setup
    with pytest.raises(SurgeryError, match=r"must be a torch.nn.Module"):
        surgery.insert_after(model, SITE, torch.relu)
    with pytest.raises(SurgeryError, match=r"already part of the model"):
        surgery.insert_after(model, SITE, model.model.layers[0].mlp)
    with pytest.raises(SurgeryError, match=r"site must be a NodePath string"):
        surgery.insert_after(model, 3, SAE())
    with pytest.raises(SurgeryError, match=r"LlamaForCausalLM is not bridged.*nnbridge.bridge"):
        surgery.insert_after(llama(), SITE, SAE())
    with pytest.raises(SurgeryError, match=r"edits takes a model bridged"):
        surgery.edits(3)


def test_not_extracted_yet():
    model = llama()
    nnbridge.bridge(model)
    with pytest.raises(SurgeryError, match=r"no extracted graphs yet.*call it once first"):
        surgery.insert_after(model, SITE, SAE())
    nnbridge.unbridge(model)


def test_module_called_twice_and_tuple_output():
    from fixtures.tuple_output_module import TupleOutputModule, inputs

    model = TupleOutputModule()
    (x,), _ = inputs()
    expected = model(x)
    nnbridge.bridge(model, x)
    with pytest.raises(SurgeryError, match=r"one of 2 calls of module 'linear'.*insert at 'linear_0' itself"):
        surgery.insert_after(model, "linear_0.linear", Doubler())
    with pytest.raises(SurgeryError, match=r"site 'output' returns tuple, not one tensor node"):
        surgery.insert_after(model, "output", Doubler())
    assert surgery.edits(model) == []
    with surgery.insert_after(model, "linear_1", Doubler()):  # one call, in the caller's graph
        first, second = model(x)
        assert torch.equal(first, expected[0]) and torch.equal(second, expected[1] * 2)
    assert all(torch.equal(a, b) for a, b in zip(model(x), expected))
    nnbridge.unbridge(model)


class Doubler(torch.nn.Module):
    def forward(self, x):
        return x * 2


def test_opaque_module():
    model, reference = llama(), llama()
    ids = torch.randint(0, 100, (1, 4), generator=torch.Generator().manual_seed(7))
    nnbridge.bridge(model, ids, options=ExtractionOptions(classes_to_skip_compiling={LlamaMLP}))
    with pytest.raises(SurgeryError, match=r"runs eagerly \(opaque.*edit at its call instead"):
        surgery.insert_after(model, "model.layers_1.mlp.output", SAE())
    assert surgery.edits(model) == []
    # its call is in a graph: the edit goes there
    with surgery.insert_after(model, "model.layers_1.mlp", SAE()) as edit:
        assert edit.node_path == "model.layers_1.sae"
        model(ids)
    # its children still have graphs (extracted by their own dispatchers): edits reach them
    with surgery.insert_after(model, "model.layers_1.mlp.down_proj.output", Doubler()):
        reference.model.layers[1].mlp.down_proj.register_forward_hook(lambda module, args, output: output * 2)
        assert torch.equal(model(ids).logits, reference(ids).logits)
    nnbridge.unbridge(model)


def test_failing_refresh_leaves_nothing():
    model = llama()
    ids = torch.randint(0, 100, (1, 4), generator=torch.Generator().manual_seed(8))
    pg = nnbridge.PatchableGraph(model, ids)
    clean = pg(ids).logits

    class Flaky(torch.nn.Module):
        calls = 0

        def forward(self, x):
            Flaky.calls += 1
            if Flaky.calls > 1:  # fine on fake values, fails when extracted
                raise RuntimeError("fails once extracted")
            return x

    with pytest.raises(Exception, match="fails once extracted"):
        surgery.insert_after(pg, SITE, Flaky())
    assert surgery.edits(pg) == []
    assert "flaky" not in model.model.layers[1].mlp._modules
    assert torch.equal(pg(ids).logits, clean)
