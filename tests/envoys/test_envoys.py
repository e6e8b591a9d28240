"""nnsight drop-in: the same trace bodies under nnsight and nnbridge give equal values; ops are envoys."""

import warnings

import nnsight
import pytest
import torch

import nnbridge
from nnbridge import ProbePatch, ZeroPatch
from nnbridge.inplace.bridging import bridge_of
from utils import PROMPTS, assert_same, gpt2_tokenizer_dir, head, layer, text_model, tokenizer, wrap

# -- trace bodies, each run under nnsight and under nnbridge -------------------------------------
def attention(model, i):
    return layer(model, i).attn if hasattr(model, "transformer") else layer(model, i).self_attn


def reads(model):
    # transformers' default use_cache=True: decoder layers and attention receive the DynamicCache
    with model.trace(PROMPTS[0]):
        args, kwargs = layer(model, 0).inputs
        inputs0 = nnsight.save((args, kwargs))
        attn0 = attention(model, 0).output.save()
        out0 = layer(model, 0).output.save()
        inp1 = layer(model, 1).input.save()
        logits = head(model).output.save()
        output = model.output.save()
    return inputs0, attn0, out0, inp1, logits, output


def writes(model):
    with model.trace(PROMPTS[0]):
        layer(model, 0).output[:] = 0
        logits = head(model).output.save()
    return logits


def skips(model):
    with model.trace(PROMPTS[0]):
        layer(model, 1).skip(layer(model, 0).output)
        logits = head(model).output.save()
    return logits


def invokes(model):
    with model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(PROMPTS[0]):
            embeddings = layer(model, 0).input
            barrier()
            first = head(model).output.save()
        with tracer.invoke(PROMPTS[0]):
            barrier()
            layer(model, 0).input = embeddings * 2
            second = head(model).output.save()
    return first, second


def generation(model):
    with model.generate(PROMPTS[1], max_new_tokens=3, do_sample=False) as tracer:
        steps = nnsight.save(list())
        for _ in tracer.iter[0:3]:
            steps.append(head(model).output)
        ids = tracer.result.save()
    return steps, ids


def gradients(model):
    with model.trace(PROMPTS[0]):
        hidden = layer(model, 0).output
        loss = head(model).output.sum()
        with loss.backward():
            grad = hidden.grad.save()
    return grad


def edits(model):
    with model.edit() as (tracer, edited):
        layer(edited, 0).output[:] = 0
    with model.trace(PROMPTS[0]):
        logits = head(model).output.save()
    model.clear_edits()
    return logits


def sessions(model):
    with model.session():
        with model.trace(PROMPTS[0]):
            hidden = layer(model, 0).output
        with model.trace(PROMPTS[1]):
            layer(model, 0).output[:, -1] = hidden[:, -1]
            logits = nnsight.save(head(model).output)
    return logits


def caches(model):
    with model.trace(PROMPTS[0]) as tracer:
        cache = tracer.cache(modules=[layer(model, 0), head(model)])
    return cache[layer(model, 0).path].output, cache[head(model).path].output


BODIES = [reads, writes, skips, invokes, generation, gradients, edits, sessions, caches]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("body", BODIES, ids=lambda b: b.__name__)
def test_same_values_as_nnsight(kind, body):
    expected = body(wrap(nnsight, kind))
    bridged_model = wrap(nnbridge, kind)
    got = body(bridged_model)
    assert_same(got, expected)
    assert bridge_of(bridged_model._module) is not None


def test_nnbridge_wraps_an_nnsight_model():
    inner = nnsight.NNsight(text_model("gpt2"))
    model = nnbridge.NNsight(inner)
    ids = torch.randint(0, 50257, (1, 5))
    with model.trace(ids, use_cache=False):
        sm = model.transformer.h[1].attn.softmax.output.save()
        logits = model.lm_head.output.save()
    reference = text_model("gpt2")(ids, use_cache=False, output_attentions=True)
    assert torch.equal(sm, reference.attentions[1]) and torch.equal(logits, reference.logits)


