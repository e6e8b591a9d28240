"""nnsight 0.8.1 parity (issue 12): trace bodies from nnsight's own tests (tests/test_lm.py,
test_tiny.py, test_envoys.py, re-written here) give equal values under nnsight and nnbridge."""

import nnsight
import pytest
import torch

import nnbridge
from test_envoys import PROMPTS, head, layer, wrap
from utils import assert_same


# -- .skip() with transformers' default cache (use_cache=True, DynamicCache) ---------------------
def basic_skip(model):
    with model.trace(PROMPTS[0]):
        layer(model, 0).skip(layer(model, 0).input)
        logits = head(model).output.save()
    return logits


def multiple_skips(model):
    with model.trace(PROMPTS[0]):
        layer(model, 0).skip(layer(model, 0).input)
        layer(model, 1).skip(layer(model, 1).input)
        logits = head(model).output.save()
    return logits


def second_layer_skip(model):
    with model.trace(PROMPTS[0]):
        layer(model, 1).skip(layer(model, 1).input)
        logits = head(model).output.save()
    return logits


def batched_skips(model):
    with model.trace() as tracer:
        with tracer.invoke(PROMPTS[0]):
            layer(model, 0).skip(layer(model, 0).input)
            first = head(model).output.save()
        with tracer.invoke(PROMPTS[1]):
            layer(model, 0).skip(layer(model, 0).input)
            second = head(model).output.save()
    return first, second


def skip_after_input_edit(model):
    with model.trace(PROMPTS[0]):
        hidden = layer(model, 0).input
        layer(model, 0).input = hidden * 2
        layer(model, 0).skip(layer(model, 0).input)
        logits = head(model).output.save()
    return logits


SKIPS = [basic_skip, multiple_skips, second_layer_skip, batched_skips, skip_after_input_edit]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("body", SKIPS, ids=lambda b: b.__name__)
def test_skip_with_default_cache_equals_nnsight(kind, body):
    assert_same(body(wrap(nnbridge, kind)), body(wrap(nnsight, kind)))
