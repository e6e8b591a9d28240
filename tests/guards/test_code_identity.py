"""code_digest: the code a model reaches, which the disk extraction cache keys on
besides the module classes' source files. It stays the same for the same code (another instance,
bridged, traced by nnsight) and changes when a method or helper is replaced at run time."""

from __future__ import annotations

import os
import types

import pytest
import torch
from transformers.cache_utils import DynamicCache
from transformers.models.gpt2 import modeling_gpt2

from utils import gpt2, llama, replace_gpt2_code, wrap

import nnbridge
from nnbridge.guards.bindings import ENVIRONMENT, FunctionParts
from nnbridge.guards.code_check import code_bindings
from nnbridge.guards.code_digest import code_digest
from nnbridge.guards.code_walk import CodeWalk


def _replacement(*args, **kwargs):
    raise AssertionError("not called: only its identity matters here")


@pytest.mark.parametrize("make", [gpt2, llama])
def test_same_code_same_digest(make):
    first, second = make(), make()
    digest = code_digest(first)
    assert code_digest(second) == digest
    nnbridge.bridge(first, torch.randint(0, 100, (1, 8)))  # the bridge's own forwards do not count
    assert code_digest(first) == digest
    nnbridge.unbridge(first)
    assert code_digest(first) == digest


def test_nnsight_wrapping_leaves_the_digest_alone():
    model = wrap(nnbridge, "gpt2")
    module = model._module
    digest = code_digest(module)
    with model.trace("Hello world"):
        model.transformer.h[0].output.save()
    assert code_digest(module) == digest


