"""Lazy extraction (issue 12, "extract lazily, only the modules a trace actually reaches below the
module level"): an nnsight trace whose code reads op envoys off known modules extracts those
modules alone; the rest of the model runs its own code. Every value, write, gradient, name and
side effect must equal a whole-model extraction (``lazy_op_traces = False``) and nnsight.
"""

from __future__ import annotations

import copy
import random

import nnsight
import numpy
import pytest
import torch

import nnbridge
from nnbridge.inplace.bridging import bridge_of
from nnbridge.envoys.op_reads import op_owners
from nnbridge.errors import NNBridgeError
from utils import PROMPTS, language_model
from utils import gpt2, llama

IDS = torch.tensor([[5, 17, 42, 8, 99, 3, 61, 7]])


def _wrappers(factory=gpt2):
    """(lazy nnbridge wrapper, whole-model nnbridge wrapper, nnsight wrapper), each over its own
    copy of one model."""
    model = factory()
    whole = nnbridge.NNsight(copy.deepcopy(model))
    whole.lazy_op_traces = False
    reference = nnsight.NNsight(copy.deepcopy(model))
    return nnbridge.NNsight(model), whole, reference


def _extracted(wrapper) -> dict[str, int]:
    """``{dispatcher path ('' = the whole model): extractions made}``, dispatchers with none left out."""
    state = bridge_of(wrapper._module)
    return {d.path: len(d.history) for d in state.dispatchers.values() if d.history}


def _op_names(module: torch.nn.Module) -> list[str]:
    return sorted(name for name, sub in module.named_modules() if type(sub).__name__ == "OpPoint")


def test_an_op_read_extracts_only_its_module():
    lazy, whole, reference = _wrappers()
    seen = {}
    for wrapper in (lazy, whole):
        with wrapper.trace(IDS):
            seen[wrapper, "probs"] = wrapper.transformer.h[1].attn.softmax.output.save()
            seen[wrapper, "hidden"] = wrapper.transformer.h[1].output[0].save()
            seen[wrapper, "logits"] = wrapper.lm_head.output.save()
    with reference.trace(IDS):
        hidden = reference.transformer.h[1].output[0].save()
        logits = reference.lm_head.output.save()
    assert _extracted(lazy) == {"transformer.h.1.attn": 1}
    assert _extracted(whole) == {"": 1}
    assert torch.equal(seen[lazy, "probs"], seen[whole, "probs"])
    assert torch.equal(seen[lazy, "hidden"], hidden) and torch.equal(seen[lazy, "logits"], logits)
    assert torch.equal(seen[whole, "logits"], logits)


# GPT-2 and Llama get twin tests, not one parametrized body: op_owners places reads by the module
# chains the trace's code names, so each body must spell its model's paths out.
def test_a_module_extracted_alone_has_the_whole_extractions_op_names_gpt2():
    lazy, whole, _ = _wrappers(gpt2)
    seen = {}
    for wrapper in (lazy, whole):
        with wrapper.trace(IDS):
            seen[wrapper, "value"] = wrapper.transformer.h[1].add.output.save()
    _same_names(seen, lazy, whole, "transformer.h.1")


def test_a_module_extracted_alone_has_the_whole_extractions_op_names_llama():
    lazy, whole, _ = _wrappers(llama)
    seen = {}
    for wrapper in (lazy, whole):
        with wrapper.trace(IDS):
            seen[wrapper, "value"] = wrapper.model.layers[1].add.output.save()
    _same_names(seen, lazy, whole, "model.layers.1")


def _same_names(seen, lazy, whole, layer: str) -> None:
    assert _extracted(lazy) == {layer: 1}
    names = _op_names(lazy._module.get_submodule(layer))
    assert len(names) > 20 and names == _op_names(whole._module.get_submodule(layer))
    assert torch.equal(seen[lazy, "value"], seen[whole, "value"])


