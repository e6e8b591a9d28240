"""Seed 000/001's TupleOutputModule: the tree, the code, independent invocation patches."""

import pytest
import torch

from fixtures.tuple_output_module import TupleOutputModule
from nnbridge import AddPatch, CompiledGraphModule, MultiplyInvokedModule, PatchableGraph, ZeroPatch

EXPECTED_TREE = """\
<root>: CompiledGraphModule
├─x: Tensor(3, 2)
├─linear_0: CompiledGraphModule
│ ├─input: Tensor(3, 2)
│ ├─weight: Tensor(3, 2)
│ ├─bias: Tensor(3)
│ ├─linear: Tensor(3, 3)
│ └─output: Tensor(3, 3)
├─add: Tensor(3, 2)
├─linear_1: CompiledGraphModule
│ ├─input: Tensor(3, 2)
│ ├─weight: Tensor(3, 2)
│ ├─bias: Tensor(3)
│ ├─linear: Tensor(3, 3)
│ └─output: Tensor(3, 3)
└─output: tuple(2)
  ├─sub_0: Tensor(3, 3)
  └─sub_1: Tensor(3, 3)"""


def make():
    model = TupleOutputModule().eval()
    return model, PatchableGraph(model, torch.ones(3, 2))


def test_tree_matches_graphpatch_docs():
    _, pg = make()
    assert repr(pg.graph) == EXPECTED_TREE
    assert repr(pg.graph.linear_0) == "\n".join(
        ["linear_0: CompiledGraphModule"] + [line[2:] for line in EXPECTED_TREE.splitlines()[3:8]])


def test_hierarchy_kinds():
    model, pg = make()
    root = pg._graph_module
    assert isinstance(root, CompiledGraphModule)
    assert isinstance(root.linear, MultiplyInvokedModule) and isinstance(root.linear, torch.nn.ModuleList)
    assert len(root.linear) == 2 and all(isinstance(g, CompiledGraphModule) for g in root.linear)
    for graph_module in (root, *root.linear):
        graph_module.graph.lint()
    assert root.linear[0].weight is model.linear.weight and root.linear[1].bias is model.linear.bias


def test_code_like_graphpatch():
    _, pg = make()
    assert pg.graph._code.strip() == (
        "def forward(self, x):\n"
        '    linear_0 = getattr(self.linear, "0")(x)\n'
        "    add = torch.ops.aten.add.Tensor(x, 1);  x = None\n"
        '    linear_1 = getattr(self.linear, "1")(add);  add = None\n'
        "    return (linear_0, linear_1)")
    add_code = pg.graph.add._code
    assert add_code.splitlines()[0].strip().startswith('File "') and "tuple_output_module.py" in add_code
    assert add_code.splitlines()[1].strip() == "return (self.linear(x), self.linear(x + 1))"
    linear_code = pg.graph.linear_0._code
    assert linear_code.startswith("Calling context:\n")
    assert "return (self.linear(x), self.linear(x + 1))" in linear_code.split("Compiled code:")[0]
    assert "torch.ops.aten.linear.default(input_1, weight, bias)" in linear_code.split("Compiled code:")[1]
    assert "F.linear(input, self.weight, self.bias)" in pg.graph.linear_0.linear._code


def test_shapes():
    _, pg = make()
    assert pg.graph.linear_0.input._shape == torch.Size([3, 2])
    assert pg.graph.output.sub_1._shape == torch.Size([3, 3])
    # a graph's _shape is its shape tree (graphpatch's pg.graph._shape.linear_0.input)
    assert pg.graph.linear_0._shape.input == pg.graph._shape.linear_0.input == torch.Size([3, 2])
    assert pg.graph._shape.output.sub_1 == torch.Size([3, 3])
    assert "linear_0" in dir(pg.graph._shape)
    assert {"input", "weight", "bias", "linear", "output", "_code", "_shape"} <= set(dir(pg.graph.linear_0))


