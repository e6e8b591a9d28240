"""A root graph called directly (``extraction.root(x)``, ``pg.extractions[0].root(x)``) checks the
call against its extraction's guards: its graph is specialised to the extracted call, and run on
other sizes it returned wrong values without any error (``x.shape[0]`` baked in)."""

import pytest
import torch
from torch import nn

from nnbridge import NNBridgeError, PatchableGraph
from nnbridge.dispatch.dispatcher import extract


class BatchScaled(nn.Module):
    """Uses the batch size as a number: a graph extracted for batch 1 keeps 1."""

    def forward(self, x):
        return x.reshape(x.shape[0], -1).sum(-1) * x.shape[0]


def test_extract_root_runs_its_own_call_and_refuses_another():
    model, x1, x3 = BatchScaled(), torch.randn(1, 4), torch.randn(3, 4)
    root = extract(model, (x1,), {}).root
    assert torch.equal(root(x1), model(x1))
    with pytest.raises(NNBridgeError, match=r"'BatchScaled' \(BatchScaled\) was extracted for another call "
                                            r"\(tensor 0 has size 3 in dimension 0.*PatchableGraph.*docs/graphpatch.md"):
        root(x3)
    with pytest.raises(NNBridgeError, match="extracted for another call"):
        root(x1, x1)  # another call structure


def test_patchable_graph_roots_refuse_calls_their_dispatcher_would_reextract():
    model, x1, x3 = BatchScaled(), torch.randn(1, 4), torch.randn(3, 4)
    pg = PatchableGraph(model, x1)
    assert torch.equal(pg(x3), model(x3))  # through the dispatcher: a second extraction
    first, second = (e.root for e in pg.extractions)
    assert torch.equal(first(x1), model(x1)) and torch.equal(second(x3), model(x3))
    with pytest.raises(NNBridgeError, match="extracted for another call"):
        first(x3)
    with pytest.raises(NNBridgeError, match="extracted for another call"):
        second(x1)


def test_a_refused_call_leaves_nothing_changed():
    model, x1 = BatchScaled(), torch.randn(1, 4)
    pg = PatchableGraph(model, x1)
    with pytest.raises(NNBridgeError):
        pg.extractions[0].root(torch.randn(2, 4))
    assert len(pg.extractions) == 1
    assert torch.equal(pg(x1), model(x1))
