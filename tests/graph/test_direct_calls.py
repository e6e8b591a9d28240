"""A parent graph calls a child's body directly when the child's call would run nothing else
(``nnbridge.compat.DirectCall``), and through ``module(...)`` as soon as anything else would run:
a hook (per module or global), a replaced ``forward`` slot, a TorchScript trace, ``module.compile()``.
Every output equals eager with the same hook."""

import copy

import pytest
import torch
from torch.nn.modules import module as module_impl

import nnbridge
from nnbridge.inplace.bridging import BRIDGE_KEY, Bridge, _CallSite
from utils import assert_same, assert_same_grads, gpt2

IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])


def call_sites(model):
    """Every call site of the model's graphs (reached from its bridge's root extractions)."""
    sites, stack = [], [e.root for e in model.__dict__[BRIDGE_KEY].dispatcher.all_extractions()]
    while stack:
        graph = stack.pop()
        sites += [site for site in vars(graph).get("_call_sites", {}).values() if isinstance(site, _CallSite)]
        stack += (graph.graph_meta.graph_children or {}).values()
    return sites


@pytest.fixture
def bridged():
    eager = gpt2()
    model = copy.deepcopy(eager)
    with torch.no_grad():
        nnbridge.bridge(model, IDS, use_cache=False)
    return model, eager


@pytest.fixture
def direct_calls(monkeypatch):
    """``[path of each module whose body a call site ran directly]``."""
    seen = []
    original = Bridge.chosen

    def chosen(self, module, graph, args, *, kwargs, extras=()):
        seen.append(module)
        return original(self, module, graph, args, kwargs=kwargs, extras=extras)
    monkeypatch.setattr(Bridge, "chosen", chosen)
    return seen


def test_every_call_site_runs_its_body_directly_and_equals_eager(bridged, direct_calls):
    model, eager = bridged
    sites = call_sites(model)
    assert sites and all(site.direct() for site in sites)
    with torch.no_grad():
        assert_same(model(IDS, use_cache=False), eager(IDS, use_cache=False))
    assert {id(m) for m in direct_calls} == {id(site.module) for site in sites}


def _forward_hook(module, args, output):
    return output * 2


def _pre_hook(module, args):
    return (args[0] + 1,)


REGISTER = {
    "forward hook": lambda m: m.register_forward_hook(_forward_hook),
    "forward pre-hook": lambda m: m.register_forward_pre_hook(_pre_hook),
    "forward hook with kwargs": lambda m: m.register_forward_hook(lambda mod, a, k, out: out * 2, with_kwargs=True),
    "global forward hook": lambda m: module_impl.register_module_forward_hook(
        lambda mod, a, out: out * 2 if mod is m else None),
    "global forward pre-hook": lambda m: module_impl.register_module_forward_pre_hook(
        lambda mod, a: (a[0] + 1,) if mod is m else None),
}


@pytest.mark.parametrize("kind", REGISTER)
def test_a_hook_registered_after_bridging_runs_and_equals_eager_with_it(bridged, direct_calls, kind):
    model, eager = bridged
    target = model.transformer.h[0].mlp.c_fc
    handles = [REGISTER[kind](target), REGISTER[kind](eager.transformer.h[0].mlp.c_fc)]
    try:
        site = next(s for s in call_sites(model) if s.module is target)
        assert not site.direct()
        with torch.no_grad():
            got, want = model(IDS, use_cache=False), eager(IDS, use_cache=False)
        assert_same(got, want)
        assert target not in direct_calls
        if kind.startswith("global"):  # every module has a hook now
            assert direct_calls == []
        else:
            assert direct_calls, "the other modules still run directly"
    finally:
        for handle in handles:
            handle.remove()
    assert site.direct(), "direct again once the hook is removed"
    with torch.no_grad():
        assert not torch.equal(model(IDS, use_cache=False).logits, got.logits), "the hook changed the output"


def test_a_full_backward_hook_runs_and_gradients_equal_eager(bridged, direct_calls):
    model, eager = bridged
    grads = {}
    for name, m in (("bridged", model), ("eager", eager)):
        m.transformer.h[1].mlp.register_full_backward_hook(
            lambda mod, gin, gout, name=name: grads.__setitem__(name, gout[0].clone()))
    site = next(s for s in call_sites(model) if s.module is model.transformer.h[1].mlp)
    assert not site.direct()
    for m in (model, eager):
        m(IDS, use_cache=False).logits.sum().backward()
    assert torch.equal(grads["bridged"], grads["eager"])
    assert_same_grads(model, eager)


def test_a_replaced_forward_slot_or_compiled_call_is_not_called_directly(bridged):
    model, _ = bridged
    target = model.transformer.h[0].attn
    site = next(s for s in call_sites(model) if s.module is target)
    assert site.direct()
    slot = target.__dict__["forward"]
    target.__dict__["forward"] = lambda *a, **k: slot(*a, **k)
    assert not site.direct()
    target.__dict__["forward"] = slot
    assert site.direct()
    target.__dict__["_compiled_call_impl"] = target._call_impl
    assert not site.direct()
    target.__dict__["_compiled_call_impl"] = None
    impl = target.__dict__["_call_impl"]
    target.__dict__["_call_impl"] = lambda *a, **k: impl(*a, **k)
    assert not site.direct()
    target.__dict__["_call_impl"] = impl
    assert site.direct()


def test_no_direct_call_after_unbridge(bridged):
    model, eager = bridged
    sites = call_sites(model)
    assert sites
    nnbridge.unbridge(model)
    assert not any(site.direct() for site in sites)
    with torch.no_grad():
        assert_same(model(IDS, use_cache=False), eager(IDS, use_cache=False))


class _Tripled(torch.nn.Linear):
    """A class that overrides ``__call__`` around ``nn.Module``'s (as some libraries do)."""

    def __call__(self, x):
        return super().__call__(x * 2) * 3


class _ForwardCalled(torch.nn.Linear):
    """An override that never calls ``nn.Module.__call__``: export sees no call of this module."""

    def __call__(self, x):
        return self.forward(x) * 3


class _Parent(torch.nn.Module):
    def __init__(self, child_class):
        super().__init__()
        self.child = child_class(4, 4)
        self.post = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.post(torch.relu(self.child(x))) + 1


@pytest.mark.parametrize("child_class", [_Tripled, _ForwardCalled])
def test_a_child_class_overriding_call_runs_its_override_once(child_class):
    """The override runs in the parent's frame, so the parent's graph holds what it adds and the
    call site stands for its ``super().__call__`` (before, the override ran again from the call
    site: x9 instead of x3, silently). With a forward hook on the child, in a PatchableGraph and an
    nnsight trace reading the child's output, everything equals eager."""
    torch.manual_seed(0)
    model = _Parent(child_class)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    graph = nnbridge.PatchableGraph(copy.deepcopy(reference), x)
    assert torch.equal(graph(x), reference(x))
    nnbridge.bridge(model, x)
    assert torch.equal(model(x), reference(x))
    seen, seen_reference = [], []
    model.child.register_forward_hook(lambda m, a, out: seen.append(out))
    reference.child.register_forward_hook(lambda m, a, out: seen_reference.append(out))
    assert torch.equal(model(x), reference(x))
    assert len(seen) == len(seen_reference) and all(map(torch.equal, seen, seen_reference))
    wrapper = nnbridge.NNsight(model)
    with wrapper.trace(x):
        post = wrapper.post.input.save()
    assert torch.equal(post, torch.relu(reference.child(x)))