def test_invocations_patch_independently():
    model, pg = make()
    x = torch.randn(3, 2)
    first, second = model(x)
    with pg.patch({"linear_0.output": [AddPatch(value=torch.ones((1,)))], "linear_1.output": [ZeroPatch()]}):
        patched_first, patched_second = pg(x)
    assert torch.equal(patched_first, first + 1)
    assert torch.equal(patched_second, torch.zeros(3, 3))
    again_first, again_second = pg(x)
    assert torch.equal(again_first, first) and torch.equal(again_second, second)


def test_node_view_is_a_node_path():
    model, pg = make()
    x = torch.randn(3, 2)
    with pg.patch({pg.graph.linear_1.output: ZeroPatch(), pg.graph.output.sub_0: ZeroPatch()}):
        first, second = pg(x)
    assert torch.equal(first, torch.zeros(3, 3)) and torch.equal(second, torch.zeros(3, 3))
    assert str(pg.graph.output.sub_0) == "output|sub_0"


def test_container_shape_like_graphpatch():
    """``_shape`` of a container value is a tree of its entries' shapes (graphpatch's shape tree)."""
    _, pg = make()
    shape = pg.graph.output._shape
    assert shape.sub_0 == torch.Size([3, 3]) and shape[1] == torch.Size([3, 3])
    assert shape == (torch.Size([3, 3]), torch.Size([3, 3])) and shape.unwrap() == (torch.Size([3, 3]),) * 2
    assert len(shape) == 2 and dir(shape) == ["sub_0", "sub_1"]
    assert repr(shape) == "output: tuple(2)\n├─sub_0: torch.Size([3, 3])\n└─sub_1: torch.Size([3, 3])"
    with pytest.raises(AttributeError, match=r"No entry 'sub_2' in the shape of output; entries: \['sub_0', 'sub_1'\]"):
        shape.sub_2


def test_mapping_interface_like_graphpatch():
    """``in``, ``[]``, ``get``, ``keys``, ``len`` on ``pg.graph`` and on any graph below it, as on
    graphpatch's NodePath; a dig may be written with ``|`` or, as graphpatch's keys, with ``.``."""
    _, pg = make()
    assert "linear_0.output" in pg.graph and "output|sub_0" in pg.graph and "output.sub_1" in pg.graph
    assert "linear_2.output" not in pg.graph and "output|sub_2" not in pg.graph and 3 not in pg.graph
    assert "output" in pg.graph.linear_1 and "linear_0.output" not in pg.graph.linear_1
    assert str(pg.graph["linear_1.weight"]) == "linear_1.weight"
    assert pg.graph["linear_1"]["output"]._shape == torch.Size([3, 3])
    assert str(pg.graph["output.sub_1"]) == str(pg.graph["output|sub_1"]) == "output|sub_1"
    assert pg.graph.get("nope") is None and pg.graph.get("nope", 7) == 7
    keys = list(pg.graph)
    assert keys[:5] == ["x", "linear_0", "add", "linear_1", "output"], "breadth first, graph order"
    assert "linear_1.bias" in keys and keys[-2:] == ["output|sub_0", "output|sub_1"]
    assert len(pg.graph) == len(keys) == 17 and bool(pg.graph.x)
    with pg.patch({pg.graph["linear_1.output"]: ZeroPatch()}):
        assert torch.equal(pg(torch.ones(3, 2))[1], torch.zeros(3, 3))
    with pytest.raises(KeyError, match=r"No node 'linear_0.outptu' under <root>; closest: \['linear_0.output'"):
        pg.graph["linear_0.outptu"]
    with pytest.raises(ValueError, match="linear_0.output is a leaf"):
        "x" in pg.graph.linear_0.output


def test_output_code_is_the_return_statement():
    """graphpatch's ``_code`` of an ``output`` node (and of its digs): the return statement."""
    _, pg = make()
    assert pg.graph.output._code == "return (linear_0, linear_1)"
    assert pg.graph.output.sub_1._code == "return (linear_0, linear_1)"
    assert pg.graph.linear_0.output._code == "return linear"
