"""The file pg.save writes is one torch.save file (model + archive): torch.load(f, weights_only=False)
returns the PatchableGraph, torch.load(f) refuses without running pickled code, naming both loads,
PatchableGraph.load(f, model) reads only the archive; torch.save(pg) / pickle raise ValueError."""

from __future__ import annotations

import copy
import io
import pickle
import shutil

import pytest
import torch
from utils import gpt2

from nnbridge import NNBridgeWarning, PatchableGraph, ZeroPatch
from nnbridge.errors import SaveLoadError
from nnbridge.patching import saving

#: every ``__setstate__`` of a :class:`Recorded` that ran (unpickling a model runs it)
RAN: list[str] = []


class Recorded(torch.nn.Module):
    """A model whose unpickling is visible: ``__setstate__`` records that it ran."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x):
        return torch.relu(self.linear(x)) * 2

    def __setstate__(self, state):
        RAN.append("Recorded.__setstate__")
        super().__setstate__(state)


def _recorded():
    torch.manual_seed(0)
    return Recorded().eval(), torch.randn(2, 3)


@pytest.fixture(autouse=True)
def _clear_ran():
    RAN.clear()


def _saved(pg):
    stream = io.BytesIO()
    pg.save(stream)
    stream.seek(0)
    return stream


def test_trusted_torch_load_returns_an_equal_patchable_graph():
    model, ids = gpt2(), torch.randint(0, 100, (1, 8))
    pg = PatchableGraph(model, ids)
    loaded = torch.load(_saved(pg), weights_only=False)
    assert isinstance(loaded, PatchableGraph)
    assert loaded._dispatcher.module is not model  # the weights travel with the file
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    with pg.patch({"transformer.h_1.mlp.act.output": ZeroPatch()}):
        expected = pg(ids).logits
    with loaded.patch({"transformer.h_1.mlp.act.output": ZeroPatch()}):
        patched = loaded(ids).logits
    assert torch.equal(patched, expected) and not torch.equal(patched, model(ids).logits)
    assert loaded.node_paths() == pg.node_paths()
    assert [n for n, _ in loaded.named_modules()] == [n for n, _ in pg.named_modules()]


def test_default_torch_load_refuses_before_any_model_code_runs():
    model, x = _recorded()
    stream = _saved(PatchableGraph(model, x))
    with pytest.raises(SaveLoadError, match=r"weights_only=False.*PatchableGraph.load\(f, model\)"):
        torch.load(stream)
    assert RAN == []
    stream.seek(0)
    loaded = torch.load(stream, weights_only=False)  # the trusted load does unpickle the model
    assert RAN == ["Recorded.__setstate__"]
    assert torch.equal(loaded(x), model(x))


def test_patchable_graph_load_reads_the_archive_without_unpickling_the_model(tmp_path):
    model, x = _recorded()
    pg = PatchableGraph(model, x)
    pg.save(tmp_path / "pg.pt")
    loaded = PatchableGraph.load(tmp_path / "pg.pt", model)
    assert RAN == []
    assert loaded._dispatcher.module is model
    assert torch.equal(loaded(x), model(x))
    with pg.patch({"linear.output": ZeroPatch()}):
        expected = pg(x)
    with loaded.patch({"linear.output": ZeroPatch()}):
        assert torch.equal(loaded(x), expected)


@pytest.mark.parametrize("pickles", [lambda pg: torch.save(pg, io.BytesIO()), pickle.dumps, copy.deepcopy],
                         ids=["torch.save", "pickle", "deepcopy"])
def test_pickling_a_patchable_graph_raises_naming_pg_save(pickles):
    model, x = _recorded()
    pg = PatchableGraph(model, x)
    with pytest.raises(ValueError, match=r"pg\.save\(f\)"):
        pickles(pg)
    assert torch.equal(torch.load(_saved(pg), weights_only=False)(x), model(x))  # nothing left half-set


def test_a_bare_archive_file_still_loads(tmp_path):
    """A file holding only the archive (the pg.save format before the torch.save wrapping)."""
    model, x = _recorded()
    saving.write_archive(PatchableGraph(model, x), tmp_path / "pg.nnbridge")
    assert torch.equal(PatchableGraph.load(tmp_path / "pg.nnbridge", model)(x), model(x))


def test_a_torch_file_not_written_by_pg_save_is_refused(tmp_path):
    model, _ = _recorded()
    torch.save({"weights": torch.ones(2)}, tmp_path / "plain.pt")
    with pytest.raises(SaveLoadError, match=r"plain.pt is a torch.save file, not one written by pg.save"):
        PatchableGraph.load(tmp_path / "plain.pt", model)
    torch.save(model, tmp_path / "model.pt")
    with pytest.raises(SaveLoadError, match=r"not one written by pg.save.*weights_only=False"):
        PatchableGraph.load(tmp_path / "model.pt", model)
    assert RAN == []


class Unpicklable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.scale = lambda t: t * 2  # a lambda cannot be pickled

    def forward(self, x):
        return self.scale(self.linear(x))


def test_an_unpicklable_model_is_left_out_with_a_warning_and_loads_over_a_model(tmp_path):
    model, x = Unpicklable().eval(), torch.randn(2, 3)
    pg = PatchableGraph(model, x)
    with pytest.warns(NNBridgeWarning, match=r"cannot pickle the model Unpicklable \(.*lambda.*PatchableGraph.load"):
        pg.save(tmp_path / "pg.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["pg.pt"]
    with pytest.raises(SaveLoadError, match=r"holds no model .*PatchableGraph.load\(f, model\)"):
        torch.load(tmp_path / "pg.pt", weights_only=False)
    with pytest.raises(SaveLoadError, match="weights_only=False"):
        torch.load(tmp_path / "pg.pt")
    loaded = PatchableGraph.load(tmp_path / "pg.pt", model)
    assert torch.equal(loaded(x), model(x))
    with loaded.patch({"linear.output": ZeroPatch()}):
        assert torch.equal(loaded(x), torch.zeros(2, 3))


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    model, x = _recorded()
    pg = PatchableGraph(model, x)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match="No space left"):
        pg.save(tmp_path / "pg.pt")
    assert list(tmp_path.iterdir()) == []
    stream = io.BytesIO(b"kept")
    stream.seek(4)
    with pytest.raises(OSError, match="No space left"):
        pg.save(stream)
    assert stream.getvalue() == b"kept"


def test_a_disk_offloaded_model_round_trips_without_its_offload_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    gpt2().save_pretrained(tmp_path / "model")
    device_map = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.drop": "cpu",
                  "transformer.h.0": "cpu", "transformer.h.1": "disk", "transformer.ln_f": "cpu", "lm_head": "cpu"}

    def offloaded(folder):
        return AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                    offload_folder=tmp_path / folder).eval()
    model, reference = offloaded("a"), offloaded("b")
    ids = torch.randint(1, 100, (2, 6))
    stream = _saved(PatchableGraph(model, ids))
    shutil.rmtree(tmp_path / "a")  # the file holds the offloaded weights
    loaded = torch.load(stream, weights_only=False)  # the suite turns warnings into errors: none
    module = loaded._dispatcher.module
    assert module.transformer.h[1].attn.c_attn.weight.device.type == "meta"  # still offloaded
    assert "_hf_hook" in vars(module.transformer.h[1])
    assert torch.equal(loaded(ids).logits, reference(ids).logits)
    with loaded.patch({"transformer.h_1.mlp.act.output": ZeroPatch()}):
        patched = loaded(ids).logits
    assert not torch.equal(patched, reference(ids).logits)


def test_transformers_output_capturing_hooks_are_installed_again_after_loading():
    """A model called with output_attentions holds transformers' capturing hooks (local functions):
    pg.save leaves them out and transformers installs them again on the first capturing call."""
    from utils import llama

    model, ids = llama(), torch.randint(0, 100, (1, 8))
    pg = PatchableGraph(model, ids, use_cache=False, output_attentions=True)
    expected = model(ids, use_cache=False, output_attentions=True)
    loaded = torch.load(_saved(pg), weights_only=False)
    out = loaded(ids, use_cache=False, output_attentions=True)
    assert torch.equal(out.logits, expected.logits)
    assert len(out.attentions) == len(expected.attentions) > 0
    assert all(torch.equal(a, b) for a, b in zip(out.attentions, expected.attentions, strict=True))


class _Unseekable(io.RawIOBase):
    def __init__(self):
        self.written = bytearray()

    def writable(self):
        return True

    def seekable(self):
        return False

    def write(self, data):
        self.written += data
        return len(data)


def test_an_unpicklable_model_saved_to_an_unseekable_file_is_refused():
    model, x = Unpicklable().eval(), torch.randn(2, 3)
    pg = PatchableGraph(model, x)
    with pytest.raises(SaveLoadError, match=r"cannot pickle the model Unpicklable .*save to a path or a seekable file"):
        pg.save(_Unseekable())
