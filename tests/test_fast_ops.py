"""An in-place bridge runs its graphs' generated code with aten operators called through their
handles (``nnbridge.compat.fast_ops``): the same operators, outputs and gradients as eager;
torch.compile still traces the plain code."""

import copy

import torch

import nnbridge
from nnbridge.bridge.graph_module import CompiledGraphModule
from nnbridge.bridge.in_place import BRIDGE_KEY
from nnbridge.compat.fast_ops import FAST_TORCH, with_fast_ops
from utils import assert_same, gpt2, llama

IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])


def test_fast_torch_resolves_plain_overloads_to_their_handles_and_everything_else_to_torch():
    assert FAST_TORCH.ops.aten.addmm.default is torch.ops.aten.addmm.default._op
    assert FAST_TORCH.ops.aten.add.Tensor is torch.ops.aten.add.Tensor._op
    assert FAST_TORCH.ops.aten.sym_size.int is torch.ops.aten.sym_size.int._op
    assert FAST_TORCH.ops.higher_order.cond is torch.ops.higher_order.cond, "not an OpOverload: kept"
    assert FAST_TORCH.float32 is torch.float32 and FAST_TORCH.Tensor is torch.Tensor
    assert FAST_TORCH.fx._pytree is torch.fx._pytree


def test_the_twin_shares_the_code_and_computes_the_same():
    namespace = {"torch": torch}
    exec("def forward(self, x, y):\n    return torch.ops.aten.mul.Tensor(torch.ops.aten.add.Tensor(x, y), 2)\n",
         namespace)
    plain = namespace["forward"]
    fast = with_fast_ops(plain)
    assert fast.__code__ is plain.__code__ and fast.__globals__["torch"] is FAST_TORCH
    assert namespace["torch"] is torch, "the plain function's globals are untouched"
    x, y = torch.randn(3), torch.randn(3)
    assert torch.equal(fast(None, x, y), plain(None, x, y))
    assert with_fast_ops(fast) is fast, "code without the real torch is returned as is"


def _graphs(model):
    stack, seen = [e.root for e in model.__dict__[BRIDGE_KEY].dispatcher.all_extractions()], []
    while stack:
        graph = stack.pop()
        if isinstance(graph, CompiledGraphModule):
            seen.append(graph)
            stack += (graph.graph_meta.graph_children or {}).values()
    return seen


def test_bridged_forward_runs_the_twins_and_equals_eager_with_gradients():
    for make in (gpt2, llama):
        eager = make()
        model = copy.deepcopy(eager)
        nnbridge.bridge(model, IDS)
        out, want = model(IDS), eager(IDS)
        assert_same(out, want)
        graphs = _graphs(model)
        assert graphs and all(g.__dict__["_fast_forward"][1].__globals__["torch"] is FAST_TORCH for g in graphs)
        out.logits.square().sum().backward()
        want.logits.square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert torch.equal(p.grad, q.grad), name


def test_a_patched_op_still_routes_through_its_op_point():
    eager = gpt2()
    model = copy.deepcopy(eager)
    with torch.no_grad():
        nnbridge.bridge(model, IDS, use_cache=False)
        handle = model.get_submodule("transformer.h.0.attn.softmax").register_forward_hook(lambda m, a, o: o * 0)
        zeroed = model(IDS, use_cache=False).logits
        handle.remove()
        assert not torch.equal(zeroed, eager(IDS, use_cache=False).logits)
        assert torch.equal(model(IDS, use_cache=False).logits, eager(IDS, use_cache=False).logits)
