"""graphpatch's spelling of ``*args``/``**kwargs`` elements (``foos|sub_1``, ``bars|a``, from
graphpatch 0.2.3's VarargsModule snapshot) resolves in both extraction modes; nnbridge's compiled
placeholder names (``foos_1``, ``a``) keep working. Patched outputs are compared with the untouched
module fed the patched inputs."""

import pytest
import torch
from torch.nn import Linear, Module

from nnbridge import AddPatch, ExtractionOptions, NodePathError, PatchableGraph, ZeroPatch


class Varargs(Module):
    def __init__(self):
        super().__init__()
        self.linear = Linear(3, 3)

    def forward(self, x, *foos, blah=3, **bars):
        result = self.linear(x)
        for f in foos:
            result = result + f
        result = self.linear(result + blah)
        for v in bars.values():
            result = result * v
        return result


class Outer(Module):
    """The variadic module as a child, called with two positional extras and one keyword."""

    def __init__(self):
        super().__init__()
        self.inner = Varargs()

    def forward(self, x, y):
        return self.inner(x, y, x * 2, gain=y + 1)


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(3, 3) for _ in range(6)]


MODES = pytest.mark.parametrize("skip_compilation", [False, True], ids=["compiled", "opaque"])


@MODES
def test_graphpatch_spelling_patches_the_element(skip_compilation):
    torch.manual_seed(0)
    model = Varargs()
    x, f0, f1, f2, a, b = _inputs()
    pg = PatchableGraph(model, ExtractionOptions(skip_compilation=skip_compilation), x, f0, f1, f2, a=a, b=b)
    assert torch.equal(pg(x, f0, f1, f2, a=a, b=b), model(x, f0, f1, f2, a=a, b=b))
    with pg.patch({"foos|sub_1": ZeroPatch(), "bars|a": AddPatch(value=torch.ones(3, 3))}):
        patched = pg(x, f0, f1, f2, a=a, b=b)
    assert torch.equal(patched, model(x, f0, torch.zeros(3, 3), f2, a=a + 1, b=b))
    assert not torch.equal(patched, model(x, f0, f1, f2, a=a, b=b))


def test_compiled_placeholder_names_still_work_and_equal_graphpatch_spelling():
    torch.manual_seed(0)
    model = Varargs()
    x, f0, f1, f2, a, b = _inputs()
    pg = PatchableGraph(model, x, f0, f1, f2, a=a, b=b)
    assert {"foos_0", "foos_1", "foos_2", "a", "b"} <= set(pg.graph.keys())
    with pg.patch({"foos_2": ZeroPatch(), "b": ZeroPatch()}):
        old = pg(x, f0, f1, f2, a=a, b=b)
    with pg.patch({"foos|sub_2": ZeroPatch(), "bars|b": ZeroPatch()}):
        new = pg(x, f0, f1, f2, a=a, b=b)
    assert torch.equal(old, new)
    assert torch.equal(new, model(x, f0, f1, torch.zeros(3, 3), a=a, b=torch.zeros(3, 3)))


@MODES
def test_nested_variadic_child(skip_compilation):
    torch.manual_seed(0)
    model = Outer()
    x, y = _inputs()[:2]
    pg = PatchableGraph(model, ExtractionOptions(skip_compilation=skip_compilation), x, y)
    with pg.patch({"inner.foos|sub_0": ZeroPatch(), "inner.bars|gain": ZeroPatch()}):
        patched = pg(x, y)
    assert torch.equal(patched, model.inner(x, torch.zeros(3, 3), x * 2, gain=torch.zeros(3, 3)))


@MODES
def test_graphpatch_attribute_spelling_views_the_elements(skip_compilation):
    """``pg.graph.foos.sub_1`` / ``pg.graph.bars.a`` (graphpatch's attribute spelling) name the same
    elements as ``foos|sub_1`` / ``bars|a``, with their shapes."""
    torch.manual_seed(0)
    model = Varargs()
    x, f0, f1, f2, a, b = _inputs()
    pg = PatchableGraph(model, ExtractionOptions(skip_compilation=skip_compilation), x, f0, f1, f2, a=a, b=b)
    assert pg.graph.foos.sub_1._shape == torch.Size([3, 3]) and pg.graph.bars.a._shape == torch.Size([3, 3])
    assert len(pg.graph.foos._shape) == 3 and sorted(pg.graph.bars._shape.unwrap()) == ["a", "b"]
    with pg.patch({pg.graph.foos.sub_1: ZeroPatch(), pg.graph.bars.a: AddPatch(value=torch.ones(3, 3))}):
        patched = pg(x, f0, f1, f2, a=a, b=b)
    assert torch.equal(patched, model(x, f0, torch.zeros(3, 3), f2, a=a + 1, b=b))
    with pytest.raises(AttributeError, match="sub_3"):
        pg.graph.foos.sub_3
    if not skip_compilation:
        with pytest.raises(AttributeError, match="blah"):
            pg.graph.blah  # a keyword argument left at its default is no node of a compiled graph


@pytest.mark.parametrize("path", ["foos|sub_3", "bars|c", "foos|a", "bars|sub_0", "nope|sub_0"])
def test_bad_variadic_paths_are_reported_and_nothing_is_patched(path):
    torch.manual_seed(0)
    model = Varargs()
    x, f0, f1, f2, a, b = _inputs()
    pg = PatchableGraph(model, x, f0, f1, f2, a=a, b=b)
    with pytest.raises(NodePathError, match=path.replace("|", r"\|")):
        with pg.patch({"foos|sub_0": ZeroPatch(), path: ZeroPatch()}):
            pass
    assert torch.equal(pg(x, f0, f1, f2, a=a, b=b), model(x, f0, f1, f2, a=a, b=b))
