"""``output_attentions`` / ``output_hidden_states`` through a PatchableGraph over a plain model.

transformers collects them with forward hooks on the original attention and decoder-layer
modules; the PatchableGraph's graphs stand in for those modules, so they run the originals'
capturing hooks themselves (:mod:`nnbridge.patching.capture_forwarding`). Before, the first such
call raised ``IndexError`` in the root graph (nothing was collected)."""

import io

import pytest
import torch
from transformers import DynamicCache

import nnbridge
from nnbridge import ExtractionOptions, PatchableGraph, ZeroPatch
from nnbridge.compat.torch.hooks import capturing_hooks
from nnbridge.graph.graph_module import GraphModuleBase
from transformers.utils.output_capturing import install_all_output_capturing_hooks
from utils import gpt2, llama

CAPTURE = dict(output_attentions=True, output_hidden_states=True)
MODELS = {"gpt2": gpt2, "llama": llama}


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def assert_same_outputs(out, expected):
    assert torch.equal(out.logits, expected.logits)
    assert same(out.attentions, expected.attentions)
    assert same(out.hidden_states, expected.hidden_states)


@pytest.mark.parametrize("kind", MODELS)
def test_built_with_capturing_equals_eager(kind):
    model, reference = MODELS[kind](), MODELS[kind]()
    ids = torch.randint(1, 100, (2, 6))
    pg = PatchableGraph(model, ids, use_cache=False, **CAPTURE)
    expected = reference(ids, use_cache=False, **CAPTURE)
    assert len(expected.attentions) == 2 and len(expected.hidden_states) == 3
    assert_same_outputs(pg(ids, use_cache=False, **CAPTURE), expected)
    # each alone, and neither
    for kwargs in ({"output_attentions": True}, {"output_hidden_states": True}, {}):
        out, want = pg(ids, use_cache=False, **kwargs), reference(ids, use_cache=False, **kwargs)
        assert torch.equal(out.logits, want.logits)
        assert (out.attentions is None) == (want.attentions is None)
        assert (out.hidden_states is None) == (want.hidden_states is None)
        if want.attentions is not None:
            assert same(out.attentions, want.attentions)
        if want.hidden_states is not None:
            assert same(out.hidden_states, want.hidden_states)


def test_built_without_capturing_then_called_with_it_equals_eager():
    model, reference = llama(), llama()
    ids = torch.randint(1, 100, (1, 5))
    pg = PatchableGraph(model, ids, use_cache=False)
    assert_same_outputs(pg(ids, use_cache=False, **CAPTURE), reference(ids, use_cache=False, **CAPTURE))


def test_prefill_and_decode_with_a_cache_equal_eager():
    model, reference = llama(), llama()
    ids, step = torch.randint(1, 100, (1, 5)), torch.randint(1, 100, (1, 1))
    pg = PatchableGraph(model, ids, **CAPTURE)
    ours, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
    for tokens in (ids, step):
        out = pg(tokens, past_key_values=ours, **CAPTURE)
        expected = reference(tokens, past_key_values=theirs, **CAPTURE)
        assert_same_outputs(out, expected)
    for layer, other in zip(ours.layers, theirs.layers):
        assert torch.equal(layer.keys, other.keys) and torch.equal(layer.values, other.values)


def test_a_patched_softmax_shows_in_the_captured_attentions():
    """Zeroing layer 0's attention probabilities: its captured attentions are the patched values,
    and the logits and layer 1's attentions equal eager with the attention output zeroed (GPT-2:
    ``c_proj`` then sees zeros)."""
    model, reference = gpt2(), gpt2()
    ids = torch.randint(1, 100, (2, 6))
    pg = PatchableGraph(model, ids, use_cache=False, **CAPTURE)
    handle = reference.transformer.h[0].attn.c_proj.register_forward_pre_hook(
        lambda module, args: (torch.zeros_like(args[0]),))
    expected = reference(ids, use_cache=False, **CAPTURE)
    handle.remove()
    with pg.patch({"transformer.h_0.attn.softmax": ZeroPatch()}):
        out = pg(ids, use_cache=False, **CAPTURE)
    assert torch.equal(out.attentions[0], torch.zeros_like(expected.attentions[0]))
    assert torch.equal(out.attentions[1], expected.attentions[1])
    assert torch.equal(out.logits, expected.logits)
    assert same(out.hidden_states, expected.hidden_states)


