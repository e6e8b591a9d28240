"""Torch hooks on ``pg.op_point(...)`` act on every call structure, as patches do: a later
extraction (an input that requires grad, another size) uses the same op point for the same
NodePath. Before, a hook stopped firing once a call took a new structure, silently."""

import torch
from torch import nn

from nnbridge import PatchableGraph


def _made():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()


def _zero_hook(module, args, output):
    return torch.zeros_like(output)


def _calls():
    x = torch.randn(2, 4)
    return [x, x.clone().requires_grad_(), torch.randn(5, 4)]


def test_a_hook_registered_first_acts_on_later_extractions():
    model = _made()
    pg = PatchableGraph(model, torch.randn(2, 4))
    handle = pg.op_point("1.output").register_forward_hook(_zero_hook)
    reference = _made()
    reference[1].register_forward_hook(_zero_hook)
    for x in _calls():
        assert torch.equal(pg(x), reference(x))
    assert len(pg.extractions) == 2, "requires_grad extracts again; the new size reuses a dynamic graph"
    handle.remove()
    for x in _calls():
        assert torch.equal(pg(x), _made()(x)), "removed from every extraction"


def test_a_hook_registered_after_new_extractions_acts_on_them():
    model = _made()
    pg = PatchableGraph(model, torch.randn(2, 4))
    for x in _calls():
        pg(x)
    seen = []
    pg.op_point("0.linear").register_forward_hook(lambda m, a, o: seen.append(tuple(o.shape)))
    for x in _calls():
        pg(x)
    assert seen == [(2, 4), (2, 4), (5, 4)]
