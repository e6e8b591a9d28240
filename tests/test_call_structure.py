"""One extraction per call structure; other structures are extracted again, never run wrongly."""

import torch

from fixtures.minimal_module import MinimalModule
from nnbridge import PatchableGraph, ZeroPatch
from nnbridge.bridge.call_structure import ShapeGuard
from utils import PastPlusNew, assert_same, gpt2, padded_batch, past_plus_new


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


def test_a_size_derived_from_another_stays_dynamic():
    """The mask's length is ``s + 1``: one extraction serves every past length (it was specialised to
    the example's, so each decode step extracted again), and a mask of another length is refused."""
    model = PastPlusNew()
    pg = PatchableGraph(model, *past_plus_new(5))
    guard = pg.extractions[0].guard
    assert guard.dims[2][1][3:] == (1, 1)  # (symbol, low, high, coefficient 1, offset 1)
    assert guard.dims[2][1][0] == guard.dims[0][1][0]
    for length in (3, 9, 17):
        inputs = past_plus_new(length)
        assert torch.equal(pg(*inputs), model(*inputs))
    assert len(pg.extractions) == 1
    wrong = past_plus_new(5, mask_length=7)
    assert not guard.matches(list(wrong), (wrong, {}))
    assert "(1 + L['args'][0].size()[1]) == L['args'][2].size()[1]" in guard.failed(list(wrong), (wrong, {}))


def test_a_derived_dimension_binds_its_symbol_when_no_plain_one_does():
    """``2 * s + 1`` alone: a size gives ``s`` when it is of that form and ``s`` in its range."""
    guard = ShapeGuard([[("s", 2, 10, 2, 1)], [("s", 2, 10, 2, 1)]])
    assert guard.matches([torch.empty(7), torch.empty(7)])          # s = 3
    assert not guard.matches([torch.empty(7), torch.empty(9)])      # s = 3, then 4
    assert not guard.matches([torch.empty(6), torch.empty(6)])      # not 2 * s + 1
    assert not guard.matches([torch.empty(3), torch.empty(3)])      # s = 1 < 2
    assert not guard.matches([torch.empty(23), torch.empty(23)])    # s = 11 > 10
    plain_first = ShapeGuard([[("s", 2, None, 1, 1)], [("s", 2, None)]])
    assert plain_first.matches([torch.empty(6), torch.empty(5)])
    assert not plain_first.matches([torch.empty(5), torch.empty(5)])