# -- op envoys ------------------------------------------------------------------------------------
@pytest.fixture
def gpt2_model():
    model = wrap(nnbridge, "gpt2")
    ids = model.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return model, ids


def test_softmax_op_equals_output_attentions_and_zeroing_changes_logits(gpt2_model):
    model, _ = gpt2_model
    with model.trace(PROMPTS[0]):
        attn = model.transformer.h[0].attn.softmax.output.save()
        logits = model.lm_head.output.save()
    ids = model.tokenizer(PROMPTS[0], return_tensors="pt")
    reference = text_model("gpt2")(**ids, output_attentions=True)
    assert torch.equal(attn, reference.attentions[0]) and torch.equal(logits, reference.logits)
    with model.trace(PROMPTS[0]):
        model.transformer.h[0].attn.softmax.output[:] = 0
        zeroed = model.lm_head.output.save()
    assert not torch.allclose(zeroed, logits)


def test_op_values_match_the_graph_layer(gpt2_model):
    model, _ = gpt2_model
    ids = model.tokenizer(PROMPTS[0], return_tensors="pt")
    with model.trace(PROMPTS[0]):
        traced = model.transformer.h[1].attn.softmax.output.save()
    pg = nnbridge.PatchableGraph(text_model("gpt2"), **ids)
    probe = ProbePatch()
    with pg.patch({"transformer.h_1.attn.softmax": probe}):
        pg(**ids)
    assert torch.equal(traced, probe.activation)
    with model.trace(PROMPTS[0]):
        model.transformer.h[1].attn.softmax.output = torch.zeros_like(model.transformer.h[1].attn.softmax.output)
        zeroed = model.lm_head.output.save()
    with pg.patch({"transformer.h_1.attn.softmax": ZeroPatch()}):
        assert torch.equal(pg(**ids).logits, zeroed)


def test_per_invoke_edit_touches_only_its_rows(gpt2_model):
    model, _ = gpt2_model

    def run(edit_second):
        with model.trace() as tracer:
            with tracer.invoke(PROMPTS[1]):
                first = model.lm_head.output.save()
            with tracer.invoke(PROMPTS[1]):
                if edit_second:
                    model.transformer.h[0].attn.softmax.output[:] = 0
                second = model.lm_head.output.save()
        return first, second

    clean_first, clean_second = run(False)
    first, second = run(True)
    assert torch.equal(first, clean_first), "the other invoke's rows are untouched"
    assert not torch.allclose(second, clean_second)


def test_op_grad_equals_autograd(gpt2_model):
    model, _ = gpt2_model
    with model.trace(PROMPTS[0]):
        attn = model.transformer.h[0].attn.softmax.output
        loss = model.lm_head.output.pow(2).mean()
        with loss.backward():
            grad = attn.grad.save()
    reference = text_model("gpt2")
    ids = model.tokenizer(PROMPTS[0], return_tensors="pt")
    captured = {}
    nnbridge.bridge(reference, **ids)
    handle = reference.get_submodule("transformer.h.0.attn.softmax").register_forward_hook(
        lambda m, a, o: (o.register_hook(lambda g: captured.setdefault("grad", g)), None)[1])
    reference(**ids).logits.pow(2).mean().backward()
    handle.remove()
    assert torch.equal(grad, captured["grad"])


