"""nnbridge's exports run without torch's fake-tensor dispatch cache (``nnbridge.compat.torch.fake_tensors``):
no entry is looked up or made while extracting, the setting is restored afterwards (also when the
body raises), and the bridged model equals eager."""

import copy

import pytest
import torch
import torch._dynamo.config as dynamo_config
from torch._subclasses.fake_tensor import FakeTensorMode

import nnbridge
from nnbridge.compat.torch.fake_tensors import fake_tensor_cache_off
from utils import assert_same, llama

pytestmark = pytest.mark.no_extraction_cache  # the extraction must export, not load a cached program


def test_extraction_uses_no_fake_tensor_cache_and_equals_eager(monkeypatch):
    exports = []
    real_export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(1) or real_export(*a, **k))
    model = llama()
    eager = copy.deepcopy(model)
    ids = torch.randint(1, 100, (1, 6))
    before = (FakeTensorMode.cache_hits, FakeTensorMode.cache_misses, dict(FakeTensorMode.cache_bypasses))
    nnbridge.bridge(model, ids)
    assert (FakeTensorMode.cache_hits, FakeTensorMode.cache_misses, dict(FakeTensorMode.cache_bypasses)) == before
    assert exports, "the extraction exported"
    assert dynamo_config.fake_tensor_cache_enabled, "torch's setting is back after the extraction"
    assert_same(model(ids).logits, eager(ids).logits)


def test_setting_is_restored_also_on_error():
    assert dynamo_config.fake_tensor_cache_enabled
    with pytest.raises(RuntimeError, match="inside"):
        with fake_tensor_cache_off():
            assert not dynamo_config.fake_tensor_cache_enabled
            raise RuntimeError("inside")
    assert dynamo_config.fake_tensor_cache_enabled
