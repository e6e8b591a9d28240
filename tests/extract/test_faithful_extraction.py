"""Faithful or loud: extraction either captures a module exactly or leaves it opaque with a reason.

Each test compares against an untouched copy of the model run eagerly (torch.equal): grad-mode
changes and grad-mode branches inside forward, custom autograd Functions, buffers re-assigned in
forward, Python side effects on module attributes, and extraction itself leaving the model's state
and the RNG untouched.
"""

from __future__ import annotations

import contextlib
import copy
import random
import types
from typing import Any

import numpy
import pytest
import torch

import nnbridge
from nnbridge import ExtractionOptions, PatchableGraph
from nnbridge.extract.eager_checks import EagerFindings
from nnbridge.inplace.bridging import bridge_of
from nnbridge.compat.torch.pytree import pytree
from nnbridge.errors import ExtractionError, NNBridgeWarning
from utils import no_grad_rotary


def _opaque(model: torch.nn.Module) -> dict[str, str]:
    state = bridge_of(model)
    reasons: dict[str, str] = {}
    for extraction in state.dispatcher.all_extractions():
        reasons.update(extraction.opaque)
    return reasons


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in model.named_parameters()}


# -- 3. grad mode ---------------------------------------------------------------------------------
class NoGradInside(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            frozen = self.b(x)
        return self.a(x) + frozen


class GradBranch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 1.5 if torch.is_grad_enabled() else y


class Outer(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def _compare_backward(model: torch.nn.Module, x: torch.Tensor) -> None:
    reference = copy.deepcopy(model)
    expected = reference(x)
    expected.sum().backward()
    nnbridge.bridge(model, x)
    out = model(x)
    out.sum().backward()
    assert torch.equal(out, expected)
    for name, grad in _grads(reference).items():
        got = _grads(model)[name]
        assert (got is None) == (grad is None), name
        assert grad is None or torch.equal(got, grad), name
    nnbridge.unbridge(model)


def test_no_grad_block_inside_forward_keeps_eager_gradients():
    model = Outer(NoGradInside()).eval()
    x = torch.randn(2, 3)
    _compare_backward(model, x)
    nnbridge.bridge(model, x)
    reasons = _opaque(model)
    assert "grad mode" in reasons["inner"]
    assert "head" not in reasons
    nnbridge.unbridge(model)


def test_grad_mode_branch_follows_the_extraction_grad_mode():
    model = Outer(GradBranch()).eval()
    x = torch.randn(2, 3)
    _compare_backward(model, x)


def test_grad_mode_change_honours_error_and_warn_options():
    x = torch.randn(2, 3)
    with pytest.raises(ExtractionError, match=r"'inner'.*grad mode"):
        PatchableGraph(Outer(NoGradInside()).eval(), x, options=ExtractionOptions(error_on_compilation_failure=True))
    with pytest.warns(NNBridgeWarning, match=r"'inner' is opaque.*grad mode"):
        PatchableGraph(Outer(NoGradInside()).eval(), x, options=ExtractionOptions(warn_on_compilation_failure=True))
    with torch.no_grad():  # no change of mode while extracting without grad: a graph, silently
        pg = PatchableGraph(Outer(NoGradInside()).eval(), x, options=ExtractionOptions(error_on_compilation_failure=True))
    assert pg.extractions[0].opaque == {}


def _tiny_llama() -> torch.nn.Module:
    """A tiny Llama whose rotary embedding changes grad mode (``@torch.no_grad()``, as transformers < 5.24's)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return no_grad_rotary(LlamaForCausalLM(config).eval())


def test_llama_grad_mode_outputs_and_gradients_equal_eager():
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 100, (1, 6))
    expected = reference(ids).logits
    expected.sum().backward()
    nnbridge.bridge(model, ids)
    reasons = _opaque(model)
    assert list(reasons) == ["model.rotary_emb"]
    assert "grad mode" in reasons["model.rotary_emb"]
    logits = model(ids).logits
    logits.sum().backward()
    assert torch.equal(logits, expected)
    for name, grad in _grads(reference).items():
        assert torch.equal(_grads(model)[name], grad), name
    nnbridge.unbridge(model)


@pytest.mark.no_extraction_cache  # counts exports
@pytest.mark.parametrize("prescan", [True, False], ids=["found-eagerly", "found-by-export"])
def test_a_module_changing_grad_mode_costs_one_export_when_found_eagerly(prescan, exports, monkeypatch):
    """An eager run finds the rotary embedding's ``@torch.no_grad()`` before exporting, so one
    export suffices; without that run export finds it and exports again: the same graphs."""
    from nnbridge.dispatch import extraction

    if not prescan:
        monkeypatch.setattr(extraction, "eager_findings", lambda *args, **kwargs: EagerFindings([], []))
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 100, (1, 6))
    pg = PatchableGraph(model, ids)
    assert exports[0] == (1 if prescan else 2)
    assert list(pg.extractions[0].opaque) == ["model.rotary_emb"]
    assert "grad mode" in pg.extractions[0].opaque["model.rotary_emb"]
    logits = pg(ids).logits
    expected = reference(ids).logits
    assert torch.equal(logits, expected)
    logits.sum().backward()
    expected.sum().backward()
    for name, grad in _grads(reference).items():
        assert torch.equal(_grads(model)[name], grad), name


def test_llama_no_grad_extraction_keeps_rotary_graph():
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 100, (1, 6))
    with torch.no_grad():
        pg = PatchableGraph(model, ids)
        assert pg.extractions[0].opaque == {}
        assert torch.equal(pg(ids).logits, reference(ids).logits)


# -- 4. custom autograd.Function ------------------------------------------------------------------
class RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


class Quantizer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RoundSTE.apply(self.lin(x))


def test_custom_autograd_function_keeps_its_backward():
    model = Outer.__new__(Outer)
    torch.nn.Module.__init__(model)
    model.inner = Quantizer()
    model.head = torch.nn.Linear(4, 2)
    model.eval()
    x = torch.randn(2, 3) * 3
    _compare_backward(model, x)
    nnbridge.bridge(model, x)
    reasons = _opaque(model)
    assert "RoundSTE" in reasons["inner"]
    assert set(reasons) == {"inner"}
    nnbridge.unbridge(model)
    with pytest.raises(ExtractionError, match=r"'inner'.*RoundSTE"):
        PatchableGraph(model, x, options=ExtractionOptions(error_on_compilation_failure=True))


# -- 7. buffers re-assigned in forward ------------------------------------------------------------
class Ema(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("ema", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.ema = 0.9 * self.ema + 0.1 * y.mean()
        return y + self.ema


def _three_calls(model: torch.nn.Module, x: torch.Tensor, front: str) -> tuple[torch.nn.Module, dict[str, str]]:
    """Three calls through ``front`` equal three eager calls of a copy; returns the copy (in its
    state after the calls) and the opaque modules' reasons. A bridged model stays bridged."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        expected = [reference(x) for _ in range(3)]
        if front == "bridge":
            nnbridge.bridge(model, x)
            run, reasons = model, _opaque(model)
        else:
            run = PatchableGraph(model, x)
            reasons = run.extractions[0].opaque
        got = [run(x) for _ in range(3)]
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    return reference, reasons


@pytest.mark.parametrize("front", ["bridge", "pg"])
def test_buffer_reassigned_in_forward(front):
    model = Outer(Ema()).eval()
    x = torch.randn(2, 3)
    reference, _ = _three_calls(model, x, front)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name
    if front == "bridge":
        nnbridge.unbridge(model)
    assert torch.equal(model.inner.ema, Outer(Ema()).eval().inner.ema) is False  # it did move
    nnbridge.bridge(model, x)
    assert "ema" in _opaque(model)["inner"]
    nnbridge.unbridge(model)


# -- 8. extraction leaves the model untouched -----------------------------------------------------
class ConvBn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.bn(self.conv(x)))
        return y if y.sum() > 0 else -y  # data-dependent: this module is opaque, its children graphs


class ConvBnBranch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = ConvBn()
        self.bn = torch.nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.block(x))