def test_a_wrapper_of_a_modules_own_device_method_leaves_the_digest_alone():
    """accelerate's dispatch_model wraps ``model.to``/``.cuda`` to warn; no forward runs them, and a
    model unpickled without them (pg.save) keeps its digest. Another wrapped function set on an instance counts."""
    import functools

    model = gpt2()
    digest = code_digest(model)

    def warning_wrapper(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        return wrapper
    model.to = warning_wrapper(model.to)
    model.cuda = warning_wrapper(model.cuda)
    assert code_digest(model) == digest
    model.transformer.h[0].mlp.scale = warning_wrapper(lambda t: t * 2)  # not a device method: counts
    assert code_digest(model) != digest


@pytest.mark.parametrize("replace", [
    "class_method", "module_helper", "attention_registry", "cache_method", "instance_forward",
])
def test_a_replacement_changes_the_digest_and_restoring_restores_it(replace, monkeypatch):
    model = gpt2()
    digest = code_digest(model)
    if replace in ("class_method", "module_helper", "attention_registry"):
        replace_gpt2_code(monkeypatch, replace)
    elif replace == "cache_method":  # DynamicCache (named in GPT2Model.forward) .update (called by the attention)
        monkeypatch.setattr(DynamicCache, "update", _replacement)
    else:
        model.transformer.h[1].mlp.forward = types.MethodType(_replacement, model.transformer.h[1].mlp)
    assert code_digest(model) != digest
    monkeypatch.undo()
    if replace == "instance_forward":
        del model.transformer.h[1].mlp.forward
    assert code_digest(model) == digest


class _Base(torch.nn.Module):
    def scale(self, x):
        return x * 2


class _Child(_Base):
    def forward(self, x):
        return self.scale(x) + 1


def test_an_inherited_method_the_forward_calls_counts(monkeypatch):
    model = _Child()
    digest = code_digest(model)
    monkeypatch.setattr(_Base, "scale", _replacement)
    assert code_digest(model) != digest
    monkeypatch.undo()
    monkeypatch.setattr(_Base, "unused", _replacement, raising=False)  # a method no code reached names
    assert code_digest(model) == digest


def test_a_replacement_with_the_same_code_keeps_the_digest(monkeypatch):
    """Functions count by their code, not their identity: a module imported again (as a
    notebook's autoreload does) gives the same digest."""
    model = gpt2()
    digest = code_digest(model)
    original = modeling_gpt2.eager_attention_forward
    copy = types.FunctionType(original.__code__, original.__globals__, original.__name__, original.__defaults__,
                              original.__closure__)
    copy.__qualname__, copy.__module__ = original.__qualname__, original.__module__
    monkeypatch.setattr(modeling_gpt2, "eager_attention_forward", copy)
    assert code_digest(model) == digest


def test_functions_reached_through_helpers_count():
    """A function called by a helper the forward calls (two global reads away) is reached."""
    walk = CodeWalk()
    walk.cls(type(llama().model.layers[0].self_attn), in_tree=True)
    walk.run()
    reached = {where for where, _ in walk.entries}
    assert "transformers.models.llama.modeling_llama.eager_attention_forward" in reached
    assert "transformers.models.llama.modeling_llama.repeat_kv" in reached  # called by eager_attention_forward


# -- the in-process guard (guards.StateGuard): code replaced after bridging re-extracts --------------
@pytest.mark.parametrize("replace", ["module_helper", "class_method"])
def test_code_replaced_after_bridging_re_extracts_and_equals_eager(replace, monkeypatch):
    """Before, a bridged model kept running the graphs of the old code (silently not eager)."""
    ids = torch.randint(0, 100, (1, 8))
    model, reference = gpt2(), gpt2()
    nnbridge.bridge(model, ids)
    before = model(ids).logits
    replace_gpt2_code(monkeypatch, replace)
    changed = "eager_attention_forward was replaced" if replace == "module_helper" else "GPT2MLP.forward was replaced"
    eager = reference(ids).logits
    assert not torch.equal(eager, before)
    assert torch.equal(model(ids).logits, eager)
    history = nnbridge.explain(model)
    assert changed in str(history) and "code the modules run changed" in str(history)
    monkeypatch.undo()  # the first extraction holds again
    assert torch.equal(model(ids).logits, before)


def test_a_method_defined_on_a_subclass_over_an_inherited_one_re_extracts(monkeypatch):
    x = torch.randn(2, 3)
    model = _Child()
    nnbridge.bridge(model, x)
    assert torch.equal(model(x), x * 2 + 1)
    monkeypatch.setattr(_Child, "scale", lambda self, x: x * 3, raising=False)  # shadows _Base.scale
    assert torch.equal(model(x), x * 3 + 1)
    assert "_Base.scale was defined on a subclass" in str(nnbridge.explain(model))


def test_traces_and_generation_do_not_trip_the_code_guard():
    """nnsight traces, .source, generation and a second call leave every lookup as it was: one
    extraction per call structure, as before the guard."""
    from nnbridge.inplace.bridging import bridge_of
    model = wrap(nnbridge, "gpt2")
    with model.trace("Hello world"):
        model.transformer.h[0].attn.softmax.output.save()
    with model.trace("Hello world"):
        model.transformer.h[0].attn.source.attention_interface_0.output.save()
    with model.generate("Hello", max_new_tokens=3):
        model.transformer.h[1].attn.softmax.output.save()
    with model.trace("Hello world"):
        model.transformer.h[0].attn.softmax.output.save()
    dispatcher = bridge_of(model._module).dispatcher
    reasons = [str(e.reason) for e in dispatcher.history]
    assert not any("code the modules run changed" in r for r in reasons), reasons


# -- a function's own code and default values assigned anew (f.__defaults__ = ...) ------------------
def _scaled(y, k=1.0, *, shift=0.5):
    return y * k + shift


def _negated(y, k=1.0, *, shift=0.5):
    return -y * k - shift


class _Scaled(torch.nn.Module):
    """The forward's default, a helper's default, its keyword-only default and its code are each
    baked into the graph of a call that leaves the argument out."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x, scale=2.0):
        return _scaled(self.linear(x) * scale)


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Scaled()

    def forward(self, x):
        return self.inner(x) + 1


def _bridged(make):
    """``(bridged model, untouched copy, input, the bridged model's first output)``: the output
    equals the copy's."""
    torch.manual_seed(0)
    x = torch.randn(2, 3)
    model, reference = make(), make()
    reference.load_state_dict(model.state_dict())
    nnbridge.bridge(model, x)
    before = model(x)
    assert torch.equal(before, reference(x))
    return model, reference, x, before


_PARTS = {
    "forward.__defaults__": (lambda: _Scaled.forward, "__defaults__", (5.0,)),
    "helper.__defaults__": (lambda: _scaled, "__defaults__", (3.0,)),
    "helper.__kwdefaults__": (lambda: _scaled, "__kwdefaults__", {"shift": -2.0}),
    "helper.__code__": (lambda: _scaled, "__code__", _negated.__code__),
}


@pytest.mark.parametrize("part", list(_PARTS))
def test_a_function_part_assigned_anew_changes_the_digest(part, monkeypatch):
    function, name, value = _PARTS[part]
    model = _Outer()
    digest = code_digest(model)
    monkeypatch.setattr(function(), name, value)
    assert code_digest(model) != digest
    monkeypatch.undo()
    assert code_digest(model) == digest


@pytest.mark.parametrize("part", list(_PARTS))
def test_a_function_part_assigned_after_bridging_re_extracts_and_equals_eager(part, monkeypatch):
    """Before, the graphs kept the old default or code: off from eager, with no error."""
    function, name, value = _PARTS[part]
    model, reference, x, before = _bridged(_Outer)
    monkeypatch.setattr(function(), name, value)
    eager = reference(x)
    assert not torch.equal(eager, before)
    assert torch.equal(model(x), eager)
    history = str(nnbridge.explain(model))
    assert f"{function().__qualname__}.{name} was replaced" in history, history
    monkeypatch.undo()
    assert torch.equal(model(x), before)


def test_functions_without_defaults_keep_no_defaults_check():
    """Only defaults that exist are checked (a call of a function without them passed every
    argument); every function's code is."""
    bindings = code_bindings(_Outer())
    checked = {name: {namespace.function.__qualname__ for _, namespace, part, _ in bindings if part == name
                      and isinstance(namespace, FunctionParts)}
               for name in ("__code__", "__defaults__", "__kwdefaults__")}
    assert checked["__code__"] >= {"_Outer.forward", "_Scaled.forward", "_scaled"}
    assert checked["__defaults__"] == {"_Scaled.forward", "_scaled"}
    assert checked["__kwdefaults__"] == {"_scaled"}


def test_a_default_written_in_place_after_bridging_re_extracts_and_equals_eager(monkeypatch):
    """A mutable default (the keyword-only defaults' dict here, a list default alike) written in
    place counts as a global container of plain values does."""
    model, reference, x, before = _bridged(_Outer)
    monkeypatch.setitem(_scaled.__kwdefaults__, "shift", 4.0)
    eager = reference(x)
    assert not torch.equal(eager, before)
    assert torch.equal(model(x), eager)
    assert "_scaled.__kwdefaults__ was written in place" in str(nnbridge.explain(model))
    monkeypatch.undo()
    assert torch.equal(model(x), before)


# -- environment variables a forward reads (os.environ, os.getenv) ---------------------------------
class _FromEnvironment(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x):
        y = self.linear(x)
        if os.environ.get("NNBRIDGE_TEST_DOUBLE") == "1":
            y = y * 2
        return y + float(os.getenv("NNBRIDGE_TEST_SHIFT", "0"))


def test_environment_variables_the_code_names_count_in_the_digest(monkeypatch):
    monkeypatch.delenv("NNBRIDGE_TEST_SHIFT", raising=False)
    model = _FromEnvironment()
    digest = code_digest(model)
    monkeypatch.setenv("NNBRIDGE_UNRELATED", "1")  # not named by the code
    assert code_digest(model) == digest
    monkeypatch.setenv("NNBRIDGE_TEST_SHIFT", "2")
    assert code_digest(model) != digest
    monkeypatch.delenv("NNBRIDGE_TEST_SHIFT")
    assert code_digest(model) == digest


def test_transformers_sdpa_environment_switch_is_watched():
    """transformers' SDPA attention reads TRANSFORMERS_SDPA_FORCE_GQA in every call."""
    watched = {where for where, namespace, _, _ in code_bindings(llama())
               if namespace is ENVIRONMENT}
    assert "os.environ['TRANSFORMERS_SDPA_FORCE_GQA']" in watched


@pytest.mark.parametrize("change", ["set", "changed", "unset"])
def test_an_environment_variable_set_after_bridging_re_extracts_and_equals_eager(change, monkeypatch):
    """Before, the graphs kept the branch and the value read at extraction: off from eager, with no
    error."""
    monkeypatch.delenv("NNBRIDGE_TEST_DOUBLE", raising=False)
    monkeypatch.delenv("NNBRIDGE_TEST_SHIFT", raising=False)
    if change != "set":
        monkeypatch.setenv("NNBRIDGE_TEST_DOUBLE", "1")
    model, reference, x, before = _bridged(_FromEnvironment)
    if change == "set":
        monkeypatch.setenv("NNBRIDGE_TEST_DOUBLE", "1")
    elif change == "changed":
        monkeypatch.setenv("NNBRIDGE_TEST_DOUBLE", "0")
    else:
        monkeypatch.delenv("NNBRIDGE_TEST_DOUBLE")
    eager = reference(x)
    assert not torch.equal(eager, before)
    assert torch.equal(model(x), eager)
    assert "os.environ['NNBRIDGE_TEST_DOUBLE'] was changed" in str(nnbridge.explain(model))
    monkeypatch.setenv("NNBRIDGE_TEST_SHIFT", "0.5")
    assert torch.equal(model(x), reference(x))
