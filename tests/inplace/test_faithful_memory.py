"""Faithful or loud, part "memory": transformers' output capturing (``output_attentions``,
``output_hidden_states``) through bridged models, copies and pickling of bridged models, and that
nothing nnbridge creates keeps a model, a PatchableGraph or generated code alive."""

import copy
import gc
import io
import linecache
import pickle
import weakref

import pytest
import torch

import nnbridge
from nnbridge import NNBridgeError, PatchableGraph, ZeroPatch
from nnbridge.inplace.bridging import bridge_of
from utils import assert_same, cached, gpt2, llama

MODELS = {"gpt2": gpt2, "llama": llama}
CAPTURE = [{"output_attentions": True}, {"output_hidden_states": True},
           {"output_attentions": True, "output_hidden_states": True}]


def assert_outputs_equal(got, want):
    """Every output leaf ``torch.equal``: logits, hidden states, attentions, cache contents."""
    assert list(got.keys()) == list(want.keys())
    for key in want.keys():
        if key == "past_key_values":
            assert type(got[key]) is type(want[key])
            assert_same(cached(got[key]), cached(want[key]))
        elif isinstance(want[key], tuple):
            assert isinstance(got[key], tuple) and len(got[key]) == len(want[key]), key
            for a, b in zip(got[key], want[key]):
                assert isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a, b), key
        else:
            assert_same(got[key], want[key])


# -- item 10: output_attentions / output_hidden_states ------------------------------------------------
@pytest.mark.no_extraction_cache  # each case extracts for itself (the key tells the config flags apart now)
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("capture", CAPTURE, ids=lambda c: "+".join(c))
@pytest.mark.parametrize("name", list(MODELS))
def test_bridged_capture_outputs_equal_eager(name, capture, use_cache):
    ids = torch.randint(1, 100, (1, 6))
    eager, model = MODELS[name](), MODELS[name]()
    want = eager(ids, use_cache=use_cache, **capture)
    nnbridge.bridge(model, ids)  # extracted without capturing; the capturing call is a new structure
    got = model(ids, use_cache=use_cache, **capture)
    assert_outputs_equal(got, want)
    if "output_attentions" in capture:
        assert got.attentions[0].shape == (1, 4, 6, 6)  # (batch, heads, seq, seq)
    # the module that collects is opaque (reason recorded); its decoder layers are still graphs
    reasons = [r for e in bridge_of(model).dispatcher.all_extractions() for r in e.opaque.values()]
    assert any("output_attentions or output_hidden_states" in r for r in reasons)
    layer = model.transformer.h[0] if name == "gpt2" else model.model.layers[0]
    assert any(isinstance(m, nnbridge.OpPoint) for m in layer.modules())
    # the plain call still equals eager, and unbridging leaves capturing working
    assert_outputs_equal(model(ids), eager(ids))
    nnbridge.unbridge(model)
    assert_outputs_equal(model(ids, use_cache=use_cache, **capture), want)


@pytest.mark.parametrize("name", list(MODELS))
def test_bridged_with_capturing_example_call(name):
    ids = torch.randint(1, 100, (1, 6))
    eager, model = MODELS[name](), MODELS[name]()
    kwargs = {"use_cache": False, "output_attentions": True, "output_hidden_states": True}
    nnbridge.bridge(model, ids, **kwargs)
    assert_outputs_equal(model(ids, **kwargs), eager(ids, **kwargs))


@pytest.mark.parametrize("name", list(MODELS))
def test_capturing_hooks_installed_before_bridging_and_user_hooks(name):
    """The model already installed its capturing hooks (an eager call with output_attentions), and
    the user hooked the attention module: extraction keeps both, and eager capturing still works
    after unbridge."""
    ids = torch.randint(1, 100, (1, 5))
    eager, model = MODELS[name](), MODELS[name]()
    want = eager(ids, output_attentions=True, output_hidden_states=True)
    model(ids, output_attentions=True)
    attention = model.transformer.h[0].attn if name == "gpt2" else model.model.layers[0].self_attn
    seen = []
    handle = attention.register_forward_hook(lambda m, a, o: seen.append(type(o)))
    nnbridge.bridge(model, ids)
    assert_outputs_equal(model(ids, output_attentions=True, output_hidden_states=True), want)
    nnbridge.unbridge(model)
    assert_outputs_equal(model(ids, output_attentions=True, output_hidden_states=True), want)
    assert seen and all(t is tuple for t in seen)
    handle.remove()


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("name", list(MODELS))
def test_nnsight_capture_outputs_equal_eager(name, use_cache):
    ids = torch.randint(1, 100, (1, 6))
    eager = MODELS[name]()
    want = eager(ids, use_cache=use_cache, output_attentions=True, output_hidden_states=True)
    model = nnbridge.NNsight(MODELS[name]())
    model.extract(ids, use_cache=False)
    with model.trace(ids, use_cache=use_cache, output_attentions=True, output_hidden_states=True):
        output = model.output.save()
    assert_outputs_equal(output, want)
    with model.trace(ids, use_cache=False):
        plain = model.output.save()
    assert_outputs_equal(plain, eager(ids, use_cache=False))


# -- item 16: memory ------------------------------------------------------------------------------------
class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x)) * 2


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _stack() -> Stack:
    torch.manual_seed(0)
    return Stack().eval()


def _generated_keys() -> set[str]:
    """The file names of fx-generated code that fx's source cache and linecache still hold."""
    from torch.fx.graph_module import _loader

    return {k for k in [*_loader.eval_cache, *linecache.cache] if k.startswith("<eval_with_key>")}


def _shape_envs() -> int:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is ShapeEnv)


