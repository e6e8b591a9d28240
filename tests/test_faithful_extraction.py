"""Faithful or loud: extraction either captures a module exactly or leaves it opaque with a reason.

Each test compares against an untouched copy of the model run eagerly (torch.equal): grad-mode
changes and grad-mode branches inside forward, custom autograd Functions, buffers re-assigned in
forward, Python side effects on module attributes, and extraction itself leaving the model's state
and the RNG untouched.
"""

from __future__ import annotations

import copy

import pytest
import torch

import nnbridge
from nnbridge import ExtractionOptions, PatchableGraph
from nnbridge.bridge.in_place import bridge_of
from nnbridge.errors import ExtractionError, NNBridgeWarning


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
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


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


@pytest.mark.parametrize("front", ["bridge", "pg"])
@pytest.mark.parametrize("inner, attribute", [(Counter, "calls"), (Appender, "seen"), (Cacher, "last")])
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
    if front == "bridge":
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
