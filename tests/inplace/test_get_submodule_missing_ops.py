"""``get_submodule`` on a bridged model explains a name it lacks as ``pg.patch`` and envoys do
(issue 51): the module runs eagerly, the attention implementation has no such op, or the closest
ops. The lookup is an instance attribute while bridged, gone after ``unbridge``, and copies,
pickles and the model's lifetime are as before."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch

import nnbridge
from fixtures.data_dependent_module import DataDependentModule
from nnbridge.graph.absence import AbsenceError
from utils import gpt2

IDS = torch.randint(0, 100, (1, 6))


def _error(model, target) -> str:
    with pytest.raises(AttributeError) as raised:
        model.get_submodule(target)
    return str(raised.value)


def test_sdpa_attention_before_and_after_extraction():
    model = nnbridge.bridge(gpt2("sdpa"))
    try:
        before = _error(model, "transformer.h.0.attn.softmax")
        assert before.startswith("GPT2Attention has no attribute `softmax`: transformer.h.0.attn (GPT2Attention)"
                                 " computes attention with attn_implementation='sdpa'")
        assert before.endswith("Its other ops are not known yet: they appear when the model is first called (or"
                               " bridge it with example inputs: nnbridge.bridge(model, *inputs)).")
        model(IDS)
        after = _error(model, "transformer.h.0.attn.softmax")
        assert "one fused call ('scaled_dot_product_attention') with no 'softmax'" in after
        assert 'attn_implementation="eager"' in after and "not known yet" not in after
    finally:
        nnbridge.unbridge(model)


def test_closest_ops_containers_and_plain_attributes():
    model = nnbridge.bridge(gpt2("eager"), IDS)
    try:
        assert _error(model, "transformer.h.0.attn.sofmax") == \
            "GPT2Attention has no attribute `sofmax`; closest ops: ['softmax']."
        assert _error(model, "transformer.h.9") == "ModuleList has no attribute `9`; it holds 2: ['0', '1']."
        assert _error(model, "transformer.h.0.attn.c_attn.weight") == "`weight` is not an nn.Module", "torch's own"
        assert model.get_submodule("transformer.h.0.attn.softmax") is model.transformer.h[0].attn.softmax
        assert model.get_submodule("") is model
        with pytest.raises(AbsenceError):  # an AttributeError: hasattr-style probes keep working
            model.get_submodule("nothing")
    finally:
        nnbridge.unbridge(model)
    assert "get_submodule" not in model.__dict__
    assert _error(model, "transformer.h.0.attn.softmax") == "GPT2Attention has no attribute `softmax`"


def test_opaque_module_reason():
    x = torch.randn(2, 3)
    model = nnbridge.bridge(DataDependentModule().eval(), x)
    try:
        text = _error(model, "branchy.softmax")
        assert text.startswith("Branchy has no attribute `softmax`: branchy (Branchy) is opaque: it runs eagerly (its"
                               " graph could not be extracted: GuardOnDataDependentSymNode")
        assert "nnbridge.explain(model)" in text
    finally:
        nnbridge.unbridge(model)


def test_copies_and_lifetime():
    model = nnbridge.bridge(gpt2("eager"), IDS)
    twin = copy.deepcopy(model)
    assert twin.__dict__["get_submodule"] is not model.__dict__["get_submodule"]
    twin(IDS)
    assert twin.get_submodule("transformer.h.0.attn.softmax") is twin.transformer.h[0].attn.softmax
    assert "closest ops: ['softmax']" in _error(twin, "transformer.h.0.attn.sofmax")
    loaded = pickle.loads(pickle.dumps(model))
    loaded(IDS)
    assert "closest ops: ['softmax']" in _error(loaded, "transformer.h.0.attn.sofmax")
    assert "get_submodule" not in nnbridge.unbridge(loaded).__dict__
    alive = weakref.ref(model)
    del model, twin
    gc.collect()
    assert alive() is None, "the lookup holds its model weakly"
