"""pg.save(path) / PatchableGraph.load(path, model): a loaded PatchableGraph equals
a freshly extracted one (outputs, patches, pg.graph, NodePaths) without running torch.export."""

from __future__ import annotations

import io
import json
import zipfile

import pytest
import torch
from utils import same_tree, PastPlusNew, data_dependent, falls_back, gpt2, llama, no_grad_rotary, past_plus_new

import nnbridge
from nnbridge import OpaqueGraphModule, PatchableGraph, ZeroPatch
from nnbridge.errors import NNBridgeWarning, SaveLoadError

extraction = __import__("nnbridge.dispatch.extraction", fromlist=["export_module"])
torch_file = __import__("nnbridge.patching.torch_file", fromlist=["read_archive"])
saving = __import__("nnbridge.patching.saving", fromlist=["write_archive"])


def _archive(path):
    """The archive inside a pg.save file (see tests/patching/test_save_file.py for the file itself)."""
    return zipfile.ZipFile(io.BytesIO(torch_file.read_archive(path, str(path))))

# saves what a fresh torch.export made, and refuses export during loads: the run's cache must not
# stand in for either
pytestmark = pytest.mark.no_extraction_cache


def _refuse_export(monkeypatch):
    """From now on, fail the test if torch.export runs (a load must not export)."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch.export ran during a load")
    monkeypatch.setattr(extraction, "export_module", refuse)


def _ids():
    return torch.randint(0, 100, (1, 8))


def _assert_equal_pgs(pg, loaded, model, args, patch_path):
    """Outputs, a patch, NodePaths and pg.graph of ``loaded`` equal ``pg``'s and the model's."""
    def first(value):
        return value.logits if hasattr(value, "logits") else value
    eager = first(model(*args))
    assert torch.equal(first(loaded(*args)), eager)
    assert torch.equal(first(loaded(*args)), first(pg(*args)))
    with pg.patch({patch_path: ZeroPatch()}):
        patched = first(pg(*args))
    with loaded.patch({patch_path: ZeroPatch()}):
        loaded_patched = first(loaded(*args))
    assert not torch.equal(patched, eager)  # the patch acts
    assert torch.equal(loaded_patched, patched)
    assert loaded.node_paths() == pg.node_paths()
    assert same_tree(loaded.graph, pg.graph)
    for mine, theirs in zip(loaded.extractions, pg.extractions):
        assert mine.opaque == theirs.opaque


@pytest.mark.parametrize("factory,patch_path", [(gpt2, "transformer.h_0.attn.softmax"),
                                                (llama, "model.layers_0.mlp.down_proj.output")])
def test_save_then_load_equals_fresh_extraction(tmp_path, monkeypatch, factory, patch_path):
    model, ids = factory(), _ids()
    pg = PatchableGraph(model, ids)
    pg.save(tmp_path / "pg.nnbridge")
    _refuse_export(monkeypatch)
    loaded = PatchableGraph.load(tmp_path / "pg.nnbridge", model)
    _assert_equal_pgs(pg, loaded, model, (ids,), patch_path)


def test_load_does_not_export(tmp_path, monkeypatch):
    model, ids = gpt2(), _ids()
    PatchableGraph(model, ids).save(tmp_path / "pg.nnbridge")
    _refuse_export(monkeypatch)
    loaded = PatchableGraph.load(tmp_path / "pg.nnbridge", model)
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_load_uses_the_models_own_parameters(tmp_path):
    model, ids = gpt2(), _ids()
    PatchableGraph(model, ids).save(tmp_path / "pg.nnbridge")
    loaded = PatchableGraph.load(tmp_path / "pg.nnbridge", model)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)  # tied to wte: changes every output
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    logits = loaded(ids).logits
    logits.sum().backward()
    assert model.transformer.h[0].mlp.c_fc.weight.grad is not None


def test_archive_holds_no_weights_and_no_pickled_code(tmp_path):
    model, ids = gpt2(), _ids()
    PatchableGraph(model, ids).save(tmp_path / "pg.nnbridge")
    with _archive(tmp_path / "pg.nnbridge") as archive:
        names = archive.namelist()
        header = json.loads(archive.read("nnbridge.json"))
        inputs = torch.load(io.BytesIO(archive.read("inputs.pt")), weights_only=True)  # plain tensors only
        assert sorted(names) == ["inputs.pt", "nnbridge.json", "programs/0.pt2"]
        assert torch.equal(inputs[0], ids)
        program = zipfile.ZipFile(io.BytesIO(archive.read("programs/0.pt2")))
    stored = {info.filename: info.file_size for info in program.infolist() if "/data/weights/" in info.filename}
    assert stored and all(size == 0 for name, size in stored.items() if not name.endswith(".json"))
    assert ["state_dict", "model.transformer.wte.weight"] in header["records"][0]["left_out"]


def test_opaque_child_round_trip(tmp_path, monkeypatch):
    model, x = data_dependent()
    with falls_back("branchy"):
        pg = PatchableGraph(model, x)
    assert "branchy" in pg.extractions[0].opaque
    pg.save(tmp_path / "pg.nnbridge")
    with _archive(tmp_path / "pg.nnbridge") as archive:
        header = json.loads(archive.read("nnbridge.json"))
    # the root's program and those of the opaque child's own child, extracted on its own (with grad, and
    # without by the recording run that describes shapes)
    assert [r["path"] for r in header["records"]] == ["", "branchy.inner", "branchy.inner"]
    _refuse_export(monkeypatch)
    with falls_back("branchy"):
        loaded = PatchableGraph.load(tmp_path / "pg.nnbridge", model)
    # with grad, inner's input requires grad: a call structure neither pg has seen, extracted on
    # the first call by both
    monkeypatch.undo()
    _assert_equal_pgs(pg, loaded, model, (x,), "pre.output")
    with pg.patch({"branchy.inner.output": ZeroPatch()}):
        expected = pg(x)
    with loaded.patch({"branchy.inner.output": ZeroPatch()}):
        assert torch.equal(loaded(x), expected)


def test_save_without_path_is_nnsights_save():
    pg = PatchableGraph(*_linear())
    with pytest.raises(ValueError, match="outside a trace"):  # nnsight's .save() outside a trace, as before
        pg.save()


def _linear():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()).eval(), torch.randn(2, 3)


# -- bad input ------------------------------------------------------------------------------------
def test_load_with_another_model_class_names_the_difference(tmp_path):
    model, ids = gpt2(), _ids()
    PatchableGraph(model, ids).save(tmp_path / "pg.nnbridge")
    with pytest.raises(SaveLoadError, match="model class differs.*GPT2LMHeadModel.*LlamaForCausalLM"):
        PatchableGraph.load(tmp_path / "pg.nnbridge", llama())


def test_load_with_another_config_names_the_difference(tmp_path):
    model, ids = gpt2(), _ids()
    PatchableGraph(model, ids).save(tmp_path / "pg.nnbridge")
    other = gpt2()
    other.config.layer_norm_epsilon = 1e-3
    with pytest.raises(SaveLoadError, match="config differs"):
        PatchableGraph.load(tmp_path / "pg.nnbridge", other)


def test_load_with_another_module_tree_names_the_difference(tmp_path):
    model, x = _linear()
    PatchableGraph(model, x).save(tmp_path / "pg.nnbridge")
    other = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh()).eval()
    with pytest.raises(SaveLoadError, match="module tree differs"):
        PatchableGraph.load(tmp_path / "pg.nnbridge", other)


def test_load_into_a_model_with_other_weight_tying_is_refused(tmp_path):
    """A program saved with ``lm_head`` tied to the embedding would compute with the embedding in
    a model whose ``lm_head`` has its own weight (one placeholder for both): refused by name."""
    model, ids = gpt2(), _ids()
    PatchableGraph(model, ids).save(tmp_path / "pg.nnbridge")
    other = gpt2()
    other.lm_head.weight = torch.nn.Parameter(other.lm_head.weight.detach() * 2)
    with pytest.raises(SaveLoadError, match="module tree differs.*one tensor, as tied weights are"):
        PatchableGraph.load(tmp_path / "pg.nnbridge", other)
    assert torch.equal(PatchableGraph.load(tmp_path / "pg.nnbridge", gpt2())(ids).logits, gpt2()(ids).logits)


def test_load_with_other_options_is_refused(tmp_path):
    model, x = _linear()
    PatchableGraph(model, x).save(tmp_path / "pg.nnbridge")
    with pytest.raises(SaveLoadError, match="skip_compilation"):
        PatchableGraph.load(tmp_path / "pg.nnbridge", model, nnbridge.ExtractionOptions(skip_compilation=True))


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_corrupt_file_is_a_clear_error(tmp_path, damage):
    model, x = _linear()
    path = tmp_path / "pg.nnbridge"
    PatchableGraph(model, x).save(path)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":  # inside the stored program: the zip checksum catches it
        data[len(data) // 3] ^= 0xFF
    else:
        data = bytearray(b"not a zip file at all")
    path.write_bytes(bytes(data))
    with pytest.raises(SaveLoadError, match="pg.nnbridge.*(corrupt or partial|cannot be read)"):
        PatchableGraph.load(path, model)


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        PatchableGraph.load(tmp_path / "absent.nnbridge", _linear()[0])


def _rewrite_header(path, change):
    """Replace the pg.save file at ``path`` by its archive alone (a file PatchableGraph.load also
    reads), with ``change`` applied to the header."""
    with _archive(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    header = json.loads(members["nnbridge.json"])
    change(header)
    members["nnbridge.json"] = json.dumps(header).encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def test_other_library_versions_load_with_a_warning(tmp_path):
    model, x = _linear()
    path = tmp_path / "pg.nnbridge"
    pg = PatchableGraph(model, x)
    pg.save(path)
    _rewrite_header(path, lambda h: h["versions"].update(transformers="0.0.1"))
    with pytest.warns(NNBridgeWarning, match="transformers 0.0.1"):
        loaded = PatchableGraph.load(path, model)
    assert torch.equal(loaded(x), model(x))


def test_a_load_in_another_grad_mode_warns_naming_what_was_exported_anew(tmp_path):
    """The saved programs were exported with grad: a load under ``no_grad`` exports anew (another
    call) and says so; the loaded graphs equal the model."""
    model, x = _linear()
    path = tmp_path / "pg.nnbridge"
    PatchableGraph(model, x).save(path)
    with torch.no_grad():
        with pytest.warns(NNBridgeWarning, match=r"no saved program matched the call of \['<root>'\]"):
            loaded = PatchableGraph.load(path, model)
        assert torch.equal(loaded(x), model(x))


def test_a_module_run_eagerly_as_a_whole_is_not_reported_missing(tmp_path, monkeypatch):
    """Llama with ``output_attentions``: the decoder stack is opaque and its ``torch.no_grad``
    rotary embedding runs eagerly as a whole, so no program of it is saved; the load finds every
    program it needs, exports nothing and does not warn (the test suite turns warnings into errors)."""
    model = no_grad_rotary(llama())  # as transformers < 5.24's
    ids = _ids()
    pg = PatchableGraph(model, ids, use_cache=False, output_attentions=True)
    assert isinstance(pg._graph_module.model.rotary_emb, OpaqueGraphModule)
    # the archive alone: the test's rotary class, made at run time, cannot be pickled by pg.save
    saving.write_archive(pg, tmp_path / "pg.nnbridge")
    _refuse_export(monkeypatch)
    loaded = PatchableGraph.load(tmp_path / "pg.nnbridge", no_grad_rotary(llama()))
    out = loaded(ids, use_cache=False, output_attentions=True)
    expected = llama()(ids, use_cache=False, output_attentions=True)
    assert torch.equal(out.logits, expected.logits)
    assert all(torch.equal(a, b) for a, b in zip(out.attentions, expected.attentions, strict=True))


def test_a_derived_dimension_survives_save_and_load(tmp_path, monkeypatch):
    """A guard dimension derived from another's (``past + 1``, format 2) is written and read back:
    the loaded extraction serves other lengths without exporting."""
    model = PastPlusNew()
    pg = PatchableGraph(model, *past_plus_new(5))
    pg.save(tmp_path / "pg.nnbridge")
    _refuse_export(monkeypatch)
    loaded = PatchableGraph.load(tmp_path / "pg.nnbridge", model)
    assert loaded.extractions[0].guard.dims == pg.extractions[0].guard.dims
    for length in (3, 11):
        inputs = past_plus_new(length)
        assert torch.equal(loaded(*inputs), model(*inputs))
    assert len(loaded.extractions) == 1


def test_a_format_1_file_loads(tmp_path):
    """Format 2 only added derived guard dimensions: files written in format 1 still load."""
    model, x = _linear()
    path = tmp_path / "pg.nnbridge"
    PatchableGraph(model, x).save(path)
    _rewrite_header(path, lambda h: h.update(format=1))
    assert torch.equal(PatchableGraph.load(path, model)(x), model(x))


def test_code_replaced_since_saving_loads_with_a_warning(tmp_path, monkeypatch):
    """As a changed source file: an explicit load serves the saved graphs, and warns."""
    from transformers.models.gpt2 import modeling_gpt2
    ids = torch.randint(0, 100, (1, 8))
    path = tmp_path / "pg.nnbridge"
    PatchableGraph(gpt2(), ids).save(path)
    saved = gpt2()
    expected = saved(ids).logits
    monkeypatch.setattr(modeling_gpt2.GPT2MLP, "forward", lambda self, h: self.c_proj(self.act(self.c_fc(h))) * 0.5)
    with pytest.warns(NNBridgeWarning, match="replaced at run time"):
        loaded = PatchableGraph.load(path, saved)
    assert torch.equal(loaded(ids).logits, expected)  # the graphs of the code as saved


def test_other_format_version_is_refused(tmp_path):
    model, x = _linear()
    path = tmp_path / "pg.nnbridge"
    PatchableGraph(model, x).save(path)
    _rewrite_header(path, lambda h: h.update(format=999))
    with pytest.raises(SaveLoadError, match="format 999"):
        PatchableGraph.load(path, model)


def test_save_over_a_bridged_model_is_refused(tmp_path):
    model, x = _linear()
    nnbridge.bridge(model, x)
    try:
        with pytest.raises(SaveLoadError, match="bridged model"):
            PatchableGraph(model, x).save(tmp_path / "pg.nnbridge")
    finally:
        nnbridge.unbridge(model)
    assert not (tmp_path / "pg.nnbridge").exists()


def test_failed_save_leaves_no_file(tmp_path, monkeypatch):
    model, x = _linear()
    pg = PatchableGraph(model, x)
    storage = __import__("nnbridge.store.storage", fromlist=["torch"])

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")
    monkeypatch.setattr(storage.torch.export, "save", broken)
    with pytest.raises(SaveLoadError, match="disk full"):
        pg.save(tmp_path / "pg.nnbridge")
    assert list(tmp_path.iterdir()) == []


def test_load_restores_shape_summaries_without_a_recording_run(tmp_path, monkeypatch):
    """pg.graph's shapes come from the file (the recording run that describes them is skipped)."""
    model, ids = gpt2(), _ids()
    pg = PatchableGraph(model, ids)
    pg.save(tmp_path / "pg.nnbridge")
    front_end = __import__("nnbridge.patching.patchable_graph", fromlist=["describe_examples"])

    def refuse(*args, **kwargs):
        raise AssertionError("the recording run ran during a load")
    monkeypatch.setattr(front_end, "describe_examples", refuse)
    loaded = PatchableGraph.load(tmp_path / "pg.nnbridge", model)
    assert same_tree(loaded.graph, pg.graph)
    assert loaded.graph.transformer.h_0.attn.softmax._shape == pg.graph.transformer.h_0.attn.softmax._shape
    assert loaded.graph.transformer.h_0.attn.softmax._shape == torch.Size([1, 4, 8, 8])


def test_load_without_saved_summaries_makes_the_recording_run(tmp_path):
    model, ids = gpt2(), _ids()
    pg = PatchableGraph(model, ids)
    path = tmp_path / "pg.nnbridge"
    pg.save(path)
    _rewrite_header(path, lambda h: h.update(examples=None))
    loaded = PatchableGraph.load(path, model)
    assert same_tree(loaded.graph, pg.graph)


def test_load_over_a_bridged_model_shares_the_bridge(tmp_path):
    model, x = _linear()
    PatchableGraph(model, x).save(tmp_path / "pg.nnbridge")
    nnbridge.bridge(model, x)
    try:
        loaded = PatchableGraph.load(tmp_path / "pg.nnbridge", model)
        with loaded.patch({"0.output": ZeroPatch()}):
            assert torch.equal(model(x), torch.zeros(2, 3))  # the model's own forward is patched
    finally:
        nnbridge.unbridge(model)
    assert torch.equal(model(x), _linear()[0](x))