def test_gradients_through_captured_attentions_equal_eager():
    model, reference = llama(), llama()
    ids = torch.randint(1, 100, (1, 5))
    pg = PatchableGraph(model, ids, use_cache=False, **CAPTURE)
    out = pg(ids, use_cache=False, **CAPTURE)
    expected = reference(ids, use_cache=False, **CAPTURE)
    (out.attentions[1].sum() + out.hidden_states[1].pow(2).sum()).backward()
    (expected.attentions[1].sum() + expected.hidden_states[1].pow(2).sum()).backward()
    for (name, param), (_, other) in zip(model.named_parameters(), reference.named_parameters()):
        assert (param.grad is None) == (other.grad is None), name
        if param.grad is not None:
            assert torch.equal(param.grad, other.grad), name


def test_over_a_bridged_model_each_value_is_captured_once():
    """A bridge calls the user's modules, whose hooks fire themselves: nothing is forwarded twice."""
    model, reference = llama(), llama()
    ids = torch.randint(1, 100, (1, 5))
    nnbridge.bridge(model, ids, use_cache=False)
    pg = PatchableGraph(model, ids, use_cache=False, **CAPTURE)
    assert_same_outputs(pg(ids, use_cache=False, **CAPTURE), reference(ids, use_cache=False, **CAPTURE))


def test_a_loaded_patchable_graph_captures_outputs():
    model, reference = llama(), llama()
    ids = torch.randint(1, 100, (1, 5))
    buffer = io.BytesIO()
    PatchableGraph(model, ids, use_cache=False, **CAPTURE).save(buffer)
    buffer.seek(0)
    loaded = PatchableGraph.load(buffer, llama())
    assert_same_outputs(loaded(ids, use_cache=False, **CAPTURE), reference(ids, use_cache=False, **CAPTURE))


def test_generate_returns_the_attentions_and_hidden_states_of_every_step():
    model, reference = llama(), llama()
    ids = torch.randint(1, 100, (1, 5))
    pg = PatchableGraph(model, ids)
    kwargs = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, **CAPTURE)
    out, expected = pg.generate(ids, **kwargs), reference.generate(ids, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    for name in ("attentions", "hidden_states"):
        steps, expected_steps = getattr(out, name), getattr(expected, name)
        assert len(steps) == len(expected_steps) == 4
        for step, expected_step in zip(steps, expected_steps):
            assert same(step, expected_step), name


def _graphs(pg):
    return {id(module): module for extraction in pg.extractions for module in extraction.root.modules()
            if isinstance(module, GraphModuleBase)}


def test_graphs_of_a_model_that_never_captures_have_no_hooks_and_those_standing_in_for_hooked_modules_forward():
    """A torch hook would put every graph call on nn.Module's slower path: a graph gets the
    forwarding hook only once the module it stands in for holds transformers' capturing hooks."""
    model, reference = llama(), llama()
    ids = torch.randint(1, 100, (1, 5))
    pg = PatchableGraph(model, ids, use_cache=False)
    assert torch.equal(pg(ids, use_cache=False).logits, reference(ids, use_cache=False).logits)
    assert not [g for g in _graphs(pg).values() if g._forward_hooks]
    assert_same_outputs(pg(ids, use_cache=False, **CAPTURE), reference(ids, use_cache=False, **CAPTURE))
    forwarded = [g for g in _graphs(pg).values() if g._forward_hooks]
    hooked = [m for m in model.modules() if capturing_hooks(m)]
    assert hooked and len(forwarded) >= len(hooked)
    assert len(forwarded) < len(_graphs(pg))


def test_hooks_installed_inside_a_call_the_root_extraction_serves_are_forwarded():
    """The model's and the decorated model's own code run (opaque), so a capturing config read
    there makes no new root extraction: transformers installs its hooks inside the call."""
    model, reference = llama(), llama()
    ids = torch.randint(1, 100, (1, 5))
    options = ExtractionOptions(classes_to_skip_compiling={type(model), type(model.model)})
    pg = PatchableGraph(model, ids, options=options, use_cache=False)
    assert not [m for m in model.modules() if capturing_hooks(m)]
    for config in (model.config, reference.config):
        config.output_attentions = config.output_hidden_states = True
    extractions = len(pg.extractions)
    assert_same_outputs(pg(ids, use_cache=False), reference(ids, use_cache=False))
    assert len(pg.extractions) == extractions


def test_a_hook_registered_between_calls_brings_the_forwarding_up_to_date_before_the_next():
    model = llama()
    ids = torch.randint(1, 100, (1, 5))
    pg = PatchableGraph(model, ids, use_cache=False)
    layer = pg.extractions[0].root.model.layers[0]
    capture = pg.__dict__["_capture"]
    capture.sync()
    assert not layer._forward_hooks
    install_all_output_capturing_hooks(model.model)  # as transformers does in a capturing forward
    capture.sync()
    assert layer._forward_hooks