def test_writes_and_skips_equal_the_whole_model_gpt2():
    lazy, whole, _ = _wrappers(gpt2)
    seen = {}
    for wrapper in (lazy, whole):
        with wrapper.trace(IDS):
            wrapper.transformer.h[0].attn.softmax.output[:] = 0
            wrapper.transformer.h[1].skip(wrapper.transformer.h[1].input)
            seen[wrapper, "logits"] = wrapper.lm_head.output.save()
        with wrapper.trace(IDS):
            seen[wrapper, "clean"] = wrapper.lm_head.output.save()
    _same_logits(seen, lazy, whole, "transformer.h.0.attn")


def test_writes_and_skips_equal_the_whole_model_llama():
    lazy, whole, _ = _wrappers(llama)
    seen = {}
    for wrapper in (lazy, whole):
        with wrapper.trace(IDS):
            wrapper.model.layers[0].self_attn.softmax.output[:] = 0
            wrapper.model.layers[1].skip(wrapper.model.layers[1].input)
            seen[wrapper, "logits"] = wrapper.lm_head.output.save()
        with wrapper.trace(IDS):
            seen[wrapper, "clean"] = wrapper.lm_head.output.save()
    _same_logits(seen, lazy, whole, "model.layers.0.self_attn")


def _same_logits(seen, lazy, whole, attention: str) -> None:
    assert set(_extracted(lazy)) == {attention}
    assert torch.equal(seen[lazy, "logits"], seen[whole, "logits"])
    assert torch.equal(seen[lazy, "clean"], seen[whole, "clean"])
    assert not torch.equal(seen[lazy, "logits"], seen[lazy, "clean"])


def test_op_gradient_equals_the_whole_model():
    lazy, whole, _ = _wrappers()
    seen = {}
    for wrapper in (lazy, whole):
        with wrapper.trace(IDS):
            probs = wrapper.transformer.h[0].attn.softmax.output
            loss = wrapper.lm_head.output.pow(2).mean()
            with loss.backward():
                seen[wrapper, "grad"] = probs.grad.save()
    assert set(_extracted(lazy)) == {"transformer.h.0.attn"}
    assert torch.equal(seen[lazy, "grad"], seen[whole, "grad"])


def test_a_later_trace_extracts_the_next_module_only():
    lazy, whole, _ = _wrappers()
    with lazy.trace(IDS):
        first = lazy.transformer.h[0].attn.softmax.output.save()
    with lazy.trace(IDS):
        again = lazy.transformer.h[0].attn.softmax.output.save()
        second = lazy.transformer.h[1].mlp.act.mul.output.save()
    with whole.trace(IDS):
        first_ref = whole.transformer.h[0].attn.softmax.output.save()
        second_ref = whole.transformer.h[1].mlp.act.mul.output.save()
    assert _extracted(lazy) == {"transformer.h.0.attn": 1, "transformer.h.1.mlp.act": 1}
    assert torch.equal(first, again) and torch.equal(first, first_ref) and torch.equal(second, second_ref)


def test_a_whole_model_extraction_serves_later_traces():
    lazy, _, _ = _wrappers()
    lazy.extract(IDS)
    with lazy.trace(IDS):
        lazy.transformer.h[0].attn.softmax.output.save()
    assert _extracted(lazy) == {"": 1}


