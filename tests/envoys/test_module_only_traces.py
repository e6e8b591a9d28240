"""A trace that reads only module inputs and outputs runs the model as is: no extraction, nnsight's
numbers. A trace that may read an op is extracted first (nnbridge.envoys.op_reads)."""

from __future__ import annotations

import copy

import nnsight
import pytest
from nnsight.intervention.interleaver import OutOfOrderError
import torch

import nnbridge
from nnbridge.inplace.bridging import bridge_of
from nnbridge.graph.op_point import LISTENED, OpPointContainer
from nnbridge.envoys.op_reads import attribute_reads, forward_arguments, may_be_op
from nnbridge.errors import NNBridgeError
from nnbridge.envoys import BridgeEnvoy
from utils import PROMPTS, language_model
from utils import gemma3, gpt2, llama

IDS = torch.tensor([[5, 17, 42, 8, 99, 3, 61, 7]])


def _pair(factory=gpt2):
    """(nnbridge wrapper, nnsight wrapper over an untouched copy, the bridged module)."""
    model = factory()
    reference = copy.deepcopy(model)
    return nnbridge.NNsight(model), nnsight.NNsight(reference), model


def _extractions(module: torch.nn.Module) -> int:
    """Extractions kept, the whole model's and those of modules extracted alone (lazily)."""
    state = bridge_of(module)
    return 0 if state is None else sum(len(d.all_extractions()) for d in state.dispatchers.values())


def test_module_reads_and_writes_run_eagerly_with_nnsights_numbers():
    bridged, reference, module = _pair()
    modules_before = len(list(module.named_modules()))
    with bridged.trace(IDS):
        hidden = bridged.transformer.h[0].output[0].save()
        bridged.transformer.h[1].mlp.output[:] = 0
        logits = bridged.lm_head.output.save()
    with reference.trace(IDS):
        hidden_ref = reference.transformer.h[0].output[0].save()
        reference.transformer.h[1].mlp.output[:] = 0
        logits_ref = reference.lm_head.output.save()
    assert torch.equal(hidden, hidden_ref) and torch.equal(logits, logits_ref)
    assert _extractions(module) == 0
    assert len(list(module.named_modules())) == modules_before  # no op points registered


def _down_proj_input(model: torch.nn.Module, replace=None) -> list[torch.Tensor]:
    """Hook the untouched Llama's layer-0 ``down_proj``: its input is the MLP's ``mul`` op value
    ``(1, seq, 128)``; ``replace`` (value -> value), if given, replaces it. Returns the seen values."""
    seen: list[torch.Tensor] = []

    def hook(module, args):
        seen.append(args[0])
        return None if replace is None else (replace(args[0]),)
    model.model.layers[0].mlp.down_proj.register_forward_pre_hook(hook)
    return seen


def test_op_read_extracts_and_serves_the_eager_value():
    bridged, reference, module = _pair(llama)
    with bridged.trace(IDS):
        bridged.model.layers[0].output.save()
    assert _extractions(module) == 0
    with bridged.trace(IDS):
        mul = bridged.model.layers[0].mlp.mul.output.save()
    assert _extractions(module) >= 1
    seen = _down_proj_input(reference._module)
    reference._module(IDS)
    assert torch.equal(mul, seen[0])
    # op envoys known: a module-only trace afterwards still runs eagerly, with nnsight's numbers
    with bridged.trace(IDS):
        out = bridged.lm_head.output.save()
    with reference.trace(IDS):
        out_ref = reference.lm_head.output.save()
    assert torch.equal(out, out_ref)


def _read_mul(model):
    return model.model.layers[0].mlp.mul.output.save()


def test_op_read_inside_a_helper_function_is_seen():
    bridged, _, module = _pair(llama)
    with bridged.trace(IDS):
        value = _read_mul(bridged)
    assert _extractions(module) >= 1 and value.shape == (1, 8, 128)


def test_op_read_by_getattr_string_is_seen():
    bridged, _, module = _pair(llama)
    with bridged.trace(IDS):
        value = getattr(bridged.model.layers[0].mlp, "mul").output.save()
    assert _extractions(module) >= 1 and value.shape == (1, 8, 128)


