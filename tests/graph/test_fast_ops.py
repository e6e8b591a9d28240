"""An in-place bridge runs its graphs' generated code with aten operators called through their
handles (``nnbridge.compat.torch.fast_ops``): the same operators, outputs and gradients as eager;
torch.compile still traces the plain code."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nnbridge
from nnbridge.graph.graph_module import CompiledGraphModule
from nnbridge.inplace.bridging import BRIDGE_KEY
from nnbridge.compat.torch.fast_ops import FAST_TORCH, UNBOXED, UNBOXED_TORCH, bindings_fit, with_fast_ops
from utils import assert_same, assert_same_grads, gpt2, llama

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
        assert graphs and all(g.__dict__["_fast_forward"][1].__globals__["torch"] is UNBOXED_TORCH for g in graphs), \
            "every call of these graphs fits the bindings"
        out.logits.square().sum().backward()
        want.logits.square().sum().backward()
        assert_same_grads(model, eager)


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


# -- UNBOXED: the Python binding of an operator runs the same overload as its handle -----------

class _Dispatched(TorchDispatchMode):
    """Records every operator overload dispatched below autograd."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _events(call):
    """Names of the top-level operator events the profiler records for ``call()``."""
    with torch.autograd.profiler.profile() as profile:
        call()
    return [event.name for event in profile.function_events if event.cpu_parent is None]


_X, _Y = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
_W, _B, _M = torch.randn(5, 4), torch.randn(5), torch.randn(4, 5)
#: calls of each UNBOXED overload as generated graph code makes them: positional arguments in
#: schema order, Python numbers where a tensor operand may be one, the keywords the entry allows
_CALLS = {
    "aten::mul.Tensor": [((_X, _Y), {}), ((_X, 0.5), {}), ((_X, 2), {}), ((_X.int(), 3), {})],
    "aten::add.Tensor": [((_X, _Y), {}), ((_X, 1), {}), ((_X, _Y), {"alpha": 2}), ((_X.int(), 1.5), {})],
    "aten::sub.Tensor": [((_X, _Y), {}), ((_X, 1.0), {"alpha": 3})],
    "aten::div.Tensor": [((_X, _Y), {}), ((_X, 3.0), {}), ((_X.int(), 2), {})],
    "aten::linear": [((_X, _W, _B), {}), ((_X, _W), {}), ((_X, _W, None), {})],
    "aten::addmm": [((_B, _X[0], _W.t()), {}), ((_B, _X[0], _W.t()), {"beta": 0.5, "alpha": 2})],
    "aten::mm": [((_X[0], _M), {})],
    "aten::bmm": [((_X, _X.transpose(1, 2)), {})],
    "aten::matmul": [((_X, _M), {}), ((_X, _X.transpose(1, 2)), {})],
    "aten::transpose.int": [((_X, 1, 2), {}), ((_X, -1, 0), {})],
    "aten::t": [((_W,), {})],
    "aten::permute": [((_X, [2, 0, 1]), {})],
    "aten::unsqueeze": [((_X, 1), {}), ((_X, -1), {})],
    "aten::cat": [(([_X, _Y], -1), {}), (([_X, _Y],), {})],
    "aten::view": [((_X, [6, 4]), {}), ((_X, [-1]), {})],
    "aten::reshape": [((_X, [6, 4]), {}), ((_X.transpose(1, 2), [-1]), {})],
    "aten::expand": [((_X[:, :1], [2, 3, 4]), {}), ((_X[:, :1], [2, 3, 4]), {"implicit": True})],
    "aten::clone": [((_X,), {}), ((_X.transpose(1, 2),), {"memory_format": torch.contiguous_format})],
    "aten::pow.Tensor_Scalar": [((_X, 2), {}), ((_X.abs(), 0.5), {})],
    "aten::mean.dim": [((_X, [-1], True), {}), ((_X, [-1]), {}), ((_X, [1, 2], False), {"dtype": torch.float64})],
    "aten::rsqrt": [((_X.abs(),), {})],
    "aten::neg": [((_X,), {})],
    "aten::tanh": [((_X,), {})],
    "aten::silu": [((_X,), {})],
    "aten::softmax.int": [((_X, -1), {}), ((_X, 1, torch.float64), {}), ((_X, -1), {"dtype": torch.float64})],
    "aten::dropout": [((_X, 0.1, False), {})],
    "aten::layer_norm": [((_X, [4], _W[0], _B[:4], 1e-5, True), {}), ((_X, [4]), {})],
    "aten::embedding": [((_W, torch.tensor([[0, 1], [4, 2]]), -1, False, False), {}), ((_W, torch.tensor([0, 3]), 1), {})],
    "aten::to.dtype": [((_X, torch.float64), {}), ((_X, torch.float32), {}), ((_X, torch.float16, False, True), {}),
                       ((_X, torch.float64), {"memory_format": torch.preserve_format})],
    "aten::detach_": [((_X.clone(),), {}), ((torch.randn(3, requires_grad=True) * 2,), {})],
}


