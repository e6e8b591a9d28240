"""torch.compile of a bridged model (issue 48, item 5): with ``fullgraph=True`` and with the default
(``backend="eager"`` and ``"aot_eager"``), unpatched and with a torch hook on an op point, the
compiled model equals the eager one; an extraction Dynamo cannot trace is loud under fullgraph."""

import pytest
import torch

import nnbridge
from utils import gpt2

pytestmark = pytest.mark.integration  # end to end: torch.compile of bridged models

MODES = {
    "fullgraph": dict(fullgraph=True, backend="eager"),
    "eager": dict(backend="eager"),
    "aot_eager": dict(backend="aot_eager"),
}


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        h = torch.nn.functional.gelu(self.up(x))
        return torch.softmax(self.down(h) * self.scale, dim=-1) + x


def mlp():
    torch.manual_seed(0)
    return Mlp().eval()


# (model factory, example input, the op point a hook goes on, a call of another structure)
MODELS = {
    "gpt2": (gpt2, lambda: torch.randint(0, 100, (2, 7)), "transformer.h.0.attn.softmax",
             lambda model, x: model(x, use_cache=False)),
    "mlp": (mlp, lambda: torch.randn(3, 8), "softmax", lambda model, x: model(x[0])),
}


def outputs(value):
    """The tensors of a model's output (GPT-2: its logits and every cached key and value)."""
    if isinstance(value, torch.Tensor):
        return [value]
    tensors = [value.logits]
    if getattr(value, "past_key_values", None) is not None:
        for layer in value.past_key_values.layers:
            tensors += [layer.keys, layer.values]
    return tensors


def assert_equal(actual, expected):
    actual, expected = outputs(actual), outputs(expected)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


def halve(module, args, output):
    return output * 0.5


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MODELS)
def test_compiled_bridged_model_equals_eager(name, mode):
    make, example, op, _ = MODELS[name]
    x = example()
    with torch.no_grad():
        expected = make()(x)
        # bridged with an example call (its graphs run), and bridged lazily (nothing extracted yet)
        for bridged in (nnbridge.bridge(make(), x), nnbridge.bridge(make())):
            compiled = torch.compile(bridged, **MODES[mode])
            assert_equal(compiled(x), expected)
            assert_equal(compiled(x), expected)  # the compiled code again
            nnbridge.unbridge(bridged)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MODELS)
def test_compiled_bridged_model_with_op_hook_equals_eager(name, mode):
    make, example, op, _ = MODELS[name]
    x = example()
    model = nnbridge.bridge(make(), x)
    handle = model.get_submodule(op).register_forward_hook(halve)
    with torch.no_grad():
        expected = model(x)  # eager, hooked
        assert not torch.equal(outputs(expected)[0], outputs(make()(x))[0])  # the hook changes the output
        compiled = torch.compile(model, **MODES[mode])
        assert_equal(compiled(x), expected)
        handle.remove()  # Dynamo's guards see the hook go
        assert_equal(compiled(x), make()(x))


@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", MODELS)
def test_new_call_structure_with_op_hook_is_extracted_outside_the_trace(name, mode):
    make, example, op, other_call = MODELS[name]
    x = example()
    model = nnbridge.bridge(make(), x)
    model.get_submodule(op).register_forward_hook(halve)
    reference = nnbridge.bridge(make(), x)
    reference.get_submodule(op).register_forward_hook(halve)
    with torch.no_grad():
        expected = other_call(reference, x)  # eager: extracts this structure, hook included
        compiled = torch.compile(model, **MODES[mode])
        assert_equal(other_call(compiled, x), expected)


@pytest.mark.parametrize("name", MODELS)
def test_new_call_structure_with_op_hook_under_fullgraph_is_loud(name):
    make, example, op, other_call = MODELS[name]
    x = example()
    model = nnbridge.bridge(make(), x)
    model.get_submodule(op).register_forward_hook(halve)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad(), pytest.raises(Exception, match="Call the model once outside torch.compile"):
        other_call(compiled, x)


class _UnreadableSet:
    """Stands in for the process-wide set of listened op points: reading it fails the test."""

    def __bool__(self):
        raise AssertionError("LISTENED read")

    __len__ = __bool__


def test_a_call_dynamo_traces_reads_only_its_own_op_points(monkeypatch):
    """Inside Dynamo's trace, whether anything listens is read off the model's own op points, never
    off the process-wide LISTENED weak set: the garbage collector changes that set's size at any
    time (freeing another model's points), which would fail Dynamo's guard on the frame that made it."""
    from nnbridge.inplace import bridging

    model, x = mlp(), torch.randn(3, 8)
    nnbridge.bridge(model, x)
    state = bridging.bridge_of(model)
    monkeypatch.setattr(bridging, "LISTENED", _UnreadableSet())
    assert state.listened(traced=True) is False
    handle = model.get_submodule("softmax").register_forward_hook(lambda module, args, output: output)
    assert state.listened(traced=True) is True
    handle.remove()
    with pytest.raises(AssertionError, match="LISTENED read"):  # an eager call's check reads the set first
        state.listened()
    monkeypatch.undo()
    nnbridge.unbridge(model)