def test_ops_source_cannot_reach(gpt2_model):
    """nnsight 0.8.1's ``.source`` on GPT-2 attention lists ``attention_interface_1`` for the call
    into ``eager_attention_forward``, a separate function: the softmax inside
    ``nn.functional.softmax`` and the ``attn_weights @ value`` matmul in it are not reachable
    (drilling in needs a trace and crashes on F.softmax). They are ops here. (The block's residual
    ``+`` is a named assignment, which 0.8.1's ``.source`` does reach, as ``hidden_states_1``.)"""
    model, _ = gpt2_model
    source_names = [n for n in dir(nnsight.TransformersModel(text_model("gpt2"), tokenizer=tokenizer(),
                                                             task="text-generation").transformer.h[0].attn.source)
                    if not n.startswith("_")]
    assert not any("softmax" in n or n.startswith("matmul") for n in source_names)
    with model.trace(PROMPTS[0]):  # in execution order, as nnsight requires
        block_in = model.transformer.h[0].input.save()
        ln = model.transformer.h[0].ln_1.layer_norm.output.save()        # inside F.layer_norm
        value = model.transformer.h[0].attn.transpose_1.output.save()
        probs = model.transformer.h[0].attn.softmax.output.save()        # inside F.softmax
        context = model.transformer.h[0].attn.matmul_1.output.save()     # attn_weights @ value
        attn_out = model.transformer.h[0].attn.output[0].save()
        residual = model.transformer.h[0].add.output.save()              # attn_output + residual
    assert torch.equal(context, torch.matmul(probs, value))
    assert torch.equal(residual, attn_out + block_in)
    assert torch.equal(ln, torch.nn.functional.layer_norm(block_in, (64,), text_model("gpt2").transformer.h[0].ln_1.weight,
                                                          text_model("gpt2").transformer.h[0].ln_1.bias))


def test_op_paths_in_tracer_cache(gpt2_model):
    model, _ = gpt2_model
    with model.trace(PROMPTS[0]) as tracer:
        cache = tracer.cache(modules=[model.transformer.h[0].attn.softmax, model.transformer.h[1].add])
        direct = model.transformer.h[0].attn.softmax.output.save()
    assert torch.equal(cache["model.transformer.h.0.attn.softmax"].output, direct)
    assert cache["model.transformer.h.1.add"].output.shape == (1, 8, 64)


def test_generation_steps_reach_ops(gpt2_model):
    model, _ = gpt2_model
    with model.generate(PROMPTS[1], max_new_tokens=3, do_sample=False) as tracer:
        shapes = nnsight.save(list())
        for _ in tracer.iter[0:3]:
            shapes.append(model.transformer.h[0].attn.softmax.output.shape)
    assert [s[-1] for s in shapes] == [5, 6, 7] and [s[-2] for s in shapes] == [5, 1, 1]


def test_names_paths_and_errors(gpt2_model):
    _, ids = gpt2_model
    # op-aware errors on module envoys: envoys=BridgeEnvoy (by default modules have nnsight's Envoy)
    model = nnbridge.LanguageModel(text_model("gpt2"), tokenizer=tokenizer(), envoys=nnbridge.envoys.BridgeEnvoy)
    with pytest.raises(AttributeError, match="ops are not known yet.*model.extract"):
        model.transformer.h[0].attn.softmax
    model.extract(**ids)
    softmax = model.transformer.h[0].attn.softmax
    assert softmax.node_path == "transformer.h_0.attn.softmax"
    assert model.get("transformer.h.0.attn.softmax") is softmax
    assert "softmax" in dir(model.transformer.h[0].attn) and "matmul_1" in dir(model.transformer.h[0].attn)
    with pytest.raises(AttributeError, match="has no attribute or op 'sofmax'; closest ops: \\['softmax'"):
        model.transformer.h[0].attn.sofmax
    with pytest.raises(AttributeError, match="sofmax"):
        with model.trace(PROMPTS[0]):
            model.transformer.h[0].attn.sofmax.output.save()
    assert repr(softmax) == "OpPoint(softmax: Tensor(2, 4, 8, 8))" and "(ops): " in repr(model.transformer.h[0].attn)
    # bad indexes keep nnsight's exception type (AttributeError) and say what is there
    with pytest.raises(AttributeError, match="model.transformer.h \\(ModuleList\\) has no entry '999'; it holds 2"):
        model.transformer.h[999]


