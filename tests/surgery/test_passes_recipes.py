"""Passes kept as recipes: every later extraction of an edited module gets them; .remove() and
surgery.clear() undo them; a later extraction they fail on raises SurgeryError."""

import pytest
import torch

import nnbridge
from nnbridge import PatchableGraph
from nnbridge.surgery import apply_passes, clear, edits
from passes_common import (ReluMulLayer, RemoveDetachPass, assert_equal_runs, hand_edited, insert_relu_after_add,
                           models, replace_add_with_mul, run_with_grads)

SEED_PASSES = [insert_relu_after_add, replace_add_with_mul, RemoveDetachPass]


def test_passes_apply_to_a_bridged_models_later_extractions():
    model, eager, ids = models()
    nnbridge.bridge(model, ids, use_cache=False)
    applied = apply_passes(model, SEED_PASSES, scope="model.layers_*")
    hand_edited(eager, ReluMulLayer)
    longer = torch.randint(0, 100, (2, 11))
    for call_ids, kwargs in [(longer, {"use_cache": False}), (ids, {"output_attentions": True, "use_cache": False})]:
        want = run_with_grads(lambda: eager(call_ids, **kwargs), eager)
        assert_equal_runs(run_with_grads(lambda: model(call_ids, **kwargs), model), want)
    model.train()
    want = run_with_grads(lambda: eager.train()(ids, use_cache=False), eager)
    assert_equal_runs(run_with_grads(lambda: model(ids, use_cache=False), model), want)
    assert edits(model) == [applied]


def test_removed_passes_leave_every_call_unedited():
    model, eager, ids = models()
    nnbridge.bridge(model, ids, use_cache=False)
    with apply_passes(model, SEED_PASSES, scope="model.layers_*") as applied:
        assert applied.node_path == "model.layers_*"
    assert edits(model) == []
    longer = torch.randint(0, 100, (1, 5))
    for call_ids in (ids, longer):
        want = run_with_grads(lambda: eager(call_ids, use_cache=False), eager)
        assert_equal_runs(run_with_grads(lambda: model(call_ids, use_cache=False), model), want)
    applied.remove()  # twice: nothing


def test_clear_removes_passes_of_a_patchable_graph():
    model, eager, ids = models()
    pg = PatchableGraph(model, ids, use_cache=False)
    apply_passes(pg, SEED_PASSES, scope="model.layers_*")
    assert torch.equal(pg(ids, use_cache=False).logits,
                       hand_edited(__import__("copy").deepcopy(eager), ReluMulLayer)(ids, use_cache=False).logits)
    clear(pg)
    assert edits(pg) == []
    with torch.no_grad():
        assert torch.equal(pg(ids, use_cache=False).logits, eager(ids, use_cache=False).logits)


def test_passes_that_fail_on_a_later_extraction_raise_surgery_error():
    model, _, ids = models()
    nnbridge.bridge(model, ids, use_cache=False)
    state = {"applied": False}

    def fails_after_the_first_extraction(gm):
        if state["applied"]:
            raise RuntimeError("this pass handles one call structure only")

    applied = apply_passes(model, fails_after_the_first_extraction, scope="model.layers_*")
    state["applied"] = True
    with pytest.raises(nnbridge.SurgeryError, match=r"no longer applies.*this pass handles one call structure"):
        model(ids, output_attentions=True, use_cache=False)  # a new call structure: extracted again
    applied.remove()
    _, eager, _ = models()
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, eager(ids, use_cache=False).logits)