@pytest.mark.parametrize("front", ["bridge", "pg"])
def test_extraction_does_not_mutate_train_mode_model(front):
    model = ConvBnBranch().train()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 2, 6, 6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with torch.no_grad():
        if front == "bridge":
            nnbridge.bridge(model, x)
            run = model
        else:
            run = PatchableGraph(model, x)
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    torch.manual_seed(1)
    with torch.no_grad():
        expected = reference(x)
    torch.manual_seed(1)
    with torch.no_grad():
        got = run(x)
    assert torch.equal(got, expected)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name
    if front == "bridge":
        nnbridge.unbridge(model)


# -- 11. Python side effects on module attributes --------------------------------------------------
class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * self.calls


class Appender(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.seen.append(y.detach())
        return y + len(self.seen)


class Cacher(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        out = y if self.last is None else y + self.last
        self.last = y.detach()
        return out


class Accumulator(torch.nn.Module):
    """Writes a plain tensor attribute (not a buffer) in place: before, the graph silently skipped
    the write and extraction's own eager runs left it written."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.total = torch.zeros(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.total.add_(y.sum(0))
        return y + self.total


class ConfigScaler(torch.nn.Module):
    """Sets a value on its config-like object in forward (``self.config.scale = ...``): before, the
    graph kept the value of the extracted call, silently."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.config = types.SimpleNamespace(scale=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.config.scale = self.config.scale * 2
        return self.lin(x) * self.config.scale


class Slots(torch.nn.Module):
    """Writes a tensor held in a list attribute in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.slots = [torch.zeros(3)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.slots[0].add_(y.sum(0))
        return y + self.slots[0]


SIDE_EFFECTS = [(Counter, "calls"), (Appender, "seen"), (Cacher, "last"), (Accumulator, "total"),
                (ConfigScaler, "config"), (Slots, "slots")]


@pytest.mark.parametrize("front", ["bridge", "pg"])
@pytest.mark.parametrize("inner, attribute", SIDE_EFFECTS)
def test_python_side_effects_make_module_opaque(inner, attribute, front):
    model = Outer(inner()).eval()
    x = torch.randn(2, 3)
    reference, reasons = _three_calls(model, x, front)
    assert set(reasons) == {"inner"}
    assert attribute in reasons["inner"]
    if attribute == "seen":
        assert len(model.inner.seen) == len(reference.inner.seen) == 3
        assert all(torch.equal(a, b) for a, b in zip(model.inner.seen, reference.inner.seen))
    if attribute == "calls":
        assert model.inner.calls == reference.inner.calls == 3
    if attribute == "total":
        assert torch.equal(model.inner.total, reference.inner.total)
    if attribute == "slots":
        assert torch.equal(model.inner.slots[0], reference.inner.slots[0])
    if attribute == "config":
        assert model.inner.config.scale == reference.inner.config.scale == 8.0
    if front == "bridge":
        nnbridge.unbridge(model)


class CountingChild(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class CountsItsChild(torch.nn.Module):
    """Sets its child's attribute and reads it (``self.child.calls += 1``): the child holds the
    state, the parent's code writes it, so the parent runs its own code. Before, only the child was
    made opaque and the parent's graph kept the count of the extracted call, silently."""

    def __init__(self) -> None:
        super().__init__()
        self.child = CountingChild()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.child.calls += 1
        return self.child(x) * self.child.calls


def test_the_module_writing_another_modules_state_is_the_one_made_opaque():
    """(In place only: a PatchableGraph's opaque module calls its children through dispatchers,
    which do not hold the children's attributes: ``self.child.calls`` raises AttributeError there.)"""
    model = Outer(CountsItsChild()).eval()
    reference, reasons = _three_calls(model, torch.randn(2, 3), "bridge")
    assert set(reasons) == {"inner"}
    assert "'inner.child'" in reasons["inner"] and "calls" in reasons["inner"]
    assert model.inner.child.calls == reference.inner.child.calls == 3
    nnbridge.unbridge(model)


@pytest.mark.parametrize("inner, attribute", SIDE_EFFECTS)
def test_extraction_leaves_side_effect_state_untouched(inner, attribute):
    """Extraction's eager runs and its trace put every attribute back: a plain tensor written in
    place gets its values back, a config-like object its values."""
    model = Outer(inner()).eval()
    before = copy.deepcopy(model.inner.__dict__[attribute])
    nnbridge.bridge(model, torch.randn(2, 3))
    after = model.inner.__dict__[attribute]
    if isinstance(before, torch.Tensor):
        assert torch.equal(after, before)
    elif isinstance(before, types.SimpleNamespace):
        assert vars(after) == vars(before)
    elif isinstance(before, list) and before:
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    elif isinstance(before, list):
        assert after == before == []
    else:
        assert after == before
    nnbridge.unbridge(model)


def test_side_effect_honours_error_option():
    with pytest.raises(ExtractionError, match=r"'inner'.*calls"):
        PatchableGraph(Outer(Counter()).eval(), torch.randn(2, 3),
                       options=ExtractionOptions(error_on_compilation_failure=True))


class TwoNoGrad(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = NoGradInside()
        self.second = NoGradInside()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def test_every_module_changing_grad_mode_is_found():
    model = TwoNoGrad().eval()
    x = torch.randn(2, 3)
    _compare_backward(model, x)
    nnbridge.bridge(model, x)
    assert set(_opaque(model)) == {"first", "second"}
    nnbridge.unbridge(model)


# -- Python values returned next to tensors ---------------------------------------------------------
# unflatten leaves None where a module call returned a constant; export specialises on it (a size
# makes the extraction static), and a module that runs its own code must not freeze its caller's.
class ReturnsInt(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.lin(x) * 2, 3


class AttrChild(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.n = 5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.lin(x), self.n


class SizeChild(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.lin(x), x.shape[0]


class FlagChild(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, bool, float]:
        return self.lin(x), True, 0.5


class NoneChild(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None, tuple[int, None, torch.Tensor]]:
        y = self.lin(x)
        return y, None, (7, None, y + 1)


class ArgmaxChild(torch.nn.Module):
    """Not exportable (data-dependent ``int``): runs its own code, returning a new int each call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.lin(x), int(x.argmax())


class UsesValue(torch.nn.Module):
    """Uses the child's Python value and returns it."""

    def __init__(self, child: torch.nn.Module) -> None:
        super().__init__()
        self.child = child
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.child(x)
        scale = out[1] if isinstance(out[1], (int, float)) else 1
        return (self.head(out[0]) * scale, *out[1:])


def _same(got: object, expected: object) -> None:
    """Same pytree structure; tensors torch.equal; other leaves the same type and value."""
    got_leaves, got_spec = pytree.tree_flatten(got)
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    assert got_spec == expected_spec, (got, expected)
    for a, b in zip(got_leaves, expected_leaves):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and torch.equal(a, b), (a, b)
        else:
            assert type(a) is type(b) and a == b, (a, b)


_VALUE_MODELS = {
    "root_int": lambda: ReturnsInt(),
    "child_attr_int": lambda: UsesValue(AttrChild()),
    "child_size": lambda: UsesValue(SizeChild()),
    "child_bool_float": lambda: UsesValue(FlagChild()),
    "child_none_in_tuple": lambda: UsesValue(NoneChild()),
    "opaque_child_data_int": lambda: UsesValue(ArgmaxChild()),
}


@pytest.mark.parametrize("front", ["bridge", "pg", "nnsight"])
@pytest.mark.parametrize("name", list(_VALUE_MODELS))
def test_python_values_returned_next_to_tensors(name, front):
    torch.manual_seed(0)
    model = _VALUE_MODELS[name]().eval()
    reference = copy.deepcopy(model)
    has_child = hasattr(model, "child")
    seen: list[object] = []
    if has_child:
        reference.child.register_forward_hook(lambda m, a, out: seen.append(out))
    inputs = [torch.randn(2, 3), torch.randn(4, 3), torch.randn(2, 3)]  # a new batch size, then back
    with torch.no_grad():
        expected = [reference(x) for x in inputs]
        if front == "bridge":
            nnbridge.bridge(model, inputs[0])
        elif front == "pg":
            pg = PatchableGraph(model, inputs[0])
        else:
            wrapped = nnbridge.NNsight(model)
        got, children = [], []
        for x in inputs:
            if front == "bridge":
                if has_child:
                    handle = model.child.register_forward_hook(lambda m, a, out: children.append(out))
                got.append(model(x))
                if has_child:
                    handle.remove()
            elif front == "pg":
                got.append(pg(x))
            else:
                with wrapped.trace(x):
                    if has_child:
                        child_out = wrapped.child.output.save()
                    out = wrapped.output.save()
                got.append(out)
                if has_child:
                    children.append(child_out)
    for a, b in zip(got, expected):
        _same(a, b)
    if front != "pg" and has_child:  # the child's own output carries the value too
        assert len(children) == len(seen)
        for a, b in zip(children, seen):
            _same(a, b)
    if front == "bridge":
        nnbridge.unbridge(model)


def test_opaque_child_returning_an_int_leaves_its_caller_opaque():
    model = UsesValue(ArgmaxChild()).eval()
    x = torch.randn(2, 3)
    nnbridge.bridge(model, x)
    reasons = _opaque(model)
    assert "child" in reasons and "GuardOnDataDependentSymNode" in reasons["child"]
    assert "'child'" in reasons["<root>"] and "int" in reasons["<root>"]
    nnbridge.unbridge(model)
    with pytest.raises(ExtractionError, match=r"'child'.*Python value"):
        PatchableGraph(UsesValue(ArgmaxChild()).eval(), x,
                       options=ExtractionOptions(error_on_compilation_failure=True))


def test_module_returning_only_a_python_value_runs_its_own_code():
    class Config(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> int:
            return 3

    model = Config()
    nnbridge.bridge(model, torch.randn(2, 3))
    assert model(torch.randn(5, 3)) == 3
    assert "no tensor operation" in _opaque(model)["<root>"]
    nnbridge.unbridge(model)


# -- a forward set on a module instance ------------------------------------------------------------
@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
def test_a_forward_set_on_an_instance_is_refused_and_nothing_is_left_bridged(front):
    """Extraction and the eager fallback run a module's class forward: with ``module.forward = f``
    the bridged logits differed from eager without an error. Now refused before anything is done,
    naming the module and the fix; after the fix (a subclass) the bridged model equals eager."""
    from utils import gpt2, halved_mlp
    ids = torch.randint(0, 100, (1, 8))
    model = gpt2()
    mlp = model.transformer.h[1].mlp
    mlp.forward = halved_mlp.__get__(mlp)
    eager = model(ids).logits
    make = (lambda: nnbridge.bridge(model, ids)) if front == "bridge" else (lambda: PatchableGraph(model, ids))
    with pytest.raises(ExtractionError, match=r"module 'transformer.h.1.mlp' \(GPT2MLP\) has its own forward set on"
                                              r" the instance \(halved_mlp\).*subclass"):
        make()
    assert bridge_of(model) is None and vars(mlp)["forward"].__func__ is halved_mlp
    assert torch.equal(model(ids).logits, eager)
    del mlp.forward
    mlp.__class__ = type("HalvedMLP", (type(mlp),), {"forward": halved_mlp})  # the fix the message gives
    assert torch.equal(model(ids).logits, eager)
    result = make()
    assert torch.equal((model if front == "bridge" else result)(ids).logits, eager)


@pytest.mark.parametrize("call", ["forward", "generate"])
def test_a_forward_set_on_an_instance_after_a_patchable_graph_was_built_is_refused(call):
    """A PatchableGraph over a plain model runs its graphs, not the modules: a ``forward`` set on
    one of them afterwards was skipped, and the logits differed from eager without an error. Now
    each call refuses, naming the module; removing the forward makes it equal eager again. (A
    bridged model runs the new forward: tests/guards/test_code_identity.py.)"""
    from utils import gpt2, halved_mlp
    ids = torch.randint(0, 100, (1, 8))
    model = gpt2()
    pg = PatchableGraph(model, ids)
    mlp = model.transformer.h[1].mlp
    mlp.forward = halved_mlp.__get__(mlp)
    run = (lambda: pg(ids).logits) if call == "forward" else (
        lambda: pg.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0))
    with pytest.raises(ExtractionError, match=r"module 'transformer.h.1.mlp' \(GPT2MLP\) has its own forward set on"
                                              r" the instance \(halved_mlp\) since the PatchableGraph was built"):
        run()
    del mlp.forward
    expected = model(ids).logits if call == "forward" else model.generate(ids, max_new_tokens=2, do_sample=False,
                                                                           pad_token_id=0)
    assert torch.equal(run(), expected)


def test_wrappers_around_the_class_forward_are_not_instance_forwards():
    """nnsight's, accelerate's and a bridge's own wrappers run the class's forward: not refused."""
    from nnbridge.compat.torch.forwards import instance_forward
    from utils import gpt2, halved_mlp
    model = gpt2()
    mlp = model.transformer.h[0].mlp
    assert instance_forward(mlp) is None
    mlp.__dict__["_hf_hook"], mlp.__dict__["_old_forward"] = object(), mlp.forward  # accelerate's layout
    mlp.__dict__["forward"] = lambda *a, **k: mlp._old_forward(*a, **k)
    assert instance_forward(mlp) is None
    mlp.__dict__["_old_forward"] = halved_mlp.__get__(mlp)  # user code replaced what accelerate wraps
    assert instance_forward(mlp) is not None
    for key in ("_hf_hook", "_old_forward", "forward"):
        del mlp.__dict__[key]
    nnbridge.bridge(model, torch.randint(0, 100, (1, 8)))
    assert all(instance_forward(m) is None for m in model.modules())


# -- a tensor requiring grad read other than as a parameter ----------------------------------------
@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
def test_a_parameter_read_through_a_list_runs_eagerly_with_its_gradient(front):
    """export lifts a tensor reached through a list attribute (``self.weights[0]``, the module's own
    parameter) as a detached constant: the graph's output was right but the parameter got no
    gradient (``None``), silently. Now the module runs eagerly, and gradients equal eager's."""
    from utils import ListedWeight
    x = torch.randn(3, 4)
    model, reference = ListedWeight(), ListedWeight()
    if front == "bridge":
        run = nnbridge.bridge(model, x)
    else:
        run = PatchableGraph(model, x)
    out, expected = run(x), reference(x)
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        assert got.grad is not None and torch.equal(got.grad, want.grad), name
    reasons = _opaque(model) if front == "bridge" else {k: v for e in run.extractions for k, v in e.opaque.items()}
    assert "reads parameter 'lin.weight', which requires grad" in reasons["<root>"]


# -- torch modules with a native fast path -------------------------------------------------------
class _SelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.attn(x, x, x, need_weights=False)[0])


def _encoder():
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
@pytest.mark.parametrize("make", [_SelfAttention, _encoder], ids=["multihead_attention", "encoder"])
@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_a_native_fast_path_runs_eagerly_where_eager_takes_it(front, make, mode):
    """In eval mode without grad, nn.MultiheadAttention and nn.TransformerEncoderLayer run a native
    fused op in eager code; a trace takes their Python path (export's tensors have a torch
    function), and the bridged output differed from eager without an error. Now those calls run
    eagerly (opaque, with the reason); with grad the module is still a graph."""
    torch.manual_seed(0)
    model = make().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    context = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with context():
        run, reasons = _extracted(front, model, x)
        assert torch.equal(run(x), reference(x))
    fast = {path: reason for path, reason in reasons.items() if "native fast path" in reason}
    if mode == "grad":
        assert not fast
    else:
        expected = {"attn"} if make is _SelfAttention else {"layers.0", "layers.1"}
        assert expected <= set(fast) and "<root>" not in fast, reasons


# -- strides and storage offsets: torch 2.13's unflatten turns them into the tensor itself -------
class StrideReader(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * x.stride(0)


class OffsetReader(StrideReader):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (x.storage_offset() + 1)


def _extracted(front: str, model: torch.nn.Module, x: torch.Tensor) -> tuple[Any, dict[str, str]]:
    """``model`` bridged in place or wrapped in a ``PatchableGraph`` (``front``), and its opaque
    modules' reasons."""
    if front == "bridge":
        return nnbridge.bridge(model, x), _opaque(model)
    pg = PatchableGraph(model, x)
    return pg, dict(pg.extractions[0].opaque)


LAYOUT_READERS = {"stride": (StrideReader, lambda n: torch.randn(n, 8)[:, :3]),
                  "storage offset": (OffsetReader, lambda n: torch.randn(n + 2, 3)[2:])}


@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
@pytest.mark.parametrize("case", list(LAYOUT_READERS))
def test_a_module_reading_a_stride_or_storage_offset_runs_eagerly(case, front):
    """``x.stride(0)`` of a sliced input (before: the graph multiplied by ``x`` itself, silently):
    that module runs its code, its parent stays a graph; outputs and gradients equal eager."""
    reader, make = LAYOUT_READERS[case]
    torch.manual_seed(0)
    model = Outer(reader())
    reference = copy.deepcopy(model)
    x = make(4)
    run, reasons = _extracted(front, model, x)
    # (a storage offset's name in the code is found before exporting: tests/guards/test_storage_reads.py)
    expected = ("storage_offset", "reads where a tensor lies") if case == "storage offset" else (case, "unflatten")
    assert list(reasons) == ["inner"] and all(text in reasons["inner"] for text in expected)
    for call in (x, make(6)):
        out, expected = run(call), reference(call)
        assert torch.equal(out, expected)
        out.sum().backward()
        expected.sum().backward()
    for name, grad in _grads(reference).items():
        assert torch.equal(_grads(model)[name], grad), name


def test_a_stride_read_honours_the_error_option():
    with pytest.raises(ExtractionError, match=r"'inner'.*stride"):
        PatchableGraph(Outer(StrideReader()), torch.randn(4, 8)[:, :3],
                       options=ExtractionOptions(error_on_compilation_failure=True))


class TwoReaders(torch.nn.Module):
    """Two children reading the same input's stride: export may read it once for both."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = StrideReader(), StrideReader()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def test_stride_reads_shared_by_two_modules_run_eagerly_where_they_are_used():
    torch.manual_seed(0)
    model = TwoReaders()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)[:, :3]
    nnbridge.bridge(model, x)
    reasons = _opaque(model)
    assert reasons and all("stride" in reason for reason in reasons.values()), reasons
    for call in (x, torch.randn(5, 16)[:, :3]):
        assert torch.equal(model(call), reference(call))


# -- Python's and numpy's RNGs: their draws are Python numbers a graph would keep ------------------
class PythonDraw(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * random.random()


class NumpyDraw(PythonDraw):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * float(numpy.random.rand())


def _seed() -> None:
    random.seed(0)
    numpy.random.seed(0)


@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
@pytest.mark.parametrize("drawer", [PythonDraw, NumpyDraw], ids=["python random", "numpy random"])
def test_a_module_drawing_from_python_or_numpy_random_runs_eagerly(drawer, front):
    """Each call draws anew, as eager (before, the graph kept the number drawn while extracting),
    and extracting draws nothing from the caller's RNGs: the draws after it follow eager's."""
    torch.manual_seed(0)
    model = Outer(drawer())
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3)
    _seed()
    run, reasons = _extracted(front, model, x)
    got = [run(x) for _ in range(2)], random.random(), float(numpy.random.rand())
    _seed()
    want = [reference(x) for _ in range(2)], random.random(), float(numpy.random.rand())
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0])) and got[1:] == want[1:]
    assert not torch.equal(got[0][0], got[0][1]), "two calls, two draws"
    assert list(reasons) == ["inner"] and "random" in reasons["inner"]


# -- torch.compiler.is_compiling() / is_exporting(): True while exporting, False in eager code -----
class CompileBranch(torch.nn.Module):
    def __init__(self, ask: Any) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.ask = ask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if self.ask() else y


def _transformers_is_compiling() -> bool:
    from transformers.utils import is_torchdynamo_compiling
    return is_torchdynamo_compiling()


COMPILE_QUESTIONS = {"torch.compiler.is_compiling": torch.compiler.is_compiling,
                     "torch.compiler.is_exporting": torch.compiler.is_exporting,
                     "torch._dynamo.is_compiling": lambda: torch._dynamo.is_compiling(),
                     "transformers.is_torchdynamo_compiling": _transformers_is_compiling}


@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
@pytest.mark.parametrize("question", list(COMPILE_QUESTIONS))
def test_a_module_asking_whether_it_is_compiled_runs_eagerly(question, front):
    """Before, the graph kept the compiled side of the branch (y * 2) while eager code takes the
    other, silently."""
    torch.manual_seed(0)
    model = Outer(CompileBranch(COMPILE_QUESTIONS[question]))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3)
    run, reasons = _extracted(front, model, x)
    assert torch.equal(run(x), reference(x))
    assert list(reasons) == ["inner"], reasons
    assert "is True while exporting and False in eager code" in reasons["inner"]
    assert "test_faithful_extraction" in reasons["inner"], "names the code that asked"


def test_torch_and_transformers_questions_keep_real_models_graphs():
    """transformers' and torch's own questions are trusted (their compiled and eager sides are
    kept equal by their own tests): the tiny Llama and GPT-2 stay graphs."""
    from utils import gpt2, llama
    for make in (gpt2, llama):
        model, reference = make(), make()
        ids = torch.randint(0, 100, (1, 6))
        nnbridge.bridge(model, ids)
        assert torch.equal(model(ids).logits, reference(ids).logits)
        assert not _opaque(model), _opaque(model)


class DrawsThenCalls(torch.nn.Module):
    """Draws before calling a child that draws nothing: the draw is its own."""

    def __init__(self) -> None:
        super().__init__()
        self.child = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x * random.random())


def test_a_module_drawing_before_calling_a_child_runs_eagerly():
    """Before, its child's return made the watch forget the caller's draw: the graph kept the number
    drawn while extracting, silently."""
    torch.manual_seed(0)
    model = Outer(DrawsThenCalls())
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3)
    run, reasons = _extracted("bridge", model, x)
    _seed()
    got = [run(x) for _ in range(2)]
    _seed()
    want = [reference(x) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert list(reasons) == ["inner"] and "random" in reasons["inner"]
