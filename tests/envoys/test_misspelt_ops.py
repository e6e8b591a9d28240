"""A misspelt op name on the default envoys (nnsight's plain ``Envoy`` over modules) names the
closest ops, inside and outside a trace, on every front-end; nnsight's own models keep nnsight's
error (issue 48, item 6)."""

import nnsight
import pytest
import torch

import nnbridge
from utils import PROMPTS, gpt2, text_model, tokenizer

CLOSEST = r"'Envoy' object \(nor its module\) has attribute 'sofmax'\..*closest ops: \['softmax'"


def _front_ends():
    return {
        "NNsight": (lambda: nnbridge.NNsight(gpt2()), torch.randint(0, 100, (1, 6))),
        "LanguageModel": (lambda: nnbridge.LanguageModel(text_model("gpt2"), tokenizer=tokenizer()), PROMPTS[0]),
        "TransformersModel": (lambda: nnbridge.TransformersModel(text_model("gpt2"), tokenizer=tokenizer()),
                              PROMPTS[0]),
    }


@pytest.mark.parametrize("front_end", ["NNsight", "LanguageModel", "TransformersModel"])
def test_misspelt_op_names_the_closest_ops(front_end):
    make, example = _front_ends()[front_end]
    model = make()
    attn = model.transformer.h[0].attn
    assert type(attn) is nnsight.Envoy  # the default module envoys stay nnsight's
    # a trace that reads an op extracts (what is read) and makes the ops known
    with model.trace(example):
        model.transformer.h[0].attn.softmax.output.save()
    with pytest.raises(AttributeError, match=CLOSEST):  # outside a trace
        model.transformer.h[0].attn.sofmax
    with pytest.raises(AttributeError, match=CLOSEST):  # inside a trace
        with model.trace(example):
            model.transformer.h[0].attn.sofmax.output.save()
    # getattr with a default and hasattr still work
    assert getattr(model.transformer.h[0].attn, "sofmax", None) is None
    assert not hasattr(model.transformer.h[0].attn, "sofmax")


def test_misspelt_names_before_extraction_and_of_modules():
    model = nnbridge.NNsight(gpt2())
    # before anything is extracted the ops are unknown: the error says how to make them known
    with pytest.raises(AttributeError, match=r"has attribute 'sofmax'\..*ops are not known yet.*model\.extract"):
        model.transformer.h[0].attn.sofmax
    # a misspelt module names the closest submodules
    with pytest.raises(AttributeError, match=r"'transfomer'\..*Closest submodules: \['transformer'\]"):
        model.transfomer
    model.extract(torch.randint(0, 100, (1, 6)))
    with pytest.raises(AttributeError, match=r"closest ops: \['softmax'"):
        model.transformer.h[1].attn.sofmax
    # a private name keeps nnsight's error as it is
    with pytest.raises(AttributeError, match=r"^'Envoy' object \(nor its module\) has attribute '_private'$"):
        model.transformer.h[0].attn._private
    # nnsight's own model over a model nnbridge never bridged keeps nnsight's error
    plain = nnsight.NNsight(gpt2())
    with pytest.raises(AttributeError) as error:
        plain.transformer.h[0].attn.sofmax
    assert str(error.value) == "'Envoy' object (nor its module) has attribute 'sofmax'"


# -- why an op is missing (issue 51): the same explanation as pg.patch and get_submodule ----------
def test_default_envoys_name_the_attention_implementation():
    from nnbridge import PatchableGraph, ZeroPatch

    ids = torch.randint(0, 100, (1, 6))
    model = nnbridge.NNsight(gpt2("sdpa"))
    model.extract(ids)
    assert type(model.transformer.h[0].attn) is nnsight.Envoy
    with pytest.raises(AttributeError) as envoy:
        model.transformer.h[0].attn.softmax
    text = str(envoy.value)
    assert text.startswith("'Envoy' object (nor its module) has attribute 'softmax'. model.transformer.h.0.attn"
                           " (GPT2Attention) has no attribute or op 'softmax': the module computes attention with"
                           " attn_implementation='sdpa', one fused call ('scaled_dot_product_attention') with no 'softmax'")
    # one explanation: the envoy's, get_submodule's and pg.patch's say the same after naming the module
    with pytest.raises(AttributeError) as lookup:
        model._module.get_submodule("transformer.h.0.attn.softmax")
    pg = PatchableGraph(gpt2("sdpa"), ids)
    with pytest.raises(KeyError) as patch:
        with pg.patch({"transformer.h_0.attn.softmax": ZeroPatch()}):
            pass
    tails = {str(error.value).partition(" computes attention")[2] for error in (envoy, lookup, patch)}
    assert len(tails) == 1 and 'attn_implementation="eager"' in tails.pop()


def test_default_envoys_of_an_opaque_module_give_its_reason():
    from fixtures.data_dependent_module import DataDependentModule

    x = torch.randn(2, 3)
    model = nnbridge.NNsight(DataDependentModule().eval())
    model.extract(x)
    with pytest.raises(AttributeError, match=r"model.branchy \(Branchy\) has no attribute or op 'softmax': the module"
                                             r" is opaque: it runs eagerly \(its graph could not be extracted:"
                                             r" GuardOnDataDependentSymNode.*nnbridge\.explain\(model\)"):
        model.branchy.softmax
