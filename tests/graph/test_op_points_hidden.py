"""An export of a module that is already bridged (a new call structure) runs on the module tree the
user built: the op points a bridge registered are out of every ``_modules`` for the duration of
torch.export, and back afterwards, each registry the same dict in the same order
(``nnbridge.graph.module_tree.op_points_hidden``)."""

import copy

import pytest
import torch

import nnbridge
from nnbridge.graph.module_tree import op_points_hidden
from nnbridge.graph.op_point import OpPoint, OpPointContainer
from utils import assert_same, gpt2, llama

POINTS = (OpPoint, OpPointContainer)


def registries(model):
    """``[(module, its _modules dict, its items)]`` of every module (op points included)."""
    return [(m, m._modules, list(m._modules.items())) for m in model.modules()]


def op_points(model):
    return [m for m in model.modules() if isinstance(m, POINTS)]


def assert_registrations_kept(before):
    """Each registry is the dict it was, and starts with the entries it had, in order (op points an
    extraction adds afterwards come after them)."""
    for module, registry, items in before:
        assert module._modules is registry
        assert list(registry.items())[:len(items)] == items


@pytest.mark.no_extraction_cache  # the exports are what is looked at
@pytest.mark.parametrize("make", [gpt2, llama])
def test_a_new_call_structure_is_exported_without_op_points_and_they_are_back_in_place_after(make, monkeypatch):
    eager = make()
    model = copy.deepcopy(eager)
    ids = torch.tensor([[1, 5, 7, 2, 9]])
    nnbridge.bridge(model, ids)
    assert len(op_points(model)) > 100
    before = registries(model)

    seen = []  # (modules, op points) in the tree of each module torch.export is given
    export = torch.export.export

    def spy(root, *args, **kwargs):
        seen.append((len(list(root.modules())), len(op_points(root))))
        return export(root, *args, **kwargs)
    monkeypatch.setattr(torch.export, "export", spy)
    with torch.no_grad():
        out = model(ids, output_attentions=True)
        expected = eager(ids, output_attentions=True)
    assert len(seen) > 1 and all(modules > 1 and points == 0 for modules, points in seen), seen
    assert_same(out.logits, expected.logits)
    assert_same(out.attentions, expected.attentions)
    assert_same(out.past_key_values, expected.past_key_values)
    assert_registrations_kept(before)
    monkeypatch.setattr(torch.export, "export", export)

    # the op points of the first call structure (bridge()'s, in grad mode) still serve it: a hook
    # on one acts on its graph's value, and no export runs
    point = model.lm_head.linear  # the op point of lm_head's aten.linear
    handle = point.register_forward_hook(lambda module, inputs, output: output * 2)
    exports = []
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(a) or export(*a, **k))
    try:
        doubled = model(ids).logits
    finally:
        handle.remove()
    assert torch.equal(doubled, eager(ids).logits * 2)
    assert torch.equal(model(ids).logits, eager(ids).logits)
    assert exports == []


def test_op_points_hidden_takes_every_op_point_out_and_restores_each_registry_in_place_also_on_error():
    model = gpt2()
    ids = torch.tensor([[1, 5, 7]])
    nnbridge.bridge(model, ids, use_cache=False)
    points = op_points(model)
    assert points
    before = registries(model)
    real = [(m, list(m._modules.items())) for m in model.modules() if not isinstance(m, POINTS)]

    with pytest.raises(RuntimeError, match="inside"):
        with op_points_hidden(model):
            assert op_points(model) == []
            # the real modules keep their children, in order
            for module, items in real:
                assert list(module._modules.items()) == [(k, v) for k, v in items if not isinstance(v, POINTS)]
            raise RuntimeError("inside")
    for module, registry, items in before:
        assert module._modules is registry
        assert list(registry.items()) == items
    assert op_points(model) == points


def test_op_points_hidden_keeps_a_child_registered_meanwhile_after_the_restored_entries():
    model = gpt2()
    ids = torch.tensor([[1, 5, 7]])
    nnbridge.bridge(model, ids, use_cache=False)
    block = model.transformer.h[0]
    items = list(block._modules.items())
    added = torch.nn.Identity()
    with op_points_hidden(model):
        block.add_module("added_meanwhile", added)
    assert list(block._modules.items()) == [*items, ("added_meanwhile", added)]


class Holder(torch.nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return torch.relu(self.linear(x))


class SharedUnderTwoParents(torch.nn.Module):
    """One Linear held by two parents and called through both: the module walk meets its registry
    under each."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        linear = torch.nn.Linear(4, 4)
        self.first, self.second = Holder(linear), Holder(linear)

    def forward(self, x):
        return self.second(self.first(x))


def test_a_module_under_two_parents_has_its_op_points_hidden_once_and_a_new_call_structure_equals_eager():
    eager = SharedUnderTwoParents()
    model = copy.deepcopy(eager)
    nnbridge.bridge(model, torch.randn(2, 4))
    assert op_points(model.first.linear)
    before = registries(model)
    with op_points_hidden(model):
        assert op_points(model) == []
    for module, registry, items in before:
        assert module._modules is registry
        assert list(registry.items()) == items

    x = torch.randn(2, 3, 4)  # another rank: a new call structure, exported with the op points in place
    assert torch.equal(model(x), eager(x))
    assert_registrations_kept(before)
