"""transformers passes no sdpa mask in eager code where a traced call builds one: faithful or loud.

In eager code transformers' ``sdpa_mask`` returns None for an unpadded causal call (SDPA's
``is_causal`` stands for the mask); traced, it builds the explicit mask. transformers' own sdpa
computes the same numbers either way; an attention function registered as ``"sdpa"`` that ignores
``is_causal`` does not, so before this check the bridged model silently attended causally where
eager attended to every position. Every test compares with an untouched copy (``torch.equal``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import nnbridge
from nnbridge import ExtractionOptions, PatchableGraph
from nnbridge.inplace.bridging import bridge_of
from nnbridge.compat.transformers import mask_skips as masks
from nnbridge.errors import ExtractionError

pytestmark = pytest.mark.no_extraction_cache  # every test must export, not be served another's program


def noncausal_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An sdpa attention function that ignores ``is_causal``: it only masks what it is given."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def _opaque(model: torch.nn.Module) -> dict[str, str]:
    reasons: dict[str, str] = {}
    for extraction in bridge_of(model).dispatcher.all_extractions():
        reasons.update(extraction.opaque)
    return reasons


def _stays_one_graph_and_equals_eager(model: LlamaForCausalLM) -> None:
    """Bridged on an unpadded call, ``model.model`` is a graph and the logits equal an untouched copy's."""
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 100, (1, 6))
    nnbridge.bridge(model, ids)
    assert "model" not in _opaque(model)
    assert torch.equal(model(ids).logits, reference(ids).logits)
    nnbridge.unbridge(model)


@pytest.fixture
def replaced(monkeypatch):
    """``noncausal_sdpa`` registered as ``"sdpa"`` for the test (transformers' registry put back after)."""
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", noncausal_sdpa)


def test_replaced_sdpa_makes_the_mask_building_module_opaque_and_equals_eager(replaced):
    model = _llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 100, (1, 6))
    nnbridge.bridge(model, ids)
    reason = _opaque(model)["model"]
    assert "noncausal_sdpa" in reason and "'sdpa'" in reason and "no sdpa mask" in reason
    logits = model(ids).logits
    expected = reference(ids).logits
    assert torch.equal(logits, expected)
    logits.sum().backward()
    expected.sum().backward()
    for (name, param), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(param.grad, ref.grad), name
    nnbridge.unbridge(model)


def test_layers_of_the_opaque_model_stay_patchable(replaced):
    """The decoder layers are extracted from the opaque model's eager calls (no mask, as eager): a
    patch on an op inside attention acts and equals the same change made eagerly."""
    model = _llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 100, (1, 6))
    pg = PatchableGraph(model, ids)
    assert "model" in pg.extractions[0].opaque
    out_proj = "model.layers_1.self_attn.o_proj.output"  # an opaque module names its callees graphpatch-style
    assert out_proj in pg.node_paths()
    with pg.patch({out_proj: nnbridge.ZeroPatch()}):
        patched = pg(ids).logits
    handle = reference.model.layers[1].self_attn.o_proj.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
    expected = reference(ids).logits
    handle.remove()
    assert torch.equal(patched, expected)
    assert torch.equal(pg(ids).logits, reference(ids).logits)


def test_stock_sdpa_is_extracted_as_a_graph():
    """transformers' own sdpa is equal with the explicit mask: the model stays one graph."""
    _stays_one_graph_and_equals_eager(_llama())


def test_padded_call_builds_the_mask_in_eager_too_and_stays_a_graph(replaced):
    """With padding eager builds the mask as well: nothing differs, the model stays one graph."""
    model = _llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 100, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    nnbridge.bridge(model, ids, attention_mask=mask)
    assert "model" not in _opaque(model)
    assert torch.equal(model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits)
    nnbridge.unbridge(model)


def test_function_under_its_own_name_is_extracted_and_equals_eager(monkeypatch):
    """The advised fix: under a name of its own transformers builds no mask, traced or not."""
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "noncausal", noncausal_sdpa)
    model = _llama()
    model.config._attn_implementation = "noncausal"
    _stays_one_graph_and_equals_eager(model)


def test_root_that_builds_the_mask_is_opaque_and_equals_eager(replaced):
    """Bridging the decoder itself (``LlamaModel``): the root falls back to its own code."""
    decoder = _llama().model
    reference = copy.deepcopy(decoder)
    ids = torch.randint(0, 100, (1, 6))
    pg = PatchableGraph(decoder, ids)
    assert "no sdpa mask" in pg.extractions[0].opaque["<root>"]
    assert torch.equal(pg(ids).last_hidden_state, reference(ids).last_hidden_state)


def test_error_option_raises_naming_the_module_the_function_and_the_fix(replaced):
    model = _llama()
    ids = torch.randint(0, 100, (1, 6))
    # (without grad: the rotary embedding's no_grad would be the first failure)
    with pytest.raises(ExtractionError, match=r"(?s)'model'.*noncausal_sdpa.*AttentionInterface\.register"), \
            torch.no_grad():
        nnbridge.bridge(model, ids, options=ExtractionOptions(error_on_compilation_failure=True))
    assert bridge_of(model) is None  # nothing left half-bridged
    assert torch.equal(model(ids).logits, copy.deepcopy(model)(ids).logits)


def test_replaced_sdpa_functions_names_only_a_replaced_function(replaced, monkeypatch):
    model = _llama()
    assert masks.replaced_sdpa_functions(model) == {"sdpa": f"{__name__}.noncausal_sdpa"}
    model.config._attn_implementation = "eager"  # eager's mask builder never skips
    assert masks.replaced_sdpa_functions(model) == {}
    monkeypatch.undo()
    model.config._attn_implementation = "sdpa"
    assert masks.replaced_sdpa_functions(model) == {}


def test_mask_skips_notices_a_skip_and_puts_the_helpers_back_on_error():
    from transformers import masking_utils

    helpers = (masking_utils._ignore_causal_mask_sdpa, masking_utils._ignore_bidirectional_mask_sdpa)
    model = _llama()
    seen: list[None] = []
    with pytest.raises(RuntimeError, match="boom"), masks.mask_skips(lambda: seen.append(None)):
        model(torch.randint(0, 100, (1, 6)))
        raise RuntimeError("boom")
    assert len(seen) == 1  # one mask per forward (the layers share it)
    assert (masking_utils._ignore_causal_mask_sdpa, masking_utils._ignore_bidirectional_mask_sdpa) == helpers
    model(torch.randint(0, 100, (1, 6)))
    assert len(seen) == 1


def test_a_function_registered_with_transformers_register_is_named(monkeypatch):
    """``AttentionInterface.register`` writes transformers' global mapping (the route above writes
    the instance's own): both are what the model's attention reads."""
    monkeypatch.delitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "sdpa", raising=False)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", noncausal_sdpa)
    assert masks.replaced_sdpa_functions(_llama()) == {"sdpa": f"{__name__}.noncausal_sdpa"}
