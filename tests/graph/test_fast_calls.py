"""A graph module called as a module (a PatchableGraph's graphs, each calling its children) runs
its generated code with fast operator calls (``nnbridge.compat.torch.fast_ops``) while
``nn.Module.__call__`` would only run ``forward``; with a hook, an instance wrapper or a trace
running, the normal call runs (``nnbridge.compat.torch.forwards.runs_only_forward``)."""

import copy

import pytest
import torch

import nnbridge
from nnbridge.compat.torch.forwards import runs_only_forward
from nnbridge.graph.graph_module import CompiledGraphModule
from utils import assert_same, assert_same_grads, gpt2, llama

IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])


def _graphs(pg):
    """The graph modules of ``pg``'s extractions."""
    return [m for e in pg.extractions for m in e.root.modules() if isinstance(m, CompiledGraphModule)]


def _forget_fast_code(graphs):
    for graph in graphs:
        graph.__dict__.pop("_fast_forward", None)


@pytest.mark.parametrize("make", [gpt2, llama])
def test_a_patchable_graph_runs_the_fast_code_and_equals_eager_with_gradients(make):
    eager = make()
    pg = nnbridge.PatchableGraph(copy.deepcopy(eager), IDS)
    graphs = _graphs(pg)
    _forget_fast_code(graphs)
    out, want = pg(IDS), eager(IDS)
    assert graphs and all("_fast_forward" in graph.__dict__ for graph in graphs), \
        "each graph ran its fast code (made on its first fast call)"
    assert_same(out, want)
    out.logits.square().sum().backward()
    want.logits.square().sum().backward()
    assert_same_grads(pg, eager)


def test_a_hook_on_a_graph_module_fires_through_the_normal_call():
    eager = gpt2()
    pg = nnbridge.PatchableGraph(copy.deepcopy(eager), IDS)
    mlp = pg._graph_module.get_submodule("transformer.h.0.mlp")
    assert isinstance(mlp, CompiledGraphModule)
    seen = []
    handle = mlp.register_forward_hook(lambda module, args, output: seen.append(output) or output * 0)
    _forget_fast_code(_graphs(pg))
    with torch.no_grad():
        hooked = pg(IDS).logits
    handle.remove()
    assert len(seen) == 1, "the hook fired once"
    assert "_fast_forward" not in mlp.__dict__, "the hooked module ran nn.Module.__call__ and its plain code"
    assert "_fast_forward" in pg._graph_module.get_submodule("transformer.h.0.attn").__dict__
    with torch.no_grad():
        assert not torch.equal(hooked, eager(IDS).logits)
        assert torch.equal(pg(IDS).logits, eager(IDS).logits)


def test_a_patch_through_the_fast_code_applies():
    eager = gpt2()
    pg = nnbridge.PatchableGraph(copy.deepcopy(eager), IDS)
    with torch.no_grad(), pg.patch({"transformer.h_0.attn.softmax": nnbridge.ZeroPatch()}):
        patched = pg(IDS).logits
    with torch.no_grad():
        assert not torch.equal(patched, eager(IDS).logits)
        assert torch.equal(pg(IDS).logits, eager(IDS).logits)


def _module():
    return torch.nn.Linear(2, 2)


def test_runs_only_forward_is_true_for_a_plain_module():
    assert runs_only_forward(_module())


@pytest.mark.parametrize("hook", ["forward", "forward_pre", "full_backward", "full_backward_pre"])
def test_runs_only_forward_is_false_with_a_hook_on_the_module(hook):
    module = _module()
    handle = getattr(module, f"register_{hook}_hook")(lambda *args: None)
    assert not runs_only_forward(module)
    handle.remove()
    assert runs_only_forward(module)


@pytest.mark.parametrize("hook", ["forward", "forward_pre"])
def test_runs_only_forward_is_false_with_a_global_hook(hook):
    module = _module()
    handle = getattr(torch.nn.modules.module, f"register_module_{hook}_hook")(lambda *args: None)
    try:
        assert not runs_only_forward(module)
    finally:
        handle.remove()
    assert runs_only_forward(module)


def test_runs_only_forward_is_false_with_a_forward_or_call_impl_set_on_the_instance():
    wrapped = _module()
    wrapped.forward = lambda x: x
    assert not runs_only_forward(wrapped)
    impl = _module()
    impl._call_impl = lambda *args, **kwargs: None
    assert not runs_only_forward(impl)


def test_runs_only_forward_is_false_while_fx_traces_symbolically():
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(runs_only_forward(self))
            return x + 1

    torch.fx.symbolic_trace(Probe())
    Probe()(torch.ones(1))
    assert seen == [False, True]


def test_the_graph_classes_keep_their_own_call_not_torch_fx_wrapper():
    pg = nnbridge.PatchableGraph(gpt2(), IDS)
    graphs = [m for m in pg.modules() if isinstance(m, CompiledGraphModule)]
    assert graphs
    for graph in graphs:
        own = vars(type(graph)).get("__call__")
        assert own is None or own is CompiledGraphModule._checked_call, type(graph).__name__
