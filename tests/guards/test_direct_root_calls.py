"""A root graph called directly (``extraction.root(x)``, ``pg.extractions[0].root(x)``) runs a call
it was not extracted for through a graph extracted for that call, as graphpatch's ``extract()``
graphs ran any call: its graph is specialised to the extracted call, and run on other sizes it
returned wrong values without any error (``x.shape[0]`` baked in)."""

import pytest
import torch
from torch import nn

from nnbridge import AddPatch, PatchableGraph
from nnbridge.dispatch.dispatcher import extract


class BatchScaled(nn.Module):
    """Uses the batch size as a number: a graph extracted for batch 1 keeps 1."""

    def forward(self, x, scale=None):
        out = x.reshape(x.shape[0], -1).sum(-1) * x.shape[0]
        return out if scale is None else out * scale


def test_extract_root_runs_its_own_call_and_extracts_for_another():
    model, x1, x3 = BatchScaled(), torch.randn(1, 4), torch.randn(3, 4)
    root = extract(model, (x1,), {}).root
    assert torch.equal(root(x1), model(x1))
    assert torch.equal(root(x3), model(x3))  # batch 3, not 1, as the multiplier
    assert torch.equal(root(x1, torch.tensor(2.0)), model(x1, torch.tensor(2.0)))  # another call structure
    assert torch.equal(root(x1), model(x1))


def test_patchable_graph_roots_run_other_calls_through_its_dispatcher_with_its_patches():
    model, x1, x3 = BatchScaled(), torch.randn(1, 4), torch.randn(3, 4)
    pg = PatchableGraph(model, x1)
    first = pg.extractions[0].root
    assert torch.equal(first(x3), model(x3))
    assert len(pg.extractions) == 2  # the dispatcher's second extraction, which pg(x3) now reuses
    second = pg.extractions[1].root
    assert torch.equal(second(x1), model(x1)) and torch.equal(pg(x3), model(x3))
    with pg.patch({"output": AddPatch(value=1.0)}):
        assert torch.equal(first(x3), model(x3) + 1)
    assert len(pg.extractions) == 2
