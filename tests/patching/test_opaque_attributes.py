"""An opaque module's Python attributes holding a number, bool or tensor are nodes, as in graphpatch
0.2.3 (its GraphBreakModule's ``shadowed_class_var``): a patch on one sets the patched value for the
module's forward and restores the attribute after, giving the eager module's output with the
attribute set. Class attributes and other values are no nodes: ``pg.patch`` and ``pg.graph`` say so
and name the migration."""

import pytest
import torch
from torch.nn import Linear, Module

from nnbridge import AddPatch, ExtractionOptions, NodePathError, PatchableGraph, ProbePatch, ReplacePatch, ZeroPatch


class Attributes(Module):
    bar = 5
    shadowed_class_var = 1

    def __init__(self):
        super().__init__()
        self.linear = Linear(3, 3)
        self.shadowed_class_var = 8
        self.shift = torch.full((3,), 0.5)  # a plain tensor, no buffer
        self.gated = True
        self.label = "attributes"
        self.register_buffer("scale", torch.full((3,), 2.0))

    def forward(self, x):
        y = self.linear(x) * self.scale + self.bar + self.shadowed_class_var + self.shift
        return y if self.gated else torch.zeros_like(y)


class Counting(Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * self.calls


def _pg(model=None):
    torch.manual_seed(0)
    model = model or Attributes()
    x = torch.randn(2, 3)
    return model, x, PatchableGraph(model, ExtractionOptions(skip_compilation=True), x)


def _eager_with(model, x, **values):
    """The eager module's output with its attributes set to ``values`` for the call."""
    saved = {name: model.__dict__[name] for name in values}
    model.__dict__.update(values)
    try:
        return model(x)
    finally:
        model.__dict__.update(saved)


@pytest.mark.parametrize("name, patch, value", [
    ("shadowed_class_var", AddPatch(value=5), 13),
    ("shift", ZeroPatch(), torch.zeros(3)),
    ("gated", ReplacePatch(value=False), False),
])
def test_an_attribute_is_a_node_and_patches_as_setting_it_for_the_call(name, patch, value):
    model, x, pg = _pg()
    before = model(x)
    original = model.__dict__[name]
    assert name in pg.graph.keys()
    probe = ProbePatch()
    with pg.patch({name: [probe, patch]}):
        patched = pg(x)
    assert torch.equal(torch.as_tensor(probe.activation), torch.as_tensor(original))  # the node's value
    assert torch.equal(patched, _eager_with(model, x, **{name: value}))
    assert not torch.equal(patched, before)
    assert model.__dict__[name] is original  # restored
    assert torch.equal(pg(x), before)


def test_an_instance_attribute_shadowing_a_class_attribute_is_the_instances():
    model, x, pg = _pg()
    with pg.patch({"shadowed_class_var": AddPatch(value=5)}):
        assert torch.equal(pg(x), model(x) + 5)
    assert model.shadowed_class_var == 8 and type(model).shadowed_class_var == 1


def test_an_attribute_the_forward_assigns_keeps_the_forwards_value():
    model, x, pg = _pg(Counting())
    eager = Counting()
    with pg.patch({"calls": AddPatch(value=10)}):
        patched = pg(x)
    assert torch.equal(patched, x * 11)  # the forward read 10, then counted
    assert model.calls == 11  # its own assignment, as eager keeps it
    eager.calls = 10
    assert torch.equal(eager(x), patched) and eager.calls == model.calls


@pytest.mark.parametrize("name, kind", [("bar", "int"), ("label", "str")])
def test_a_class_attribute_or_other_value_names_itself_and_the_migration(name, kind):
    _, x, pg = _pg()
    with pytest.raises(NodePathError, match=rf"'{name}' is a Python attribute of it \({kind}\), not a node.*"
                                            r"graphpatch.md.*Migrate: set the attribute"):
        with pg.patch({name: AddPatch(value=5)}):
            pg(x)
    with pytest.raises(AttributeError, match=rf"'{name}' is a Python attribute of it"):
        getattr(pg.graph, name)


def test_a_name_that_is_no_attribute_keeps_the_opaque_explanation():
    _, x, pg = _pg()
    with pytest.raises(NodePathError) as error:
        with pg.patch({"forward": ZeroPatch()}):  # a method: not an attribute value
            pg(x)
    assert "Python attribute" not in str(error.value) and "is opaque" in str(error.value)


def test_migration_setting_the_attribute_equals_eager():
    model, x, pg = _pg()
    before = model(x)
    assert torch.equal(pg(x), before)
    model.shadowed_class_var = 13
    try:
        patched = pg(x)
        expected = model(x)
    finally:
        model.shadowed_class_var = 8
    assert torch.equal(patched, expected) and torch.equal(patched, before + 5)
    assert torch.equal(pg(x), before)


def test_buffer_is_a_node_and_patches():
    model, x, pg = _pg()
    with pg.patch({"scale": AddPatch(value=torch.ones(3))}):
        patched = pg(x)
    assert torch.equal(patched, model.linear(x) * 3.0 + 5 + 8 + 0.5)
