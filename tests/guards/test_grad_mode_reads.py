"""A graph extracted with grad enabled serves the same call under ``torch.no_grad()``, unless the
code read grad mode while it was extracted (``torch.is_grad_enabled()``, a computed tensor's
``requires_grad`` / ``grad_fn`` / ``is_leaf``, ``torch.enable_grad()``): then the call extracts
again, as before. Compared with the untouched model by ``torch.equal``."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import nnbridge
from nnbridge import PatchableGraph, ZeroPatch
from nnbridge.compat.torch.grad_reads import grad_mode_reads
from nnbridge.inplace.bridging import bridge_of
from utils import assert_same_grads, gpt2, llama, no_grad_rotary

_NO_GRAD_AGAIN = "grad mode changed (enabled -> disabled)"


def _history(model: nn.Module) -> list[str]:
    return [e.reason for e in bridge_of(model).dispatcher.history]


def _llama_no_grad_rotary():
    return no_grad_rotary(llama())


@pytest.mark.parametrize("factory", [gpt2, llama, _llama_no_grad_rotary], ids=["gpt2", "llama", "llama-no-grad-rotary"])
def test_a_no_grad_call_is_served_by_the_grad_mode_graph(factory):
    """No second extraction; the logits equal eager under no_grad (and require no grad); a later
    call with grad still gives eager's gradients. The rotary embedding under ``@torch.no_grad()``
    changes grad mode (it runs its own code), which reads nothing."""
    model, reference = factory(), factory()
    ids = torch.randint(0, 100, (2, 7))
    nnbridge.bridge(model, ids)
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert torch.equal(got, want) and not got.requires_grad
    got, want = model(ids).logits, reference(ids).logits
    got.square().sum().backward()
    want.square().sum().backward()
    assert torch.equal(got, want)
    assert_same_grads(model, reference)
    assert _history(model) == ["first call"]


def test_a_patch_applies_to_a_no_grad_call_of_the_grad_mode_graph():
    model, reference = gpt2(), gpt2()
    ids = torch.randint(0, 100, (1, 6))
    pg = PatchableGraph(model, ids)
    reference.transformer.h[0].mlp.act.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
    with torch.no_grad(), pg.patch({"transformer.h_0.mlp.act.output": ZeroPatch()}):
        got = pg(ids).logits
    with torch.no_grad():
        assert torch.equal(got, reference(ids).logits)
    assert len(pg._dispatcher.history) == 1


class _ReadsGradMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * 2 if torch.is_grad_enabled() else self.fc(x) - 1


def _requires_grad(t: torch.Tensor) -> bool:
    return t.requires_grad


class _ReadsRequiresGrad(_ReadsGradMode):
    def forward(self, x):
        h = self.fc(x)
        return h * 2 if _requires_grad(h) else h - 1  # (read in a helper function)


class _ReadsGradFn(_ReadsGradMode):
    def forward(self, x):
        h = self.fc(x)
        return h * 2 if h.grad_fn is not None else h - 1


class _ReadsIsLeaf(_ReadsGradMode):
    def forward(self, x):
        h = self.fc(x)
        return h - 1 if h.is_leaf else h * 2


class _EnablesGrad(_ReadsGradMode):
    def forward(self, x):
        with torch.enable_grad():
            return self.fc(x) * 2


class _Attention(nn.Module):
    """``nn.MultiheadAttention`` asks ``torch.is_grad_enabled()`` to choose its native fast path."""

    def __init__(self):
        super().__init__()
        self.attn, self.fc = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(self.attn(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize("cls", [_ReadsGradMode, _ReadsRequiresGrad, _ReadsGradFn, _ReadsIsLeaf, _EnablesGrad, _Attention])
def test_code_reading_grad_mode_extracts_again_under_no_grad(cls):
    torch.manual_seed(0)
    model = cls().eval()
    reference = cls().eval()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 8) if cls is _Attention else torch.randn(3, 4)
    nnbridge.bridge(model, x)
    assert torch.equal(model(x), reference(x))
    with torch.no_grad():
        got, want = model(x), reference(x)
    assert torch.equal(got, want) and got.requires_grad == want.requires_grad
    assert _history(model)[:2] == ["first call", _NO_GRAD_AGAIN]


@pytest.mark.no_extraction_cache
def test_under_another_profile_function_grad_mode_reads_are_unknown():
    """A profiler or debugger holding ``sys.setprofile`` is left in place; the extraction then
    cannot tell whether the code read grad mode, and a no_grad call extracts again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Tanh())  # (sizes no other test extracts: no cached record)
    x = torch.randn(2, 5)
    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append(event))
    try:
        nnbridge.bridge(model, x)
        assert sys.getprofile() is not None
    finally:
        sys.setprofile(None)
    assert calls, "the other profile function kept running"
    with torch.no_grad():
        got = model(x)
    assert _history(model) == ["first call", _NO_GRAD_AGAIN]
    nnbridge.unbridge(model)
    with torch.no_grad():
        assert torch.equal(got, model(x))


