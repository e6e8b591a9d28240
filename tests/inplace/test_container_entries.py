"""A bridged module container (``nn.Sequential``, a ``ModuleList`` or ``ModuleDict`` subclass with a
forward, such as ``torch.nn.utils.parametrize``'s ``ParametrizationList``) keeps eager's entries: its
op points are not registered in it, so ``len``, indices, iteration and ``append``'s next index are
eager's, for the user's code and for the container's own (a parametrization stacked after bridging
runs: corpus entry ``parametrize_stacked_after_bridging``). Its ops stay reachable through
PatchableGraph NodePaths, and an envoy's missing op says so."""

import copy

import pytest
import torch
from torch import nn

import nnbridge


def _sequential():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


class Pair(nn.ModuleList):
    def forward(self, x):
        return self[0](x) + self[1](x)


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.pair = Pair([nn.Linear(3, 3), nn.Linear(3, 3)])

    def forward(self, x):
        return self.pair(x).relu()


def test_a_bridged_sequential_keeps_its_entries_and_appends_as_eager():
    eager = _sequential()
    model = copy.deepcopy(eager)
    x = torch.randn(2, 3)
    nnbridge.bridge(model, x)
    assert torch.equal(model(x), eager(x))
    assert len(model) == len(eager) == 3
    assert list(model._modules) == list(eager._modules)
    assert [type(m) for m in model] == [type(m) for m in eager]
    assert model[-1] is model._modules["2"] and type(model[-1]) is nn.Linear
    torch.manual_seed(1)
    eager.append(nn.Linear(2, 2))
    torch.manual_seed(1)
    model.append(nn.Linear(2, 2))
    assert list(model._modules) == list(eager._modules) == ["0", "1", "2", "3"]
    assert torch.equal(model(x), eager(x))
    nnbridge.unbridge(model)
    assert list(model._modules) == ["0", "1", "2", "3"]


def test_a_container_subclass_keeps_its_entries_and_its_ops_are_patchable_by_node_path():
    torch.manual_seed(0)
    eager = Root()
    model = copy.deepcopy(eager)
    x = torch.randn(2, 3)
    nnbridge.bridge(model, x)
    assert torch.equal(model(x), eager(x))
    assert len(model.pair) == 2 and list(model.pair._modules) == ["0", "1"]
    assert hasattr(model.pair[0], "linear")  # its entries' own op points are where they were
    pg = nnbridge.PatchableGraph(copy.deepcopy(eager), x)
    with pg.patch({"pair.add": nnbridge.ZeroPatch()}):
        assert torch.equal(pg(x), torch.zeros(2, 3))
    assert torch.equal(pg(x), eager(x))


def test_an_envoys_missing_container_op_names_the_node_path():
    torch.manual_seed(0)
    model = Root()
    x = torch.randn(2, 3)
    wrapped = nnbridge.NNsight(model)
    with pytest.raises(AttributeError) as error:
        with wrapped.trace(x):
            wrapped.pair.add.output.save()
    message = str(error.value)
    assert "model.pair (Pair) has no entry 'add'" in message
    assert "PatchableGraph reaches them by NodePath ('pair.add'" in message
