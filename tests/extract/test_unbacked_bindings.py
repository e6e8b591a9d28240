"""Export's unbacked-binding pass (``nnbridge.compat.torch.unbacked``) is skipped only when the trace made
no unbacked symbol: a data-dependent size (``nonzero``) still gets torch's bindings, and the
bridged module equals eager."""

import copy

import pytest
import torch

import nnbridge
from nnbridge.compat.torch.export import export
from nnbridge.compat.torch.unbacked import unbacked_bindings_pass_narrowed
from utils import assert_same


class Selects(torch.nn.Module):
    """Keeps the positive entries: a size only known at run time."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x)
        return y[y > 0].sum() + y.nonzero().shape[0]


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x).relu()


def bindings(module, x):
    exported = export(module, (x,), dynamic_shapes=None, preserve_module_call_signature=())
    return [node.meta["unbacked_bindings"] for node in exported.graph.nodes if node.meta.get("unbacked_bindings")]


def test_a_data_dependent_size_keeps_torchs_unbacked_bindings():
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    assert bindings(Selects(), x), "torch's pass ran: nonzero's size is bound"
    assert bindings(Plain(), x) == []


def test_a_bridged_module_with_a_data_dependent_size_equals_eager():
    torch.manual_seed(0)
    module = Selects().eval()
    eager = copy.deepcopy(module)
    x = torch.randn(3, 4)
    nnbridge.bridge(module, x)
    for seed in range(3):
        torch.manual_seed(seed)
        inputs = torch.randn(3, 4)
        assert_same(module(inputs), eager(inputs))


def test_the_pass_is_restored_also_on_error():
    import torch.export._trace as trace
    original = trace._replace_unbacked_bindings
    with pytest.raises(RuntimeError, match="inside"):
        with unbacked_bindings_pass_narrowed():
            assert trace._replace_unbacked_bindings is not original
            raise RuntimeError("inside")
    assert trace._replace_unbacked_bindings is original
