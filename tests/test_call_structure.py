"""One extraction per call structure; other structures are extracted again, never run wrongly."""

import torch

from fixtures.minimal_module import MinimalModule
from nnbridge import PatchableGraph, ZeroPatch
from utils import assert_same, gpt2, padded_batch


def test_new_kwargs_and_values_are_extracted_again_and_cached():
    model = gpt2()
    ids, mask = padded_batch(6)
    pg = PatchableGraph(model, ids, attention_mask=mask)
    assert len(pg.extractions) == 1
    assert_same(pg(ids), model(ids))  # no attention_mask: another structure
    assert len(pg.extractions) == 2
    assert_same(pg(ids, attention_mask=mask, use_cache=False), model(ids, attention_mask=mask, use_cache=False))
    assert len(pg.extractions) == 3
    assert_same(pg(ids), model(ids))
    assert len(pg.extractions) == 3, "same structure reuses the cached extraction"


def test_sizes_outside_the_dynamic_range_are_extracted_again():
    model = gpt2()
    ids, mask = padded_batch(6)
    pg = PatchableGraph(model, ids, attention_mask=mask)
    one_token, one_mask = ids[:, :1], mask[:, -1:]
    assert not pg.extractions[0].guard.matches([one_token, one_mask])
    assert_same(pg(one_token, attention_mask=one_mask), model(one_token, attention_mask=one_mask))
    assert len(pg.extractions) == 2


def test_batch_of_one_example_is_static_in_batch():
    model = MinimalModule().eval()
    pg = PatchableGraph(model, torch.randn(1, 3))
    assert pg.extractions[0].guard.dims[0][0] == 1
    x = torch.randn(5, 3)
    assert_same(pg(x), model(x))
    assert len(pg.extractions) == 2


def test_active_patches_apply_to_new_extractions():
    model = MinimalModule().eval()
    x = torch.randn(4, 3)
    pg = PatchableGraph(model, x)
    with pg.patch({"linear.output": ZeroPatch()}):
        assert torch.equal(pg(x.double().float()), torch.zeros(4, 2))
        assert torch.equal(pg(x[0]), torch.zeros(2))  # rank 1: a new extraction, patched too
    assert len(pg.extractions) == 2
    assert torch.equal(pg(x[0]), model(x[0]))
