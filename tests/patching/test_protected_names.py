"""Nodes named ``_shape``/``_code`` (``pg.graph``'s own attributes) are known as graphpatch names them
(``sub_shape``, numbered when taken: ``sub_shape_1``), in both extraction modes, from graphpatch 0.2.3's
ProtectedNameModule; the module is still called by its argument names. Patched outputs are compared
with the untouched module fed the patched inputs."""

import pytest
import torch
from torch.nn import Linear, Module

from nnbridge import AddPatch, ExtractionOptions, NodePathError, PatchableGraph, ProbePatch
from nnbridge.graph.node_path import unprotected_names


class ProtectedName(Module):
    _shape = (2, 3)

    def __init__(self):
        super().__init__()
        self._code = Linear(*ProtectedName._shape)

    def forward(self, _shape, _code=5, sub_shape=7):
        return self._code(_shape + _code + self._shape[0] + sub_shape)


MODES = pytest.mark.parametrize("skip_compilation", [False, True], ids=["compiled", "opaque"])


def _pg(skip_compilation):
    torch.manual_seed(0)
    model = ProtectedName()
    x = torch.randn(3, 2)
    options = ExtractionOptions(skip_compilation=skip_compilation, error_on_compilation_failure=True)
    return model, x, PatchableGraph(model, options, x)


def test_rule_renames_only_protected_names_and_numbers_taken_ones():
    assert unprotected_names(["_shape", "_code", "sub_shape", "add"]) == ["sub_shape_1", "sub_code", "sub_shape", "add"]
    assert unprotected_names(["_shape", "sub_shape", "sub_shape_1"]) == ["sub_shape_2", "sub_shape", "sub_shape_1"]
    assert unprotected_names(["x", "_code_", "output"]) == ["x", "_code_", "output"]


@MODES
def test_inspection_attributes_are_not_shadowed(skip_compilation):
    _, _, pg = _pg(skip_compilation)
    assert isinstance(pg.graph._code, str)
    assert repr(pg.graph._shape).startswith("<root>:")
    assert "_shape" not in pg.graph and "_code" not in pg.graph
    assert "_code_" in pg.graph  # the child module called _code (a GraphModule attribute): trailing _
    expected = "sub_shape_1" if skip_compilation else "sub_shape"  # export keeps no defaulted sub_shape
    assert pg.graph[expected]._shape == torch.Size([3, 2])
    if skip_compilation:
        assert {"sub_code", "sub_shape"} <= set(pg.graph.keys())


@MODES
def test_renamed_argument_patches_and_keyword_calls_still_bind(skip_compilation):
    model, x, pg = _pg(skip_compilation)
    name = "sub_shape_1" if skip_compilation else "sub_shape"
    assert torch.equal(pg(x), model(x))
    assert torch.equal(pg(_shape=x), model(_shape=x))
    probe = ProbePatch()
    with pg.patch({name: [probe, AddPatch(value=torch.ones(3, 2))]}):
        patched = pg(_shape=x)
    assert torch.equal(probe.activation, x)
    assert torch.equal(patched, model(x + 1))
    assert not torch.equal(patched, model(x))


def test_opaque_renamed_default_argument_patches():
    model, x, pg = _pg(True)
    with pg.patch({"sub_code": AddPatch(value=2), "sub_shape": AddPatch(value=1)}):
        patched = pg(x, 5, sub_shape=7)
    assert torch.equal(patched, model(x, 7, sub_shape=8))


@MODES
def test_protected_name_is_a_bad_path_naming_the_renamed_one(skip_compilation):
    _, x, pg = _pg(skip_compilation)
    with pytest.raises(NodePathError, match="known by .sub_shape.* such nodes: .*sub_shape"):
        with pg.patch({"_shape": AddPatch(value=1)}):
            pg(x)


def test_opaque_default_argument_holds_its_default_and_patches():
    model, x, pg = _pg(True)
    assert "├─sub_code: int" in repr(pg.graph) and "├─sub_shape: int" in repr(pg.graph)
    probe = ProbePatch()
    with pg.patch({"sub_code": probe}):
        assert torch.equal(pg(x), model(x))
    assert probe.activation == 5
    with pg.patch({"sub_code": AddPatch(value=2)}):  # left at its default: the patched default is passed
        patched = pg(x)
    assert torch.equal(patched, model(x, 7)) and not torch.equal(patched, model(x))
