"""``pg.patch`` with a NodePath that is no node says why (issue 51): the module runs eagerly (the
recorded reason, the fix), the attention implementation has no such op (``attn_implementation``),
or the closest valid NodePaths; the same explanation as envoys and ``get_submodule``."""

from __future__ import annotations

import pytest
import torch

from nnbridge import ExtractionOptions, NodePathError, PatchableGraph, ZeroPatch
from fixtures.data_dependent_module import DataDependentModule
from utils import falls_back, gpt2

IDS = torch.randint(0, 100, (1, 6))


def _error(pg, path) -> str:
    with pytest.raises(NodePathError) as raised:
        with pg.patch({path: ZeroPatch()}):
            pass
    return str(raised.value)


def test_sdpa_attention_names_its_implementation():
    pg = PatchableGraph(gpt2("sdpa"), IDS)
    for name in ("softmax", "matmul", "dropout", "sofmax"):
        text = _error(pg, f"transformer.h_0.attn.{name}")
        assert f"'transformer.h_0.attn.{name}' is not a node: transformer.h_0.attn (GPT2Attention) computes attention" \
               " with attn_implementation='sdpa', one fused call ('scaled_dot_product_attention')" in text
        assert 'from_pretrained(..., attn_implementation="eager")' in text


def test_eager_attention_typo_gets_the_closest_node_paths():
    pg = PatchableGraph(gpt2("eager"), IDS)
    text = _error(pg, "transformer.h_0.attn.sofmax")
    assert "is not a node. Closest valid NodePaths: ['transformer.h_0.attn.softmax'" in text
    assert "attn_implementation" not in text


def test_opaque_module_gives_the_recorded_reason_and_the_fix():
    x = torch.randn(2, 3)
    with falls_back("branchy"):
        pg = PatchableGraph(DataDependentModule().eval(), x)
    text = _error(pg, "branchy.softmax")
    assert "'branchy.softmax' is not a node: branchy (Branchy) is opaque: it runs eagerly (its graph could not be" \
           " extracted: GuardOnDataDependentSymNode" in text
    assert "nnbridge.explain(model)" in text
    model = gpt2("eager")
    skipped = PatchableGraph(model, IDS, options=ExtractionOptions(
        classes_to_skip_compiling={type(model.transformer.h[0].attn)}))
    text = _error(skipped, "transformer.h_0.attn.softmax")
    assert "transformer.h_0.attn (GPT2Attention) is opaque: it runs eagerly, because its class is in" \
           " ExtractionOptions(classes_to_skip_compiling=...)" in text