def test_opaque_module_ops_explain_why():
    from fixtures.data_dependent_module import DataDependentModule

    model = nnbridge.NNsight(DataDependentModule().eval(), envoys=nnbridge.envoys.BridgeEnvoy)
    x = torch.randn(2, 3)
    model.extract(x)
    with pytest.raises(AttributeError, match="is opaque .*GuardOnDataDependent|is opaque"):
        model.branchy.softmax
    with model.trace(x):
        inner = model.branchy.inner.linear.output.save()
    assert inner.shape == (2, 3)


def test_mixed_patching_with_nnsight(gpt2_model):
    """Torch hooks on a module and on an op point, a PatchableGraph patch and an nnsight
    intervention in one forward. Order on the op's value: torch pre-hooks, graph patches,
    nnsight (``.output``), torch forward hooks; the module hook sees the result of all of them."""
    model, _ = gpt2_model
    ids = model.tokenizer(PROMPTS[0], return_tensors="pt")
    model.extract(**ids, use_cache=False)
    module = model._module
    pg = nnbridge.PatchableGraph(module, **ids, use_cache=False)
    point = module.get_submodule("transformer.h.0.attn.softmax")
    log = {}
    h1 = point.register_forward_pre_hook(lambda m, args: (log.setdefault("pre", args[0].clone()), (args[0] + 1,))[1])
    h2 = point.register_forward_hook(lambda m, args, out: (log.setdefault("hook", out.clone()), out * 2)[1])
    h3 = module.transformer.h[0].attn.register_forward_hook(lambda m, args, out: (log.setdefault("attn", out[0].clone()),
                                                                                   None)[1])
    try:
        with pg.patch({"transformer.h_0.attn.softmax": nnbridge.AddPatch(value=10.0)}):
            with model.trace(PROMPTS[0], use_cache=False):  # the structure pg was extracted for
                value = model.transformer.h[0].attn.transpose_1.output.save()
                seen = model.transformer.h[0].attn.softmax.output.save()
                model.transformer.h[0].attn.softmax.output = seen * 3
                logits = model.lm_head.output.save()
    finally:
        for h in (h1, h2, h3):
            h.remove()
    assert torch.equal(seen, log["pre"] + 1 + 10.0), "nnsight sees the pre-hooked, patched value"
    assert torch.equal(log["hook"], seen * 3), "forward hooks see nnsight's edit"
    final = seen * 3 * 2
    context = torch.matmul(final, value).transpose(1, 2).reshape(1, 8, 64)
    attn = module.transformer.h[0].attn
    assert torch.equal(log["attn"], attn.resid_dropout(attn.c_proj(context)))
    assert logits.shape == (1, 8, 50257)


def test_nnbridge_after_nnsight_was_used_on_the_same_model():
    module = text_model("gpt2")
    ids = torch.randint(0, 50257, (1, 5))
    plain = nnsight.NNsight(module)
    with plain.trace(ids, use_cache=False):
        before = plain.lm_head.output.save()
    model = nnbridge.NNsight(module)
    with model.trace(ids, use_cache=False):
        sm = model.transformer.h[0].attn.softmax.output.save()
        after = model.lm_head.output.save()
    with plain.trace(ids, use_cache=False):  # the first wrapper still works on the bridged module
        again = plain.lm_head.output.save()
    reference = text_model("gpt2")(ids, use_cache=False, output_attentions=True)
    assert torch.equal(before, after) and torch.equal(after, again) and torch.equal(sm, reference.attentions[0])


def test_op_input_and_skip(gpt2_model):
    model, _ = gpt2_model
    with model.trace(PROMPTS[0]):
        scores = model.transformer.h[0].attn.add.output.save()
        probs_in = model.transformer.h[0].attn.softmax.input.save()
        probs = model.transformer.h[0].attn.softmax.output.save()
    assert torch.equal(probs_in, probs), "an op point's input is the op's value before any edit"
    assert torch.equal(probs, torch.softmax(scores, dim=-1))
    uniform = torch.full_like(probs, 1 / 8)
    with model.trace(PROMPTS[0]):
        model.transformer.h[0].attn.softmax.skip(uniform)
        skipped = model.transformer.h[0].attn.matmul_1.output.save()
    with model.trace(PROMPTS[0]):
        value = model.transformer.h[0].attn.transpose_1.output.save()
    assert torch.equal(skipped, torch.matmul(uniform, value))