def test_op_name_built_at_run_time_fails_loudly_with_the_fix():
    model = llama()
    bridged = nnbridge.NNsight(model, envoys=BridgeEnvoy)
    # "mul" built inside the trace body, invisible to the scan (a name holding the string is seen)
    with pytest.raises(AttributeError, match="not known yet.*model.extract"):
        with bridged.trace(IDS):
            getattr(bridged.model.layers[0].mlp, bytes([109, 117, 108]).decode()).output.save()
    with pytest.raises(AttributeError, match="mul"):  # nnsight's default module envoys: nnsight's error
        default = nnbridge.NNsight(llama())
        with default.trace(IDS):
            getattr(default.model.layers[0].mlp, bytes([109, 117, 108]).decode()).output.save()
    bridged.extract(IDS)  # the op is known now, but the trace's code still names none: the note says so
    with pytest.raises(OutOfOrderError) as raised:
        with bridged.trace(IDS):
            getattr(bridged.model.layers[0].mlp, bytes([109, 117, 108]).decode()).output.save()
    assert "eager_module_traces = False" in "\n".join(getattr(raised.value, "__notes__", []))
    bridged.eager_module_traces = False
    with bridged.trace(IDS):
        value = getattr(bridged.model.layers[0].mlp, bytes([109, 117, 108]).decode()).output.save()
    seen = _down_proj_input(model := llama())
    model(IDS)
    assert torch.equal(value, seen[0])


def test_hooked_op_point_makes_a_module_only_trace_run_the_graphs():
    bridged, reference, module = _pair(llama)
    bridged.extract(IDS)
    point = module.get_submodule("model.layers.0.mlp.mul")
    handle = point.register_forward_hook(lambda m, args, out: torch.zeros_like(out))
    with bridged.trace(IDS):
        logits = bridged.lm_head.output.save()
    handle.remove()
    assert not torch.equal(logits, reference._module(IDS).logits)
    _down_proj_input(reference._module, torch.zeros_like)
    with reference.trace(IDS):
        logits_ref = reference.lm_head.output.save()
    assert torch.equal(logits, logits_ref)


def test_running_eagerly_refuses_while_an_op_point_is_hooked():
    model = llama()
    nnbridge.bridge(model, IDS)
    state = bridge_of(model)
    handle = model.get_submodule("model.layers.0.mlp.mul").register_forward_hook(lambda m, a, o: o)
    with pytest.raises(NNBridgeError, match="mul.*patches or torch hooks"):
        with state.running_eagerly():
            pass
    assert state.eager == 0
    handle.remove()
    with state.running_eagerly():
        assert torch.equal(model(IDS).logits, llama()(IDS).logits)


def test_cache_runs_the_graphs():
    bridged, _, module = _pair()
    with bridged.trace(IDS) as tracer:
        cache = tracer.cache(ops=True)
    assert _extractions(module) >= 1
    assert any(key.endswith("softmax") for key in cache.keys())