def test_generation_steps_equal_the_whole_model():
    lazy, whole, reference = language_model(nnbridge), language_model(nnbridge), language_model(nnsight)
    whole.lazy_op_traces = False
    results = {}
    for name, wrapper in (("lazy", lazy), ("whole", whole)):
        with wrapper.generate(PROMPTS[0], max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
            steps = list().save()
            for _ in tracer.iter[0:3]:
                steps.append(wrapper.transformer.h[0].attn.softmax.output)
                wrapper.transformer.h[1].attn.softmax.output[:] = 0
            tokens = tracer.result.save()
        results[name] = (steps, tokens)
    with reference.generate(PROMPTS[0], max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
        clean = tracer.result.save()
    assert set(_extracted(lazy)) == {"transformer.h.0.attn", "transformer.h.1.attn"}
    (steps, tokens), (steps_whole, tokens_whole) = results["lazy"], results["whole"]
    assert len(steps) == 3 and all(torch.equal(a, b) for a, b in zip(steps, steps_whole))
    assert steps[1].shape[-2] == 1  # a decode step's
    assert torch.equal(tokens, tokens_whole) and clean.shape == tokens.shape


class _Stateful(torch.nn.Module):
    """BatchNorm (statistics updated in train mode), dropout (random), a counter buffer, and a
    block with ops: a warm-up run must leave none of them changed."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(6)
        self.drop = torch.nn.Dropout(0.5)
        self.block = _Block()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return self.block(self.drop(self.norm(x)))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x):
        return torch.relu(self.linear(x)) * 2


def test_the_warm_up_run_leaves_no_trace():
    torch.manual_seed(0)
    model = _Stateful().train()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 6)
    lazy, plain = nnbridge.NNsight(model), nnsight.NNsight(reference)
    torch.manual_seed(1)
    with lazy.trace(x):
        relu = lazy.block.relu.output.save()
        out = lazy.output.save()
    torch.manual_seed(1)
    with plain.trace(x):
        block_in = plain.block.input.save()
        out_ref = plain.output.save()
    assert _extracted(lazy) == {"block": 1}
    assert torch.equal(out, out_ref) and torch.equal(relu * 2, out_ref)
    assert torch.equal(relu, torch.relu(reference.block.linear(block_in)))
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, reference.get_buffer(name)), name
    assert int(model.calls) == 1


class _Drawing(_Stateful):
    """Also draws from Python's and numpy's RNGs in forward."""

    def forward(self, x):
        return super().forward(x) * (1 + random.random() + float(numpy.random.rand()))


def test_the_warm_up_run_draws_nothing_from_python_or_numpy_rngs():
    torch.manual_seed(0)
    model = _Drawing().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 6)
    lazy, plain = nnbridge.NNsight(model), nnsight.NNsight(reference)
    results = []
    for wrapper in (lazy, plain):
        random.seed(3)
        numpy.random.seed(3)
        with wrapper.trace(x):
            if wrapper is lazy:
                wrapper.block.relu.output.save()
            out = wrapper.output.save()
        results.append((out, random.random(), float(numpy.random.rand())))
    assert _extracted(lazy) == {"block": 1}
    assert torch.equal(results[0][0], results[1][0]) and results[0][1:] == results[1][1:]


def test_a_cache_argument_is_updated_once():
    from transformers import DynamicCache
    lazy, _, reference = _wrappers()
    seen = {}
    caches = []
    for wrapper in (lazy, reference):
        cache = DynamicCache()
        with wrapper.trace(IDS, past_key_values=cache, use_cache=True):
            if wrapper is lazy:
                wrapper.transformer.h[1].attn.softmax.output.save()
            seen[wrapper, "logits"] = wrapper.lm_head.output.save()
        caches.append(cache)
    assert set(_extracted(lazy)) == {"transformer.h.1.attn"}
    assert torch.equal(seen[lazy, "logits"], seen[reference, "logits"])
    mine, theirs = caches
    assert mine.get_seq_length() == theirs.get_seq_length() == IDS.shape[1]
    for a, b in zip(mine.layers, theirs.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_loop_over_the_layers_extracts_each_layers_module():
    lazy, whole, _ = _wrappers()
    seen = {}
    for wrapper in (lazy, whole):
        with wrapper.trace(IDS):
            values = list().save()
            for layer in wrapper.transformer.h:
                values.append(layer.attn.softmax.output)
        seen[wrapper] = values
    assert _extracted(lazy) == {"transformer.h.0.attn": 1, "transformer.h.1.attn": 1}
    assert len(seen[lazy]) == 2 and all(torch.equal(a, b) for a, b in zip(seen[lazy], seen[whole]))
    assert not torch.equal(seen[lazy][0], seen[lazy][1])


def test_enumerate_over_a_constant_slice_extracts_the_sliced_layers_only():
    lazy, whole, reference = _wrappers()
    seen = {}
    for wrapper in (lazy, whole):
        with wrapper.trace(IDS):
            values = list().save()
            for i, layer in enumerate(wrapper.transformer.h[1:]):
                values.append((i, layer.mlp.act.mul.output))
            seen[wrapper, "logits"] = wrapper.lm_head.output.save()
        seen[wrapper] = values
    with reference.trace(IDS):
        logits = reference.lm_head.output.save()
    assert _extracted(lazy) == {"transformer.h.1.mlp.act": 1}
    [(index, value)] = seen[lazy]
    assert index == 0 and torch.equal(value, seen[whole][0][1])
    assert torch.equal(seen[lazy, "logits"], logits) and torch.equal(seen[whole, "logits"], logits)


def test_a_variable_index_in_a_range_loop_extracts_every_layers_module():
    lazy, whole, _ = _wrappers()
    seen = {}
    for wrapper in (lazy, whole):
        with wrapper.trace(IDS):
            values = list().save()
            for i in range(len(wrapper.transformer.h)):
                values.append(wrapper.transformer.h[i].add.output)
        seen[wrapper] = values
    assert _extracted(lazy) == {"transformer.h.0": 1, "transformer.h.1": 1}
    assert len(seen[lazy]) == 2 and all(torch.equal(a, b) for a, b in zip(seen[lazy], seen[whole]))


def _read_every_layer(wrapper):
    values = []
    for layer in wrapper.transformer.h:
        values.append(layer.attn.softmax.output.save())
    return values


def test_a_loop_in_a_function_the_trace_calls_extracts_the_whole_model():
    lazy, whole, _ = _wrappers()
    seen = {}
    for wrapper in (lazy, whole):
        with wrapper.trace(IDS):
            seen[wrapper] = _read_every_layer(wrapper)
    assert _extracted(lazy) == {"": 1}  # op_owners places the trace body's own chains only
    assert all(torch.equal(a, b) for a, b in zip(seen[lazy], seen[whole]))


def test_loop_reads_it_cannot_place_extract_the_whole_model():
    lazy, whole, _ = _wrappers()
    names = ["attn.softmax", "mlp.act.mul"]
    with lazy.trace(IDS):
        values = list().save()
        for name in names:  # a path string held by a loop variable
            values.append(lazy.transformer.h[0].get(name).output)
    assert _extracted(lazy) == {"": 1}
    with whole.trace(IDS):
        probs = whole.transformer.h[0].attn.softmax.output.save()
        product = whole.transformer.h[0].mlp.act.mul.output.save()
    assert len(values) == 2 and torch.equal(values[0], probs) and torch.equal(values[1], product)


def test_a_reassigned_loop_variable_extracts_the_whole_model():
    lazy, whole, _ = _wrappers()
    with lazy.trace(IDS):
        for layer in lazy.transformer.h[:1]:
            layer = lazy.transformer.h[1]  # the read below is off layer 1, not the iterated layer 0
            value = layer.attn.softmax.output.save()
    with whole.trace(IDS):
        expected = whole.transformer.h[1].attn.softmax.output.save()
    assert _extracted(lazy) == {"": 1}
    assert torch.equal(value, expected)


def test_a_name_no_module_has_falls_back_to_the_whole_models_error():
    lazy, whole, _ = _wrappers()
    errors = []
    for wrapper in (lazy, whole):
        with pytest.raises(AttributeError) as raised:
            with wrapper.trace(IDS):
                wrapper.transformer.h[1].attn.softmax_9.output.save()
        errors.append(str(raised.value))
    assert _extracted(lazy)[""] == 1  # the whole model, after the lazy attempt found no such op
    assert "softmax_9" in errors[0] and errors[0] == errors[1]


def test_op_point_hooks_need_the_whole_model():
    lazy, _, _ = _wrappers()
    with lazy.trace(IDS):
        lazy.transformer.h[0].attn.softmax.output.save()
        clean = lazy.lm_head.output.save()
    state = bridge_of(lazy._module)
    handle = lazy._module.get_submodule("transformer.h.0.attn.softmax").register_forward_hook(
        lambda module, args, output: output * 0)
    try:
        with pytest.raises(NNBridgeError, match="lazily"):
            with state.lazily([lazy._module.transformer.h[0].attn]):
                pass
        with lazy.trace(IDS):
            lazy.transformer.h[0].attn.softmax.output.save()
            hooked = lazy.lm_head.output.save()
        assert "" in _extracted(lazy)
    finally:
        handle.remove()
    assert not torch.equal(hooked, clean)  # the hook zeroed layer 0's attention


def test_lazy_op_traces_off_extracts_the_whole_model():
    lazy, _, _ = _wrappers()
    lazy.lazy_op_traces = False
    with lazy.trace(IDS):
        lazy.transformer.h[0].attn.softmax.output.save()
    assert _extracted(lazy) == {"": 1}


def _codes(text: str):
    return [compile(text, "<trace>", "exec")]


def test_op_owners_places_each_read():
    model = gpt2()
    envoy = nnsight.NNsight(model)

    def owners(text):
        return op_owners(_codes(text), lambda name: envoy if name == "model" else None, model, known_ops=())
    assert owners("model.transformer.h[0].output.save()") == {}
    assert owners("model.transformer.h[0].attn.softmax.output.save(); model.transformer.h[1].add.output") == {
        "transformer.h.0.attn": frozenset({"softmax"}), "transformer.h.1": frozenset({"add"})}
    assert owners("model.add.output") is None  # the model's own op
    h0, h1 = "transformer.h.0", "transformer.h.1"
    softmax = {f"{h0}.attn": frozenset({"softmax"}), f"{h1}.attn": frozenset({"softmax"})}
    assert owners("for layer in model.transformer.h: layer.attn.softmax.output") == softmax
    assert owners("for i in range(2): model.transformer.h[i].attn.softmax.output") == softmax
    assert owners("for i in range(2): model.transformer.h[i + 1].attn.softmax.output") == softmax
    assert owners("for _, layer in enumerate(model.transformer.h[:1], 1): layer.add.output") == {h0: frozenset({"add"})}
    assert owners("for layer in reversed(model.transformer.h[-1:]): layer.add.output") == {h1: frozenset({"add"})}
    assert owners("for a, b in zip(model.transformer.h[:1], model.transformer.h[1:]): a.add; b.attn.softmax") == {
        h0: frozenset({"add"}), f"{h1}.attn": frozenset({"softmax"})}
    assert owners("for layer in model.transformer.h: pass\nlayer.attn.softmax.output") is None  # after the loop
    assert owners("for layer in model.transformer.h:\n layer = model.transformer.h[0]\n layer.add") is None
    assert owners("for i in range(2):\n i = '1'\n model.transformer.h[i].add") is None
    assert owners("range = reversed\nfor i in range(2): model.transformer.h[i].add") is None
    assert owners("model.transformer.h[j].add") is None  # j: no value in scope
    assert owners("for i in range(2): model.transformer.h[i:].add") is None  # a computed slice
    assert owners("for layer in model.transformer: layer.add") is None  # not a container
    assert owners("for layer in [model.transformer.h[0]]: layer.add") is None
    assert owners("[layer.add for layer in model.transformer.h]") is None  # nested code
    assert owners("model.get('transformer.h.0.attn.softmax')") is None  # a string path
    assert owners("model.transformer.h[0].attn.invocation_1.softmax.output") is None
    assert owners("tracer.cache(ops=True)") is None  # every op
    assert owners("tracer.cache(**options)") is None  # perhaps every op
    assert owners("tracer.cache()") == {}  # module envoys only, as nnsight's
    # a string used as a key of a module's value is not a name of an envoy (input_ids: a placeholder)
    assert owners("x = invoker.inputs[1]['input_ids'].save()") == {}
    assert owners("model.transformer.h[0].output['input_ids']") == {}
    assert owners("model.transformer.h[0].attn['input_ids']") is None  # an envoy subscript: getattr
    assert owners("x = invoker.inputs[1]['input_ids']; model.get('input_ids')") is None


def test_op_owners_paths_follow_modules_moved_or_replaced_since_the_last_walk(monkeypatch):
    """op_owners keeps each model's paths from its last walk of the module tree and walks again
    only when a read's owner is not at its kept path; a trace reading no possible op, or a
    registered op of a module at its kept path, walks nothing."""
    from nnbridge.envoys import op_reads

    model = gpt2()
    envoy = nnsight.NNsight(model)
    walks = []
    walk = op_reads.named_real_modules
    monkeypatch.setattr(op_reads, "named_real_modules", lambda module: walks.append(1) or walk(module))

    def owners(text, known=()):
        return op_owners(_codes(text), lambda name: envoy if name == "model" else None, model, known_ops=known)
    assert owners("model.transformer.h[0].output.save()") == {} and walks == []
    assert owners("model.transformer.h[0].add.output") == {"transformer.h.0": frozenset({"add"})} and len(walks) == 1
    assert owners("model.transformer.h[0].add.output", {"add"}) == {"transformer.h.0": frozenset({"add"})}
    assert len(walks) == 1  # a registered op name, the module where the last walk found it
    h0, h1 = model.transformer.h[0], model.transformer.h[1]
    model.transformer.h[0], model.transformer.h[1] = h1, h0  # moved: each is walked to its new path
    assert owners("model.transformer.h[1].add.output", {"add"}) == {"transformer.h.1": frozenset({"add"})}
    assert owners("model.transformer.h[0].attn.softmax", {"softmax"}) == {"transformer.h.0.attn": frozenset({"softmax"})}
    replacement = copy.deepcopy(h1)
    model.transformer.h[0] = replacement  # replaced: the new module's path, found by a new walk
    before = len(walks)
    assert owners("model.transformer.h[0].add", {"add"}) == {"transformer.h.0": frozenset({"add"})}
    assert len(walks) == before + 1
    # a module no longer in the model (read through an envoy held since) owns no path: whole model
    old = nnsight.NNsight(h1)
    assert op_owners(_codes("layer.add.output"), lambda name: old if name == "layer" else None, model,
                     known_ops={"add"}) is None
    # reads in more entries than LAZY_ENTRIES of one container walk for the containers
    text = "; ".join(f"model.transformer.h[{i}].add" for i in range(2)) + "; model.transformer.h[0].attn.softmax"
    assert set(owners(text, {"add", "softmax"})) == {"transformer.h.0", "transformer.h.1", "transformer.h.0.attn"}


def test_reads_in_more_than_two_layers_extract_the_whole_model():
    """Reads in three of a container's entries: the whole model (its layers reused from one
    export) costs less than three modules exported one by one."""
    model = type(gpt2())(type(gpt2().config)(n_layer=3, n_embd=64, n_head=4, vocab_size=100)).eval()
    envoy = nnsight.NNsight(model)

    def owners(text):
        return op_owners(_codes(text), lambda name: envoy if name == "model" else None, model, known_ops=())
    assert owners("for layer in model.transformer.h: layer.attn.softmax.output") is None
    assert owners("model.transformer.h[0].add; model.transformer.h[1].attn.softmax; model.transformer.h[2].add") is None
    assert owners("for layer in model.transformer.h[1:]: layer.attn.softmax.output") == {
        f"transformer.h.{i}.attn": frozenset({"softmax"}) for i in (1, 2)}
    assert owners("model.transformer.h[2].attn.softmax; model.transformer.h[2].add") == {
        "transformer.h.2.attn": frozenset({"softmax"}), "transformer.h.2": frozenset({"add"})}


class _Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Block()

    def forward(self, x):
        return self.block(self.block(x))


def test_a_module_called_twice_per_forward_gets_the_whole_models_invocations():
    torch.manual_seed(0)
    model = _Twice()
    reference = copy.deepcopy(model)
    lazy = nnbridge.NNsight(model)
    x = torch.randn(2, 6)
    with lazy.trace(x):
        first = lazy.block.relu.output.save()
    assert "" in _extracted(lazy)  # found in the warm-up: the whole model's graphs served the trace
    assert "invocation_1" in dict(model.block.named_children())
    assert torch.equal(first, torch.relu(reference.block.linear(x)))
    assert not bridge_of(model).lazy_allowed([model.block])
    with lazy.trace(x):
        again = lazy.block.relu.output.save()
        later = lazy.block.invocation_1.relu.output.save()
    assert _extracted(lazy)[""] == 1 and torch.equal(again, first)
    assert torch.equal(later, torch.relu(reference.block.linear(reference.block(x))))


def test_a_cache_of_named_modules_runs_eagerly_with_nnsights_values():
    lazy, _, reference = _wrappers()
    caches = []
    for wrapper in (lazy, reference):
        with wrapper.trace(IDS) as tracer:
            cache = tracer.cache(modules=[wrapper.transformer.h[0], wrapper.transformer.h[1].mlp])
        caches.append(cache)
    assert _extracted(lazy) == {}
    mine, theirs = caches
    assert sorted(mine.keys()) == sorted(theirs.keys()) and len(mine.keys()) == 2
    for key in theirs.keys():
        assert torch.equal(mine[key].output[0] if isinstance(mine[key].output, tuple) else mine[key].output,
                           theirs[key].output[0] if isinstance(theirs[key].output, tuple) else theirs[key].output)


def test_a_cache_of_an_op_extracts_its_module_and_a_held_op_the_whole_model():
    lazy, whole, _ = _wrappers()
    with lazy.trace(IDS) as tracer:
        cache = tracer.cache(modules=[lazy.transformer.h[0].attn.softmax])
    assert _extracted(lazy) == {"transformer.h.0.attn": 1}
    with whole.trace(IDS):
        expected = whole.transformer.h[0].attn.softmax.output.save()
    assert torch.equal(cache["model.transformer.h.0.attn.softmax"].output, expected)
    with lazy.trace(IDS):
        lazy.transformer.h[1].attn.softmax.output.save()  # makes the op envoy
    held = [lazy.transformer.h[1].attn.softmax]  # an op envoy in a variable: not placed by the code
    with lazy.trace(IDS) as tracer:
        cache = tracer.cache(modules=held)
    assert _extracted(lazy)[""] == 1
    assert "model.transformer.h.1.attn.softmax" in cache.keys()


def test_warm_up_outside_lazily_is_refused():
    model = gpt2()
    nnbridge.bridge(model)
    with pytest.raises(NNBridgeError, match="only inside Bridge.lazily"):
        bridge_of(model).warm_up(lambda: model(IDS))


def test_inputs_with_autograd_history_are_copied_for_the_warm_up():
    lazy, whole, _ = _wrappers()
    embeds = torch.nn.functional.embedding(IDS, whole._module.transformer.wte.weight) * 1.0  # a non-leaf
    assert embeds.grad_fn is not None
    seen = {}
    for wrapper in (lazy, whole):
        with wrapper.trace(inputs_embeds=embeds):
            seen[wrapper] = wrapper.transformer.h[0].attn.softmax.output.save()
    assert _extracted(lazy) == {"transformer.h.0.attn": 1}
    assert torch.equal(seen[lazy], seen[whole])
