"""NodePath parsing and validation: every bad path is reported at once, before the model runs."""

import pytest
import torch

from fixtures.tuple_output_module import TupleOutputModule
from nnbridge import AddPatch, NodePath, NodePathError, PatchableGraph, ZeroPatch
from nnbridge.errors import PatchMapError
from utils import assert_same, forward_spy


@pytest.fixture
def tuple_pg():
    model = TupleOutputModule().eval()
    return model, PatchableGraph(model, torch.ones(3, 2))


def test_parse():
    assert NodePath.parse("linear_0.output") == NodePath(("linear_0", "output"))
    assert NodePath.parse("output|sub_0.sub_1") == NodePath(("output",), ("sub_0", "sub_1"))
    assert str(NodePath.parse("output|logits")) == "output|logits"
    for bad in ["", ".x", "a..b", "a|", "a|b|c", "|a"]:
        with pytest.raises(NodePathError, match="Malformed NodePath"):
            NodePath.parse(bad)
    with pytest.raises(NodePathError, match="must be a string"):
        NodePath.parse(3)


@pytest.mark.parametrize("patch_map, message", [
    ({"linear_2.output": ZeroPatch()}, "'linear_2.output' is not a node. Closest valid NodePaths: \\['linear_1.output'"),
    ({"output": ZeroPatch()}, "'output' is not a leaf.*'output\\|sub_0'"),
    ({"linear_0": ZeroPatch()}, "'linear_0' is a graph, not a node"),
    ({"output|sub_2": ZeroPatch()}, "cannot dig 'sub_2' into 'output'"),
    ({"add|sub_0": ZeroPatch()}, "cannot dig 'sub_0' into 'add'; valid: none"),
    ({"linear_0..output": ZeroPatch()}, "Malformed NodePath"),
])
def test_bad_paths_raise_before_forward(tuple_pg, patch_map, message):
    model, pg = tuple_pg
    with forward_spy(model, pg) as calls:
        with pytest.raises(KeyError, match=message):
            with pg.patch(patch_map):
                pg(torch.ones(3, 2))
    assert calls == []


def test_every_bad_path_is_listed_and_nothing_is_patched(tuple_pg):
    model, pg = tuple_pg
    with pytest.raises(NodePathError) as info:
        with pg.patch({"linear_0.output": ZeroPatch(), "nope": ZeroPatch(), "linear_1.outptu": ZeroPatch()}):
            pass
    message = str(info.value)
    assert "'nope'" in message and "'linear_1.outptu'" in message and "linear_1.output" in message
    x = torch.randn(3, 2)
    assert torch.equal(pg(x)[0], model(x)[0])


@pytest.mark.parametrize("patch_map, message", [
    (["linear_0.output"], "takes a dict"),
    ({"add": lambda v: v}, "must be Patch objects"),
    ({"add": [ZeroPatch(), "zero"]}, "must be Patch objects"),
    ({3: ZeroPatch()}, "keys must be NodePath strings"),
])
def test_invalid_patch_map_types_raise_value_error_like_graphpatch(tuple_pg, patch_map, message):
    """graphpatch raises ValueError for a patch_map of invalid types (KeyError for bad paths)."""
    model, pg = tuple_pg
    with forward_spy(model, pg) as calls:
        with pytest.raises(ValueError, match=message) as info:
            with pg.patch(patch_map):
                pg(torch.ones(3, 2))
    assert calls == [] and isinstance(info.value, (PatchMapError, TypeError))


def test_a_read_only_mapping_and_a_tuple_of_patches_patch_as_a_dict_and_a_list_do(tuple_pg):
    """pg.patch takes any mapping (typed as one, so a ``dict[str, ZeroPatch]`` type-checks: the
    demo's ``site_patches`` is checked by mypy) and a tuple of patches as a list."""
    import types

    model, pg = tuple_pg
    x = torch.ones(3, 2)
    with torch.no_grad():
        with pg.patch({"linear_0.output": [AddPatch(value=1.0), ZeroPatch()]}):
            as_dict = pg(x)
        with pg.patch(types.MappingProxyType({"linear_0.output": (AddPatch(value=1.0), ZeroPatch())})):
            as_mapping = pg(x)
        plain = pg(x)
    assert_same(as_mapping, as_dict)
    assert not torch.equal(as_dict[0], plain[0])


def test_nnsight_spelling_and_op_point(tuple_pg):
    model, pg = tuple_pg
    point = pg.op_point("linear.0.linear")
    assert point is pg._graph_module.linear[0].op_points["linear"]
    handle = point.register_forward_hook(lambda mod, args, out: out * 0)
    assert torch.equal(pg(torch.ones(3, 2))[0], torch.zeros(3, 3))
    handle.remove()
    assert torch.equal(pg(torch.ones(3, 2))[0], model(torch.ones(3, 2))[0])
