"""A Python attribute of an opaque module (graphpatch 0.2.3's GraphBreakModule ``shadowed_class_var``,
a node there) is no node in nnbridge: ``pg.patch`` and ``pg.graph`` say so and name the migration, and
the migration (setting the attribute for the call) gives the eager module's output."""

import pytest
import torch
from torch.nn import Linear, Module

from nnbridge import AddPatch, ExtractionOptions, NodePathError, PatchableGraph, ZeroPatch


class Attributes(Module):
    bar = 5
    shadowed_class_var = 1

    def __init__(self):
        super().__init__()
        self.linear = Linear(3, 3)
        self.shadowed_class_var = 8
        self.register_buffer("scale", torch.full((3,), 2.0))

    def forward(self, x):
        return self.linear(x) * self.scale + self.bar + self.shadowed_class_var


def _pg():
    torch.manual_seed(0)
    model = Attributes()
    x = torch.randn(2, 3)
    return model, x, PatchableGraph(model, ExtractionOptions(skip_compilation=True), x)


@pytest.mark.parametrize("name, kind", [("shadowed_class_var", "int"), ("bar", "int")])
def test_patching_an_attribute_names_it_and_the_migration(name, kind):
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
    assert torch.equal(patched, model.linear(x) * 3.0 + 5 + 8)
