"""The ``getitem`` nodes that read a child's nested output stand in depth-first order and are numbered
so, as Dynamo numbered them for graphpatch (graphpatch 0.2.3's DeeplyNestedOutputModule ``_code``
snapshot): ``getitem_5`` reads the same element in both. Outputs compared with the eager module."""

import torch
from torch.nn import Linear, Module

from nnbridge import ExtractionOptions, PatchableGraph, ProbePatch


class Child(Module):
    def __init__(self):
        super().__init__()
        self.linear = Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        return ((y,), [([y * 2], y + 1), ([y * 3], y + 2)])


class Parent(Module):
    def __init__(self):
        super().__init__()
        self.child = Child()

    def forward(self, x):
        (a,), pairs = self.child(x)
        return a, [(p[0][0], p[1]) for p in pairs]


def test_child_output_getitems_are_numbered_depth_first():
    torch.manual_seed(0)
    model, x = Parent(), torch.randn(2, 4)
    pg = PatchableGraph(model, ExtractionOptions(error_on_compilation_failure=True), x)
    reads = [(name, node.args[0].name, node.args[1]) for name, node in pg.extractions[0].root.named_nodes()
             if node.op == "call_function" and name.startswith("getitem")]
    assert reads == [
        ("getitem", "child", 0), ("getitem_1", "getitem", 0),
        ("getitem_2", "child", 1),
        ("getitem_3", "getitem_2", 0), ("getitem_4", "getitem_3", 0), ("getitem_5", "getitem_4", 0),
        ("getitem_6", "getitem_3", 1),
        ("getitem_7", "getitem_2", 1), ("getitem_8", "getitem_7", 0), ("getitem_9", "getitem_8", 0),
        ("getitem_10", "getitem_7", 1),
    ]
    assert pg.graph.output._code == "return (getitem_1, [(getitem_5, getitem_6), (getitem_9, getitem_10)])"
    expected = model(x)
    probe = ProbePatch()
    with pg.patch({"getitem_9": probe}):
        got = pg(x)
    assert torch.equal(probe.activation, expected[1][1][0])
    assert torch.equal(got[0], expected[0])
    assert all(torch.equal(g, e) for gp, ep in zip(got[1], expected[1]) for g, e in zip(gp, ep))
