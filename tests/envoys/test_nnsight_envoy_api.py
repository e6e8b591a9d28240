"""nnsight 0.8.1 parity, second batch: envoy classes by default, ``.source`` next to op envoys,
loading from a directory, the printed tree, old spellings and errors, memory after ``del``."""

import gc
import weakref
from collections import OrderedDict

import nnsight
import pytest
import torch

import nnbridge
from nnbridge.graph.op_point import OpPoint, OpPointContainer
from nnbridge.envoys import BridgeEnvoy
from nnsight.intervention.interleaver import OutOfOrderError
from transformers import AutoTokenizer
from utils import PROMPTS, gpt2_tokenizer_dir, language_model, text_model, tokenizer

def nested_net():
    """Two levels of Sequential around two Linears and a ReLU (5 -> 10 -> 2), seeded."""
    torch.manual_seed(0)
    inner = torch.nn.Sequential(OrderedDict([("act", torch.nn.ReLU()), ("layer2", torch.nn.Linear(10, 2))]))
    return torch.nn.Sequential(OrderedDict([("layer1", torch.nn.Linear(5, 10)), ("inner", inner)]))


# -- 1. envoy classes without envoys= (nnsight tests/envoys/test_envoys.py, TestEnvoysParam) ------------
def test_default_module_envoys_are_nnsights_envoy_before_and_after_a_trace():
    model = nnbridge.NNsight(nested_net())
    for envoy in model.modules():
        if envoy is not model:
            assert type(envoy) is nnsight.Envoy, envoy.path
    x = torch.randn(3, 5)
    with model.trace(x):
        relu = model.inner.act.relu.output.save()  # an op envoy
        out = model.output.save()
    reference = nested_net()
    assert torch.equal(out, reference(x))
    assert torch.equal(relu, torch.relu(reference.layer1(x)))
    for envoy in model.modules():
        if envoy is model:
            continue
        is_op = isinstance(envoy._module, (OpPoint, OpPointContainer))
        assert type(envoy) is (BridgeEnvoy if is_op else nnsight.Envoy), envoy.path
    assert model.inner.act.relu.node_path == "inner.act.relu"


def test_envoys_bridge_envoy_gives_op_aware_errors_on_modules():
    model = nnbridge.NNsight(nested_net(), envoys=BridgeEnvoy)
    model.extract(torch.randn(3, 5))
    assert type(model.inner.act) is BridgeEnvoy
    with pytest.raises(AttributeError, match="model.inner.act \\(ReLU\\) has no attribute or op 'rleu'; closest"):
        model.inner.act.rleu
    default = nnbridge.NNsight(nested_net())
    default.extract(torch.randn(3, 5))
    with pytest.raises(AttributeError, match="has attribute 'rleu'"):  # nnsight's own message
        default.inner.act.rleu


# -- 2. nnsight's .source and op envoys on one module ---------------------------------------------
def eager_reference():
    """Layer 0's attention probabilities ``(1, heads, seq, seq)``, its attention output (from
    nnsight's own ``.source``) and the logits ``(1, seq, vocab)`` of the untouched model."""
    model = text_model("gpt2")
    ids = tokenizer()(PROMPTS[0], return_tensors="pt")
    with torch.no_grad():
        out = model(**ids, output_attentions=True)
    reference = language_model(nnsight)
    with reference.trace(PROMPTS[0]):
        attention = reference.transformer.h[0].attn.source.attention_interface_1.output[0].save()
    return out.attentions[0], attention, out.logits


@pytest.mark.parametrize("source_first", [True, False], ids=["source-first", "ops-first"])
def test_source_and_op_envoys_of_one_module_both_serve(source_first):
    probabilities, attention, logits = eager_reference()
    model = language_model(nnbridge)
    attn = model.transformer.h[0].attn
    if source_first:
        assert "attention_interface_1" in str(attn.source)
    with model.trace(PROMPTS[0]):
        softmax = model.transformer.h[0].attn.softmax.output.save()
        first = model.lm_head.output.save()
    if not source_first:
        assert "attention_interface_1" in str(attn.source)
    with model.trace(PROMPTS[0]):
        sourced = model.transformer.h[0].attn.source.attention_interface_1.output[0].save()
        second = model.lm_head.output.save()
    with model.trace(PROMPTS[0]):
        softmax_again = model.transformer.h[0].attn.softmax.output.save()
        third = model.lm_head.output.save()
    assert torch.equal(softmax, probabilities) and torch.equal(softmax_again, probabilities)
    assert torch.equal(sourced, attention)
    for value in (first, second, third):
        assert torch.equal(value, logits)


