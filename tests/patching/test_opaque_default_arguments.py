"""An opaque module's argument the call left at its default is a node holding the default (as
graphpatch's opaque placeholder): a patch on it applies, an observation passes nothing extra."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn import Module

from nnbridge import AddPatch, ExtractionOptions, PatchableGraph, ProbePatch
from nnbridge.errors import PatchError

OPAQUE = ExtractionOptions(skip_compilation=True)


class Scaled(Module):
    def forward(self, x, k=5):
        return x * k


def test_a_patch_on_a_defaulted_argument_applies():
    model, x = Scaled(), torch.randn(2, 2)
    pg = PatchableGraph(model, OPAQUE, x)
    probe = ProbePatch()
    with pg.patch({"k": probe}):
        assert torch.equal(pg(x), model(x))
    assert probe.activation == 5
    with pg.patch({"k": AddPatch(value=2)}):
        patched = pg(x)
    assert torch.equal(patched, model(x, 7)) and not torch.equal(patched, model(x))
    assert torch.equal(pg(x), model(x))


class KeywordSpy(Module):
    """Records the keywords its forward receives (as transformers' forward decorators read them)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x, scale=3):
        return x * scale


def _spied(forward):
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        self.seen.append(sorted(kwargs))
        return forward(self, *args, **kwargs)
    return wrapper


KeywordSpy.forward = _spied(KeywordSpy.forward)


def test_an_observed_default_is_not_passed_and_a_patched_one_is():
    model, x = KeywordSpy(), torch.randn(2, 2)
    pg = PatchableGraph(model, OPAQUE, x)
    model.seen.clear()
    probe = ProbePatch()
    with pg.patch({"scale": probe}):
        pg(x)
    assert model.seen == [[]] and probe.activation == 3
    with pg.patch({"scale": AddPatch(value=1)}):
        patched = pg(x)
    assert model.seen[-1] == ["scale"] and torch.equal(patched, x * 4)


class PositionalOnlyDefault(Module):
    def forward(self, x, k=5, /):
        return x + k


def test_patching_a_positional_only_default_left_out_raises():
    model, x = PositionalOnlyDefault(), torch.randn(2, 2)
    pg = PatchableGraph(model, OPAQUE, x)
    with pytest.raises(PatchError, match="'k' of PositionalOnlyDefault.forward: it is positional-only.*Pass it"):
        with pg.patch({"k": AddPatch(value=1)}):
            pg(x)
    with pg.patch({"k": AddPatch(value=1)}):  # passed in the call: patched as any argument
        assert torch.equal(pg(x, 5), model(x, 6))
    assert torch.equal(pg(x), model(x))
