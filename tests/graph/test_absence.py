"""``explain_absence``: the one explanation of a missing op (issue 51, "a new user's first hour"):
the module runs eagerly (the recorded reason and the fix), the attention implementation has no such
op (the implementation and ``attn_implementation="eager"``), or the closest names."""

from __future__ import annotations

import types

import pytest

from nnbridge.compat.transformers.attention import attention_implementation
from nnbridge.graph.absence import AbsenceError, base_name, explain_absence
from nnbridge.graph.kinds import StubKind

WHERE = "transformer.h.0.attn (GPT2Attention)"
SDPA_OPS = ["hidden_states", "c_attn", "split", "getitem", "view", "transpose", "scaled_dot_product_attention",
            "transpose_1", "reshape", "c_proj", "resid_dropout", "output"]
EAGER_OPS = ["hidden_states", "c_attn", "matmul", "truediv", "softmax", "dropout", "matmul_1", "c_proj", "output"]


def _model(implementation):
    """A stand-in for a transformers model: what the attention implementation is read from."""
    return types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation=implementation))


def test_attention_implementation_is_read_from_the_config():
    assert attention_implementation(_model("sdpa")) == "sdpa"
    assert attention_implementation(object()) is None and attention_implementation(None) is None


# -- 1. the module runs eagerly -------------------------------------------------------------------
def test_opaque_module_says_why_and_the_fix():
    failure = "GuardOnDataDependentSymNode: Could not guard on data-dependent expression u0 > 0"
    text = explain_absence("'branchy.softmax' is not a node", "softmax", where="branchy (Branchy)", ops=["x", "output"],
                           opaque=failure)
    assert text.startswith("'branchy.softmax' is not a node: branchy (Branchy) is opaque: it runs eagerly (its graph"
                           f" could not be extracted: {failure})")
    assert "nnbridge.explain(model)" in text and "error_on_compilation_failure=True" in text
    assert "classes_to_skip_compiling" in text
    skipped = explain_absence("x", "softmax", where=WHERE, ops=["output"], opaque=StubKind.SKIPPED)
    assert "its class is in ExtractionOptions(classes_to_skip_compiling=...)" in skipped
    assert "Take the class out of classes_to_skip_compiling" in skipped
    passthrough = explain_absence("x", "y", where="drop (Dropout)", ops=["output"], opaque=StubKind.PASSTHROUGH)
    assert "export records no operation for its call" in passthrough
    long = explain_absence("x", "y", where=WHERE, ops=[], opaque="E" * 5000)
    assert "E" * 300 + "..." in long and "E" * 301 not in long


def test_opaque_comes_first_and_the_module_is_named_once():
    text = explain_absence(f"{WHERE} has no attribute or op 'softmax'", "softmax", where=WHERE, ops=None,
                           model=_model("sdpa"), opaque=StubKind.SKIPPED, unknown="run it")
    assert text.startswith(f"{WHERE} has no attribute or op 'softmax': the module is opaque")


# -- 2. the attention implementation has no such op ---------------------------------------------
@pytest.mark.parametrize("name", ["softmax", "matmul", "matmul_1", "dropout", "attn_weights", "sofmax"])
def test_fused_attention_names_the_implementation_and_the_setting(name):
    text = explain_absence("'transformer.h_0.attn.x' is not a node", name, where=WHERE, ops=SDPA_OPS,
                           model=_model("sdpa"), paths=["transformer.h_0.attn.output"])
    assert f"{WHERE} computes attention with attn_implementation='sdpa', one fused call" \
           " ('scaled_dot_product_attention') with no" in text
    assert 'attn_implementation="eager"' in text and 'set_attn_implementation("eager")' in text
    if name == "sofmax":
        assert "no 'sofmax' (nor 'softmax')" in text


def test_attention_case_needs_a_fused_attention_module():
    # eager attention: a typo gets the closest ops
    eager = explain_absence("s", "sofmax", where=WHERE, ops=EAGER_OPS, model=_model("eager"))
    assert eager == "s; closest ops: ['softmax']."
    # a number too many of an op the module has is a typo too
    assert "closest ops: ['matmul_1'" in explain_absence("s", "matmul_2", where=WHERE, ops=EAGER_OPS, model=_model("sdpa"))
    # not an attention module (no fused call, no Attention in its class name)
    mlp = explain_absence("s", "softmax", where="h.0.mlp (GPT2MLP)", ops=["c_fc", "act", "output"], model=_model("sdpa"))
    assert "attn_implementation" not in mlp and "closest ops" in mlp
    # no model config: nothing to say about attention
    assert "attn_implementation" not in explain_absence("s", "softmax", where=WHERE, ops=SDPA_OPS, model=None)
    # the ops are not known yet, but the class is an attention module: both said
    unknown = explain_absence("s", "softmax", where=WHERE, ops=None, model=_model("flash_attention_2"), unknown="call it.")
    assert "attn_implementation='flash_attention_2', one fused call with no 'softmax'" in unknown
    assert unknown.endswith("Its other ops are not known yet: call it.")


# -- 3. the closest names -------------------------------------------------------------------------
def test_closest_ops_submodules_and_why_there_are_none():
    assert explain_absence("s", "c_atn", where=WHERE, ops=[], submodules=["c_attn", "c_proj"]) == \
        "s. Closest submodules: ['c_attn']."
    assert explain_absence("s", "x", where=WHERE, ops=None, unknown="run it.") == "s. Its ops are not known yet: run it."
    assert explain_absence("s", "x", where=WHERE, ops=[]) == \
        "s, and no ops: the extracted calls of the model did not run it."
    assert explain_absence("s", "zzz", where=WHERE, ops=EAGER_OPS) == f"s; closest ops: {EAGER_OPS[:5]}."
    assert explain_absence("s", "7", where="h (ModuleList)", ops=[], entries=["0", "1"]) == "s; it holds 2: ['0', '1']."


def test_closest_node_paths():
    paths = ["linear_0.output", "linear_1.output", "add"]
    text = explain_absence("'linear_2.output' is not a node", "linear_2", where="<root> (M)", ops=["linear_0"],
                           paths=paths, asked="linear_2.output", hint=" Did you mean 'x'?")
    assert text == ("'linear_2.output' is not a node. Did you mean 'x'? Closest valid NodePaths: ['linear_1.output',"
                    " 'linear_0.output'].")
    assert explain_absence("s", "q", where="", ops=[], paths=[]).endswith("This graph has no patchable nodes.")


def test_error_text_is_computed_when_read():
    calls = []
    error = AbsenceError("short", lambda: calls.append(1) or "short: long")
    assert isinstance(error, AttributeError) and calls == []
    assert str(error) == "short: long" and str(error) == "short: long" and calls == [1]


def test_base_name():
    assert [base_name(n) for n in ("softmax_2", "detach__1", "matmul", "x1")] == ["softmax", "detach_", "matmul", "x1"]