def test_patchable_graph_over_bridged_model_is_freed():
    x = torch.randn(3, 4)
    model = nnbridge.bridge(_stack(), x)
    callbacks = bridge_of(model).dispatcher.on_extraction
    before = len(callbacks)
    pg = PatchableGraph(model, x)
    assert len(callbacks) == before + 1
    ref = weakref.ref(pg)
    del pg
    gc.collect()
    assert ref() is None, "the bridged model kept the PatchableGraph alive"
    assert len(callbacks) == before, "its callback stays registered after it died"
    # the bridged model keeps working, also when it extracts a new call structure
    reference = _stack()
    assert torch.equal(model(x), reference(x))
    x3 = torch.randn(2, 3, 4)
    assert torch.equal(model(x3), reference(x3))
    nnbridge.unbridge(model)


def test_live_patchable_graph_over_bridged_model_gets_new_extractions(monkeypatch):
    x, x3 = torch.randn(3, 4), torch.randn(2, 3, 4)
    seen = []
    apply_active = PatchableGraph._apply_active

    def spy(self, dispatcher, extraction):
        seen.append(extraction)
        apply_active(self, dispatcher, extraction)

    monkeypatch.setattr(PatchableGraph, "_apply_active", spy)
    model = nnbridge.bridge(_stack(), x)
    pg = PatchableGraph(model, x)
    gc.collect()
    reference = _stack()
    with pg.patch({"layers_1.fc.output": ZeroPatch()}):
        out = model(x3)  # rank 3: a new call structure, extracted while the context is open
    assert len(seen) == 1 and seen[0] is pg.extractions[-1] and len(pg.extractions) == 2
    assert torch.equal(out, torch.zeros(2, 3, 4)), "relu(0) * 2 after the zeroed fc"
    assert torch.equal(model(x3), reference(x3)), "the patch is gone after the context"
    nnbridge.unbridge(model)


@pytest.mark.parametrize("how", ["bridged", "unbridged", "patchable_graph", "bridged_patchable_graph"])
def test_model_is_freed_after_extraction(how):
    """No torch global keeps an extraction, and through it the model, alive: deleting the model
    (and its PatchableGraph) frees it and its layers, without unbridging and without another export."""
    x = torch.randn(3, 4)
    model = _stack()
    envs = _shape_envs()
    if how != "patchable_graph":
        nnbridge.bridge(model, x)
        assert torch.equal(model(x), _stack()(x))
    if how == "unbridged":
        nnbridge.unbridge(model)
    pg = PatchableGraph(model, x) if how.endswith("patchable_graph") else None
    if pg is not None:
        assert torch.equal(pg(x), _stack()(x))
    refs = [weakref.ref(model), weakref.ref(model.layers[0]), weakref.ref(model.layers[1].fc)]
    del model, pg
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]
    assert _shape_envs() <= envs, "an extraction's ShapeEnv (export's symbolic shapes) outlived it"


def test_re_extraction_of_a_transformers_model_frees_it():
    ids = torch.randint(1, 100, (1, 6))
    model = nnbridge.bridge(gpt2(), ids)
    model(torch.randint(1, 100, (2, 5)))  # a second extraction (batch 2)
    refs = [weakref.ref(model), weakref.ref(model.transformer.h[1].attn)]
    del model
    gc.collect()
    assert [r() is None for r in refs] == [True, True]


def test_generated_code_cache_does_not_grow():
    """fx keeps every generated source in its eval cache and in linecache; nnbridge's entries
    leave with their code."""
    x = torch.randn(3, 4)

    def cycle() -> None:
        model = nnbridge.bridge(_stack(), x)
        model(torch.randn(2, 3, 4))  # and a second call structure
        nnbridge.unbridge(model)
        pg = PatchableGraph(_stack(), x)
        with pg.patch({"layers_0.fc.output": ZeroPatch()}):  # routed code compiled on demand
            pg(x)
        del model, pg
        gc.collect()

    cycle()
    start = _generated_keys()
    for _ in range(5):
        cycle()
    assert _generated_keys() <= start


def test_generated_lines_readable_while_code_lives():
    """Tracebacks through generated code show its lines while the graph lives, and while an
    exception's traceback holds a frame of it; the source leaves with the last of them."""
    x = torch.randn(3, 4)
    model = nnbridge.bridge(_stack(), x)
    forward = type(bridge_of(model).dispatcher.extractions[next(iter(bridge_of(model).dispatcher.extractions))][0]
                   .root).forward
    key = forward.__code__.co_filename
    assert key.startswith("<eval_with_key>") and key in _generated_keys()
    assert "def forward" in "".join(linecache.getlines(key))

    def fail(module, args, output):
        raise RuntimeError("hook failed")

    handle = model.get_submodule("layers.0.fc.linear").register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="hook failed") as caught:
        model(x)
    handle.remove()
    error = caught.value
    nnbridge.unbridge(model)
    del model, forward, caught
    gc.collect()
    text = "".join(__import__("traceback").format_exception(error))
    frames = [line for line in text.splitlines() if "<eval_with_key>" in line]
    assert frames, text
    # each generated frame is followed by its source line
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "<eval_with_key>" in line:
            assert lines[i + 1].strip() and not lines[i + 1].lstrip().startswith("File "), text
    generated = {tb.tb_frame.f_code.co_filename for tb in _tracebacks(error)} & _generated_keys()
    assert generated
    del error, text
    gc.collect()
    assert not generated & _generated_keys(), "the source outlived the code"


def _tracebacks(error: BaseException):
    tb = error.__traceback__
    while tb is not None:
        yield tb
        tb = tb.tb_next