def test_source_and_op_envoys_in_one_trace_on_different_calls():
    """One trace, two generation steps: the prefill reads a ``.source`` operation, the first
    decode step an op of the same module; both equal nnsight / eager."""
    model, reference = language_model(nnbridge), language_model(nnsight)
    with reference.generate(PROMPTS[0], max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
        for step in tracer.iter[0:1]:
            expected = reference.transformer.h[0].attn.source.attention_interface_1.output[1].save()
    with model.generate(PROMPTS[0], max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
        for step in tracer.iter[0:2]:
            if step == 0:
                sourced = model.transformer.h[0].attn.source.attention_interface_1.output[1].save()
            else:
                softmax = model.transformer.h[0].attn.softmax.output.save()
    assert torch.equal(sourced, expected)
    assert softmax.shape[-2] == 1 and torch.allclose(softmax.sum(-1), torch.ones(()))


@pytest.mark.parametrize("source_first", [True, False], ids=["source-first", "ops-first"])
def test_source_and_op_envoys_in_the_same_call_are_refused_with_the_rule_and_the_fix(source_first):
    """A call runs either the graph (ops) or nnsight's instrumented forward (``.source``): asking
    both of one call stops at nnsight's OutOfOrderError naming the location not reached, with a
    note naming the module, the rule and the fix."""
    model = language_model(nnbridge)
    attn = model.transformer.h[0].attn
    with pytest.raises(OutOfOrderError, match="attn.softmax.output.i0" if source_first
                       else "attn.source.attention_interface_1.output.i0") as raised:
        with model.trace(PROMPTS[0]):
            if source_first:
                attn.source.attention_interface_1.output[0].save()
                attn.softmax.output.save()
            else:
                attn.softmax.output.save()
                attn.source.attention_interface_1.output[0].save()
    note = "\n".join(getattr(raised.value, "__notes__", []))
    assert "'transformer.h.0.attn'" in note and "either its graph (ops) or nnsight's .source forward" in note
    assert "different calls" in note


def test_an_out_of_order_read_of_another_module_gets_no_source_note():
    model = language_model(nnbridge)
    with pytest.raises(OutOfOrderError) as raised:
        with model.trace(PROMPTS[0]):
            model.transformer.h[1].attn.softmax.output.save()
            model.transformer.h[0].attn.softmax.output.save()
    assert not any("nnsight's .source forward" in note for note in getattr(raised.value, "__notes__", []))


# -- op visits are counted even when no one waits at them (nnsight's occurrence per location) ------
def decode_softmax(model, read_before):
    """Layer 0's attention probabilities ``(1, heads, 1, seq + 1)`` at the first decode step, with
    step 0 reading either the same op or only the layer's output."""
    with model.generate(PROMPTS[0], max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
        for step in tracer.iter[0:2]:
            if step == 1:
                softmax = model.transformer.h[0].attn.softmax.output.save()
            elif read_before:
                model.transformer.h[0].attn.softmax.output.save()
            else:
                model.transformer.h[0].output.save()
    return softmax


def test_a_later_step_reaches_an_op_not_read_at_earlier_steps():
    model = language_model(nnbridge)
    expected = decode_softmax(model, read_before=True)
    assert expected.shape[-2] == 1
    assert torch.equal(decode_softmax(model, read_before=False), expected)
    assert torch.equal(decode_softmax(language_model(nnbridge), read_before=False), expected)


def test_an_op_that_already_ran_is_out_of_order_as_in_nnsight():
    """Reading layer 1's output then layer 0's softmax: the softmax of that call has run; nnsight
    refuses a module read this way, and so is the op read (not served from the next step)."""
    for library, name in ((nnsight, "attn"), (nnbridge, "attn.softmax")):
        model = language_model(library)
        with pytest.raises(OutOfOrderError, match=f"h.0.{name}.output.i0"):
            with model.generate(PROMPTS[0], max_new_tokens=2, min_new_tokens=2, do_sample=False):
                model.transformer.h[1].output.save()
                model.get(f"transformer.h.0.{name}").output.save()


# -- 4. the printed tree --------------------------------------------------------------------------
def test_printed_tree_before_extraction_is_nnsights():
    assert repr(language_model(nnbridge)) == repr(language_model(nnsight))
    assert repr(nnbridge.NNsight(nested_net())) == repr(nnsight.NNsight(nested_net()))


def test_printed_tree_shows_ops_on_one_line_and_collapses_repeated_layers():
    model = language_model(nnbridge)
    model.lazy_op_traces = False  # the whole model is extracted, not h[0].attn alone
    with model.trace(PROMPTS[0]):  # the trace names an op, so the model is extracted
        model.transformer.h[0].attn.softmax.output.save()
        logits = model.lm_head.output.save()
    assert torch.equal(logits, text_model("gpt2")(**tokenizer()(PROMPTS[0], return_tensors="pt")).logits)
    printed = repr(model)
    assert "OpPoint(" not in printed
    assert "(h): ModuleList(\n      (0-1): 2 x GPT2Block(\n" in printed
    assert "(ln_f): LayerNorm(\n      (64,), eps=1e-05, elementwise_affine=True, bias=True\n" \
           "      (ops): 5 ops: input_, weight_, bias_, layer_norm, output_\n    )" in printed
    # constants are numbered per graph, so the layers' op lines are the same and listed once
    assert "ops, not the same in every entry" not in printed
    assert "(lm_head): Linear(\n    in_features=64, out_features=50257, bias=False\n" \
           "    (ops): 4 ops: input_, weight_, linear, output_\n  )" in printed
    assert repr(model.transformer.h[0].attn.softmax) == "OpPoint(softmax: Tensor(1, 4, 8, 8))"


def test_ops_summary_shows_the_first_and_last_names():
    from nnbridge.compat.nnsight.printing import ops_summary

    assert ops_summary(["a"]) == "1 op: a"
    assert ops_summary(list("abcdefgh")) == "8 ops: a, b, c, d, e, f, g, h"
    assert ops_summary(list("abcdefghi")) == "9 ops: a, b, c, d, e, f, ..., h, i"


# -- 3. loading from a directory ------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_gpt2(tmp_path_factory):
    """A directory with a tiny random GPT-2 (``save_pretrained``) and the GPT-2 tokenizer."""
    directory = tmp_path_factory.mktemp("gpt2")
    text_model("gpt2").save_pretrained(directory)
    tokenizer().save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("dispatch", [False, True], ids=["lazy", "dispatched"])
def test_language_model_loads_from_a_directory(saved_gpt2, dispatch):
    from transformers import AutoModelForCausalLM

    model = nnbridge.LanguageModel(saved_gpt2, dispatch=dispatch)  # as nnsight: no tokenizer= needed
    eager = AutoModelForCausalLM.from_pretrained(saved_gpt2).eval()
    ids = tokenizer()(PROMPTS[0], return_tensors="pt")
    with model.trace(PROMPTS[0]):
        normed = model.transformer.h[0].ln_1.layer_norm.output.save()
        logits = model.lm_head.output.save()
    with torch.no_grad():
        expected = eager(**ids).logits
        embedded = eager.transformer.wte(ids.input_ids) + eager.transformer.wpe(torch.arange(ids.input_ids.shape[1]))
    assert torch.equal(logits, expected)
    assert torch.equal(normed, eager.transformer.h[0].ln_1(embedded))
    with model.generate(PROMPTS[0], max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
        tokens = tracer.result.save()
    reference = nnsight.TransformersModel(saved_gpt2, dispatch=True, task="text-generation")
    with reference.generate(PROMPTS[0], max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
        expected_tokens = tracer.result.save()
    assert torch.equal(tokens, expected_tokens) and tokens.shape == (1, ids.input_ids.shape[1] + 3)


def test_transformers_model_reads_the_task_from_transformers_5_pipeline_paths():
    from nnbridge.compat.nnsight.loading import pipeline_class
    from transformers.pipelines.text_generation import TextGenerationPipeline

    assert pipeline_class("text-generation") is TextGenerationPipeline
    assert pipeline_class("no-such-task") is None and pipeline_class(None) is None


# -- 5. old spellings and bad names keep nnsight's exception types --------------------------------
@pytest.mark.filterwarnings("ignore:.*was never reached:UserWarning")  # an open loop ends so (nnsight)
def test_model_all_is_nnsights_deprecation_and_iterates_every_step():
    model = language_model(nnbridge)
    with pytest.warns(nnsight.NNsightDeprecationWarning, match=r"model.all\(\) is deprecated; use tracer.all\(\)"):
        with model.generate(PROMPTS[0], max_new_tokens=2, min_new_tokens=2, do_sample=False):
            shapes = nnsight.save([])
            for _ in model.all():
                shapes.append(model.transformer.h[0].attn.softmax.output.shape)
    assert [tuple(shape[-2:]) for shape in shapes] == [(8, 8), (1, 9)]


@pytest.mark.parametrize("envoys", [None, BridgeEnvoy], ids=["default", "bridge-envoys"])
def test_bad_index_and_name_raise_attribute_error_without_ops_advice(envoys):
    model = language_model(nnbridge, **({} if envoys is None else {"envoys": envoys}))
    for extracted in (False, True):
        for bad in (lambda: model.transformer.h[999], lambda: model.transformer.h.foo):
            with pytest.raises(AttributeError) as raised:
                bad()
            assert "not known yet" not in str(raised.value) and "op" not in str(raised.value).split("'")[0]
        if not extracted:
            with model.trace(PROMPTS[0]):
                pass
    with pytest.raises(AttributeError, match="has no entry '999'" if envoys else "attribute '999'"):
        model.transformer.h[999]


def test_next_outside_a_loop_names_the_08_spelling():
    model = language_model(nnbridge, envoys=BridgeEnvoy)
    with pytest.raises(AttributeError, match=r"tracer\.iter\[\.\.\.\]"):
        model.transformer.h[0].next()
    nnsight_model = language_model(nnsight)
    with pytest.raises(AttributeError):  # nnsight's type for the same mistake
        nnsight_model.transformer.h[0].next()


# -- 6. memory: deleting the wrapper and the model frees them (nnsight tests/test_memory_cleanup.py) -
def traced(library, kind):
    """A wrapper of a fresh tiny GPT-2 after one trace (reading an op under nnbridge), weak
    references to the model and its first layer, and the saved logits ``(1, 8, vocab)``. The trace
    runs in this frame, which ends here: a live frame's ``f_locals`` snapshot (Python 3.11) would
    keep the wrapper alive, under nnsight as well."""
    module = text_model("gpt2")
    model = (library.NNsight(module) if kind == "NNsight"
             else library.TransformersModel(module, tokenizer=tokenizer(), task="text-generation"))
    inputs = tokenizer()(PROMPTS[0], return_tensors="pt").input_ids if kind == "NNsight" else PROMPTS[0]
    softmax = None
    with model.trace(inputs):
        if library is nnbridge:
            softmax = model.transformer.h[0].attn.softmax.output.save()
        logits = model.lm_head.output.save()
    assert library is nnsight or softmax.shape == (1, 4, 8, 8)
    return model, (weakref.ref(module), weakref.ref(module.transformer.h[0])), logits


@pytest.mark.parametrize("kind", ["NNsight", "TransformersModel"])
@pytest.mark.parametrize("library", [nnsight, nnbridge], ids=["nnsight", "nnbridge"])
def test_model_and_layer_are_freed_after_a_trace(library, kind):
    model, refs, logits = traced(library, kind)
    assert torch.equal(logits, text_model("gpt2")(tokenizer()(PROMPTS[0], return_tensors="pt").input_ids).logits)
    assert all(ref() is not None for ref in refs)
    del model
    gc.collect()
    assert all(ref() is None for ref in refs)