def test_generation_with_module_reads_runs_eagerly():
    model, reference = language_model(nnbridge), language_model(nnsight)
    logits = {}
    for name, wrapper in (("bridged", model), ("nnsight", reference)):
        with wrapper.generate(PROMPTS[0], max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
            steps = list().save()
            for _ in tracer.iter[0:3]:
                steps.append(wrapper.lm_head.output)
            tokens = tracer.result.save()
        logits[name] = (steps, tokens)
    assert _extractions(model._module) == 0
    (steps, tokens), (steps_ref, tokens_ref) = logits["bridged"], logits["nnsight"]
    assert torch.equal(tokens, tokens_ref) and len(steps) == len(steps_ref) == 3
    assert all(torch.equal(a, b) for a, b in zip(steps, steps_ref))


def test_reading_a_modules_input_by_key_runs_eagerly():
    """``.inputs[1]["attention_mask"]``: a key of a value, though ``attention_mask`` is also the
    name of a placeholder op (nnsight's ``test_invoker_input_ids`` reads ``invoker.inputs[1]
    ["input_ids"]`` in nnsight 0.7)."""
    model, reference = language_model(nnbridge), language_model(nnsight)
    seen = {}
    for name, wrapper in (("bridged", model), ("nnsight", reference)):
        with wrapper.trace() as tracer:
            with tracer.invoke(PROMPTS[0]):
                mask = wrapper.transformer.inputs[1]["attention_mask"].save()
            with tracer.invoke(PROMPTS[1]):
                logits = wrapper.lm_head.output.save()
        seen[name] = (mask, logits)
    assert _extractions(model._module) == 0
    assert all(torch.equal(a, b) for a, b in zip(seen["bridged"], seen["nnsight"]))


def test_stored_edit_reading_an_op_runs_the_graphs():
    bridged, reference, module = _pair(llama)
    with bridged.edit(inplace=True):
        bridged.model.layers[0].mlp.mul.output[:] = 0
    with bridged.trace(IDS):
        out = bridged.lm_head.output.save()
    assert _extractions(module) >= 1
    _down_proj_input(reference._module, torch.zeros_like)
    assert torch.equal(out, reference._module(IDS).logits)


@pytest.mark.no_extraction_cache  # each case extracts for itself (the key tells sdpa and eager apart now)
@pytest.mark.parametrize("factory", [gpt2, llama, lambda: llama("sdpa"), gemma3], ids=["gpt2", "llama", "llama-sdpa",
                                                                                    "gemma3"])
def test_every_op_envoy_name_counts_as_a_possible_op(factory):
    model = factory()
    nnbridge.bridge(model, IDS)
    model(IDS)
    registered = bridge_of(model).registered
    arguments = forward_arguments(model)
    # an op of a later invocation is read through ``invocation_<k>``, itself a possible op
    missed = [name for holder, name in registered
              if not isinstance(holder, OpPointContainer) and not may_be_op(name, frozenset(), arguments)]
    assert registered and not missed


def test_a_string_held_by_a_name_counts_as_read():
    path = "model.layers.0.mlp.mul"
    code = compile("model.get(path).output.save()", "<body>", "exec")
    assert "mul" in attribute_reads([code], lambda name: path if name == "path" else None)
    bridged, reference, module = _pair(llama)
    with bridged.trace(IDS):
        value = bridged.get(path).output.save()
    seen = _down_proj_input(reference._module)
    reference._module(IDS)
    assert torch.equal(value, seen[0])


def test_module_names_and_envoy_api_are_not_ops():
    model = gpt2()
    reads = attribute_reads([compile("model.transformer.h[0].attn.c_attn.output.save(); x.grad; x.sum()",
                                     "<body>", "exec")], lambda name: None)
    assert reads == {"transformer", "h", "attn", "c_attn", "output", "grad"}
    assert not any(may_be_op(name, frozenset(), forward_arguments(model)) for name in reads)


def test_source_operations_are_not_ops():
    """``envoy.source.<name>`` names nnsight ``.source`` operations (``split_1``: shaped like an op
    name); with module reads only, the trace runs as in nnsight, ``.source`` touched first or not."""
    code = compile("m.transformer.h[0].attn.source.split_1.output.save()", "<body>", "exec")
    assert attribute_reads([code], lambda name: None) == {"transformer", "h", "attn", "source", "output"}
    values = {}
    for library in (nnbridge, nnsight):
        model = language_model(library)
        model.transformer.h[0].attn.source  # noqa: B018  (touched before the first trace)
        with model.trace(PROMPTS[0]):
            model.transformer.h[0].attn.c_attn.output = torch.zeros_like(model.transformer.h[0].attn.c_attn.output)
            split = model.transformer.h[0].attn.source.split_1.output.save()
            logits = model.lm_head.output.save()
        values[library.__name__] = (split, logits)
        if library is nnbridge:
            assert _extractions(model._module) == 0
    (split, logits), (split_ref, logits_ref) = values["nnbridge"], values["nnsight"]
    assert torch.equal(logits, logits_ref) and all(torch.equal(a, b) for a, b in zip(split, split_ref))
    assert all(torch.all(part == 0) for part in split)


class _Repeated(torch.nn.Module):
    """Children named like ATen ops (``linear``) and a ModuleList: module reads, not op reads."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

    def forward(self, x):
        for _ in range(3):
            x = self.linear(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _repeated_pair():
    torch.manual_seed(0)
    model = _Repeated()
    reference = copy.deepcopy(model)
    return nnbridge.NNsight(model), nnsight.NNsight(reference), model


def test_child_module_named_like_an_op_is_a_module_read():
    """``model.linear`` is the child module (a module's op points never take a child's name), so
    the trace runs eagerly with nnsight's numbers; ``model.linear.linear`` is the op inside it."""
    bridged, reference, module = _repeated_pair()
    x = torch.randn(1, 4)
    values = []
    for model in (bridged, reference):
        with model.trace(x) as tracer:
            seen = list().save()
            for _ in tracer.iter[:3]:
                seen.append(model.linear.output.clone())
        with model.trace(x):
            first = model.layers[0].output.save()
            model.layers[1].output[:] = 0
            out = model.output.save()
        values.append((seen, first, out))
    (seen, first, out), (seen_ref, first_ref, out_ref) = values
    assert len(seen) == 3 and all(torch.equal(a, b) for a, b in zip(seen, seen_ref))
    assert torch.equal(first, first_ref) and torch.equal(out, out_ref) and torch.all(out == 0)
    assert _extractions(module) == 0
    with bridged.trace(x):
        op = bridged.linear.linear.output.save()
    # ``linear`` runs thrice per forward: the whole model's graphs serve it (invocation_<k> points)
    assert len(bridge_of(module).dispatcher.all_extractions()) == 1
    assert torch.equal(op, torch.nn.functional.linear(x, module.linear.weight, module.linear.bias))


def test_read_chains_follow_the_envoys_modules():
    bridged, _, _ = _repeated_pair()
    names = {"m": bridged}

    def reads(source: str, resolve=names.get) -> set[str]:
        return attribute_reads([compile(source, "<body>", "exec")], resolve)
    assert reads("m.linear.output.clone().save(); m.layers[1].input.shape") == set()
    assert reads("m.output.hidden_states") == set()  # a value's attribute, not an envoy's
    assert reads("m.layers[0].linear.output") == {"linear", "output"}  # the op inside layers.0
    assert reads("m.linear.source.linear_0.output") == {"source", "output"}
    # nothing known about the root: every name counts
    assert reads("m.linear.output", lambda name: None) == {"linear", "output"}
    assert reads("m.output.hidden_states", lambda name: None) == {"output", "hidden_states"}
    # an index past the list, or a root the block assigns, stops the walk: the rest counts
    assert reads("m.layers[7].linear") == {"linear"}
    assert reads("m = other\nm.linear.output") == {"linear", "output"}
    # a helper's own argument is not the block's name
    assert reads("def helper(m):\n    return m.linear.output\nhelper(m)") == {"linear", "output"}


@pytest.mark.integration  # end to end: a second process
def test_module_only_trace_of_a_plain_model_imports_no_exporter():
    """Registering transformers' cache pytrees imports torch._dynamo and transformers' exporters
    (seconds): it waits for the first graph call, which an eager trace never makes."""
    import subprocess
    import sys
    code = """
import sys, torch, nnsight, nnbridge
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
x = torch.randn(2, 3)
model = nnbridge.NNsight(net)
with model.trace(x):
    hidden = model[0].output.save()
assert torch.equal(hidden, net[0](x))
assert "transformers.exporters.exporter_dynamo" not in sys.modules
with model.trace(x):
    relu = model[1].relu.output.save()
assert torch.equal(relu, torch.relu(net[0](x)))
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                            env={**__import__("os").environ})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_plain_call_outside_a_trace_runs_eagerly_unless_an_op_point_listens():
    """``model(...)`` outside a trace is nnsight's plain module call: the model's own code, no
    extraction; a hooked op point (which acts only in graphs) makes it run the graphs."""
    bridged, reference, module = _pair(llama)
    bridged.extract(IDS)
    mask = torch.ones_like(IDS)
    assert torch.equal(bridged(IDS, attention_mask=mask).logits, reference(IDS, attention_mask=mask).logits)
    assert _extractions(module) == 1  # a new call structure, served eagerly
    handle = module.get_submodule("model.layers.0.mlp.mul").register_forward_hook(
        lambda m, args, out: torch.zeros_like(out))
    hooked = bridged(IDS).logits
    handle.remove()
    _down_proj_input(reference._module, torch.zeros_like)
    assert torch.equal(hooked, reference(IDS).logits)
    bridged.eager_module_traces = False
    bridged(IDS, attention_mask=mask)
    assert _extractions(module) == 2


def test_listened_is_told_by_listeners_hooks_and_copies_of_hooked_points():
    """Bridge.listened answers from the set of listened op points (op_point.LISTENED) when it is
    empty: every way a point becomes listened or stops must reach that set."""
    model, other = llama(), llama()
    nnbridge.bridge(model, IDS)
    nnbridge.bridge(other, IDS)
    state, other_state = bridge_of(model), bridge_of(other)
    point = model.get_submodule("model.layers.0.mlp.mul")
    assert not state.listened() and not other_state.listened()
    handle = point.register_forward_hook(lambda m, a, o: o)
    assert state.listened() and not other_state.listened()
    copied = copy.deepcopy(point)  # a copy keeps torch's hook dicts, so it is listened too
    handle.remove()
    assert not state.listened() and point not in LISTENED and copied in LISTENED
    del copied

    def listener(value):
        return value
    point.add_listener(listener)
    assert state.listened() and point in LISTENED
    point.remove_listener(listener)
    assert not state.listened() and point not in LISTENED
    # hooked again: a module-only trace runs the graphs, and the hook's zeros reach the logits
    handle = point.register_forward_hook(lambda m, args, out: torch.zeros_like(out))
    bridged = nnbridge.NNsight(model)
    with bridged.trace(IDS):
        logits = bridged.lm_head.output.save()
    handle.remove()
    reference = llama()
    _down_proj_input(reference, torch.zeros_like)
    assert torch.equal(logits, reference(IDS).logits)


def test_a_model_bridged_before_it_is_wrapped_traces_as_nnsight():
    """nnbridge.bridge first, nnbridge.NNsight after: nnsight wraps the modules as they were before
    bridging (before, it took the bridged bodies as the modules' own and a module-only trace hit
    RecursionError)."""
    model = gpt2()
    reference = nnsight.NNsight(copy.deepcopy(model))
    nnbridge.bridge(model, IDS)
    bridged = nnbridge.NNsight(model)
    with bridged.trace(IDS):
        hidden = bridged.transformer.h[0].output.save()
        logits = bridged.lm_head.output.save()
    with reference.trace(IDS):
        hidden_reference = reference.transformer.h[0].output.save()
        logits_reference = reference.lm_head.output.save()
    assert torch.equal(hidden, hidden_reference) and torch.equal(logits, logits_reference)
    with bridged.trace(IDS):
        added = bridged.transformer.h[0].add.output.save()
        logits = bridged.lm_head.output.save()
    assert added.shape == hidden.shape and torch.equal(logits, logits_reference)
    with bridged.trace(IDS):
        bridged.transformer.h[0].output[:] = 0
        zeroed = bridged.lm_head.output.save()
    with reference.trace(IDS):
        reference.transformer.h[0].output[:] = 0
        zeroed_reference = reference.lm_head.output.save()
    assert torch.equal(zeroed, zeroed_reference)
    assert torch.equal(model(IDS).logits, reference._module(IDS).logits)


def _class_swap_run(wrap, graphs: bool = False):
    """The outputs and the direct call's value (``m.seen``) of the script of
    ``tests/corpus/found/class_swap_of_a_shared_child.py`` (a class swap of a shared child, which
    an opaque root calls, then a direct call), each call traced through ``wrap(model)``'s
    ``.output`` (``wrap=None``: the model called eagerly)."""
    from corpus import Edit
    from corpus.found import class_swap_of_a_shared_child as found
    torch.manual_seed(0)
    model = found.Root().eval()
    torch.manual_seed(1)
    wrapped = None
    outputs = []
    for step in found.script():
        if isinstance(step, Edit):
            step.fn(model)
            continue
        with torch.set_grad_enabled(step.grad):
            if wrap is None:
                outputs.append(model(*step.args).detach())
                continue
            if wrapped is None:
                wrapped = wrap(model)
                if graphs:
                    wrapped.eager_module_traces = False
            with wrapped.trace(*step.args):
                out = wrapped.output.save()
            outputs.append(out.detach())
    return outputs, model.__dict__["seen"]


@pytest.mark.parametrize("graphs", [False, True], ids=["module-only", "graphs"])
def test_a_class_swap_nnsight_does_not_see_gives_eagers_numbers(graphs):
    """nnsight's envoys keep the class's forward they found when built, so after
    ``module.__class__ = Sub`` a call from an opaque root's code, and a direct call, still run the
    old class's forward through plain nnsight 0.8.1; nnbridge.NNsight gives each module its current
    class's forward before every run, and eager's numbers."""
    eager = _class_swap_run(None)
    plain = _class_swap_run(nnsight.NNsight)
    ours = _class_swap_run(nnbridge.NNsight, graphs=graphs)
    assert all(torch.equal(a, b) for a, b in zip(ours[0], eager[0])) and torch.equal(ours[1], eager[1])
    assert not torch.equal(plain[1], eager[1]), "plain nnsight now sees the class swap: nnbridge need not follow it"