def _overload(name):
    packet, _, overload = name.split("::")[1].partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def test_every_unboxed_overload_is_checked_below():
    assert set(_CALLS) == set(UNBOXED)


@pytest.mark.parametrize("name", sorted(UNBOXED))
def test_an_unboxed_binding_runs_its_overload_with_the_same_ops_events_and_result(name):
    overload, (binding, keywords) = _overload(name), UNBOXED[name]
    assert overload.name() == name
    packet = getattr(UNBOXED_TORCH.ops.aten, overload.__name__.split(".")[0])
    assert getattr(packet, overload._overloadname) is binding, "generated code resolves the overload to its binding"
    most = max(n for n in range(len(overload._schema.arguments) + 1) if bindings_fit([(overload, (None,) * n, {})]))
    assert max(len(args) for args, _ in _CALLS[name]) == most, "checked with every positional argument it allows"
    for args, kwargs in _CALLS[name]:
        assert kwargs.keys() <= keywords and bindings_fit([(overload, args, kwargs)])
        with _Dispatched() as by_handle:
            want = overload._op(*args, **kwargs)
        with _Dispatched() as by_binding:
            got = binding(*args, **kwargs)
        assert by_binding.ops == by_handle.ops, "the same overloads dispatched (none: dropout in eval)"
        assert _events(lambda: binding(*args, **kwargs)) == _events(lambda: overload._op(*args, **kwargs)) \
            == [name.split(".")[0]], "the same operator called"
        assert type(got) is type(want) and got.dtype == want.dtype and got.stride() == want.stride()
        assert torch.equal(got, want)


def test_bindings_fit_refuses_a_keyword_its_entry_does_not_allow_and_extra_positional_arguments():
    softmax, add = torch.ops.aten.softmax.int, torch.ops.aten.add.Tensor
    assert bindings_fit([(softmax, (_X, -1), {"dtype": torch.float64}), (add, (_X, _Y), {"alpha": 2})])
    assert not bindings_fit([(softmax, (_X,), {"dim": -1})]), "a positional argument by keyword"
    assert not bindings_fit([(add, (_X, _Y, 2), {})]), "alpha is keyword-only in the schema"
    to = torch.ops.aten.to.dtype
    assert bindings_fit([(to, (_X, torch.float64, False, False), {"memory_format": None})])
    assert not bindings_fit([(to, (_X, torch.float64, False, False, None), {})]), "Tensor.to: memory_format by keyword"
    assert bindings_fit([(torch.ops.aten.div.Tensor_mode, (_X, _Y), {"rounding_mode": "floor"})]), "not UNBOXED"


class _Softmax(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x * 2, -1) + 1


def test_a_graph_with_a_call_that_does_not_fit_the_bindings_runs_the_handles_and_equals_eager():
    eager, x = _Softmax(), torch.randn(2, 5)
    model = copy.deepcopy(eager)
    nnbridge.bridge(model, x)
    [graph] = _graphs(model)
    assert torch.equal(model(x), eager(x))
    assert graph.__dict__["_fast_forward"][1].__globals__["torch"] is UNBOXED_TORCH
    [node] = [n for n in graph.graph.nodes if n.target is torch.ops.aten.softmax.int]
    node.args, node.kwargs = (node.args[0],), {"dim": node.args[1]}
    graph.recompile()
    assert torch.equal(model(x), eager(x))
    assert graph.__dict__["_fast_forward"][1].__globals__["torch"] is FAST_TORCH
