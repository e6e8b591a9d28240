"""Known bug (found while testing offload, not fixed): in opaque mode the example call runs without
grad, so the first call with grad enabled makes new extractions of the children; a patch active
during that call is not applied to them, and the output is the unpatched one. Strict xfail: it
starts failing (XPASS) when the bug is fixed, then remove the marker."""

import pytest
import torch

from nnbridge import ExtractionOptions, PatchableGraph, ZeroPatch
from utils import gpt2


@pytest.mark.xfail(strict=True, reason="patches miss extractions made during the patched call")
def test_patch_applies_on_the_first_call_after_construction():
    model, reference = gpt2(), gpt2()
    ids = torch.randint(1, 100, (2, 6))
    pg = PatchableGraph(model, ExtractionOptions(skip_compilation=True), ids, use_cache=False)
    handle = reference.transformer.h[1].mlp.register_forward_hook(lambda m, a, o: torch.zeros_like(o))
    expected = reference(ids, use_cache=False).logits
    handle.remove()
    with pg.patch({"transformer.h_1.mlp.output": ZeroPatch()}):
        patched = pg(ids, use_cache=False).logits
    assert torch.equal(patched, expected)