def test_only_graphs_with_a_wanted_op_inside_pay_for_the_trace_checks(gpt2_model):
    """While a trace runs, a graph asks nnsight per node only when some location below it is wanted
    (parked at or cached); the others run their plain code."""
    from nnbridge.inplace.bridging import bridge_of

    model, _ = gpt2_model
    model.lazy_op_traces = False  # the whole model's graphs (lazily, h[0].attn alone would be)
    with model.trace(PROMPTS[0]):
        probs = model.transformer.h[0].attn.softmax.output.save()
    root = bridge_of(model._module).dispatcher.all_extractions()[-1].root
    checked = {name for name, graph in root.named_modules() if "_trace_forward" in graph.__dict__}
    assert {"", "transformer", "transformer.h.0", "transformer.h.0.attn"} <= checked
    assert not any(name.startswith("transformer.h.1") for name in checked)
    assert probs.shape == (1, 4, 8, 8)
    with model.trace(PROMPTS[0]) as tracer:  # a cached op is wanted too (nnsight's observers)
        cache = tracer.cache(modules=[model.transformer.h[1].attn.softmax])
    assert "_trace_forward" in root.get_submodule("transformer.h.1.attn").__dict__
    with model.trace(PROMPTS[0]):
        direct = model.transformer.h[1].attn.softmax.output.save()
    assert torch.equal(cache["model.transformer.h.1.attn.softmax"].output, direct)


def test_module_the_extracted_calls_never_ran_says_so():
    from fixtures.unused_submodule import UnusedSubmoduleModule

    model = nnbridge.NNsight(UnusedSubmoduleModule(), envoys=nnbridge.envoys.BridgeEnvoy)
    model.extract(torch.randn(2, 3))
    assert model.used.linear is not None  # an op of a module that ran
    with pytest.raises(AttributeError, match="model.unused \\(Linear\\) has no attribute or op 'linear', and no"
                                             " ops: the extracted calls of the model did not run it"):
        model.unused.linear


def test_several_invokes_serve_0d_op_values_whole():
    """nnsight narrows served values to an invoke's rows by their leading dim; 0-d op values have
    none (before: ``IndexError: tuple index out of range`` from ``tracer.cache()`` or from reading
    one). They are served whole; everything else is narrowed as nnsight does."""
    outputs = {}
    for library in (nnsight, nnbridge):
        model = wrap(library, "gpt2")
        with model.trace() as tracer:
            with tracer.invoke("Hello world"):
                cache = tracer.cache(ops=True) if library is nnbridge else tracer.cache()
                if library is nnbridge:
                    first = model.transformer.new_ones.output.save()
            with tracer.invoke(["The cat sat on", "a b"]):
                if library is nnbridge:
                    second = model.transformer.new_ones.output.save()
                last = model.transformer.h[1].output[0].save()
        outputs[library] = (cache.model.transformer.h[0].output[0], last)
    assert first.dim() == 0 and torch.equal(first, second)
    for a, b in zip(outputs[nnsight], outputs[nnbridge]):
        assert torch.equal(a, b)


def test_extract_on_a_model_without_parameters_names_the_rule():
    """A parameterless model is left unbridged (nnsight runs it as is): extract() says so, and a
    trace of its module envoys still equals nnsight's."""
    model = nnbridge.NNsight(torch.nn.ReLU())
    x = torch.randn(2, 3)
    with pytest.raises(nnbridge.NNBridgeError, match="ReLU has no parameters"):
        model.extract(x)
    with model.trace(x):
        out = model.output.save()
    assert torch.equal(out, torch.relu(x))