def test_grad_mode_reads_reports_only_the_reads_and_restores_the_profile_function():
    seen: list[str] = []
    unwatched: list[bool] = []
    x = torch.randn(2, requires_grad=True)
    with grad_mode_reads(lambda: seen.append("read"), on_unwatched=lambda: unwatched.append(True)):
        y = (x * 2).sum()
        with torch.no_grad():  # torch's context managers read the mode to put it back: not a read
            y + 1
    assert seen == [] and unwatched == [] and sys.getprofile() is None
    with grad_mode_reads(lambda: seen.append("read"), on_unwatched=lambda: unwatched.append(True)):
        torch.is_grad_enabled()
        _requires_grad(y)
    assert seen == ["read", "read"] and sys.getprofile() is None


def test_a_direct_call_of_the_root_graph_under_no_grad():
    """The root graph's own entry check accepts a no_grad call of a graph serving one; for code
    that reads grad mode it runs the call through the dispatcher, which extracts a no_grad graph
    (the grad-mode graph would take the other branch)."""
    x = torch.randn(3, 4)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    pg = PatchableGraph(plain, x)
    with torch.no_grad():
        assert torch.equal(pg._dispatcher.history[0].root(x), plain(x))
    assert len(pg._dispatcher.history) == 1
    reads = _ReadsGradMode()
    pg = PatchableGraph(reads, x)
    with torch.no_grad():
        assert torch.equal(pg._dispatcher.history[0].root(x), reads(x))
    assert len(pg._dispatcher.history) == 2


@pytest.mark.no_extraction_cache
def test_a_graph_read_from_the_disk_cache_keeps_what_its_code_read(tmp_path, monkeypatch, exports):
    """The reads are stored with the program: a model bridged from the cache (no eager run before
    an export) serves no_grad calls, or not, as the one that was exported."""
    monkeypatch.setenv("NNBRIDGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("NNBRIDGE_EXTRACTION_CACHE", raising=False)
    ids = torch.randint(0, 100, (1, 6))
    nnbridge.bridge(gpt2(), ids)
    model, reference = gpt2(), gpt2()
    nnbridge.bridge(model, ids)
    assert exports[0] == 1
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert _history(model) == ["first call"] and exports[0] == 1
    x = torch.randn(3, 4)
    torch.manual_seed(0)
    nnbridge.bridge(_ReadsGradMode(), x)
    torch.manual_seed(0)
    model, reference = _ReadsGradMode(), _ReadsGradMode()
    reference.load_state_dict(model.state_dict())
    nnbridge.bridge(model, x)
    assert exports[0] == 2
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert _history(model) == ["first call", _NO_GRAD_AGAIN]


class _GradGate(nn.Module):
    """An inserted module whose code reads grad mode."""

    def forward(self, x):
        return x * 2 if torch.is_grad_enabled() else x - 1


def test_an_inserted_module_reading_grad_mode_follows_it_under_no_grad():
    from nnbridge import surgery

    model, reference = llama(), llama()
    ids = torch.randint(0, 100, (1, 6))
    nnbridge.bridge(model, ids)
    surgery.insert_after(model, "model.layers_1.mlp.output", _GradGate())
    gate = _GradGate()
    reference.model.layers[1].mlp.register_forward_hook(lambda m, a, out: gate(out))
    assert torch.equal(model(ids).logits, reference(ids).logits)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
