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
