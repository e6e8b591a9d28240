"""The disk extraction cache ($NNBRIDGE_CACHE): a second extraction of the same model skips
torch.export and equals eager torch; changed source, versions or config miss; corrupt entries are
deleted with a warning and rebuilt; ``nnbridge cache info|clear``."""

from __future__ import annotations

import functools
import os
import importlib
import textwrap

import pytest
import torch
from types import SimpleNamespace

from utils import same_tree, data_dependent, falls_back, gpt2, llama, replace_gpt2_code

import nnbridge
from nnbridge import PatchableGraph, ZeroPatch
from nnbridge.cli import main
from nnbridge.errors import NNBridgeWarning

extraction = importlib.import_module("nnbridge.dispatch.extraction")
disk_cache = importlib.import_module("nnbridge.store.disk_cache")
programs = importlib.import_module("nnbridge.store.programs")
storage = importlib.import_module("nnbridge.store.storage")

pytestmark = pytest.mark.no_extraction_cache  # each test counts exports in a cache of its own


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NNBRIDGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("NNBRIDGE_EXTRACTION_CACHE", raising=False)  # the module runs with the run's cache off
    return tmp_path / "cache" / "extractions"


def _ids():
    return torch.randint(0, 100, (1, 8))


def _entries(directory):
    return sorted(p.name for p in directory.glob("*.nnbridge"))


def test_second_bridge_skips_export_and_equals_eager(cache_dir, exports, monkeypatch):
    ids = _ids()
    first = gpt2()
    nnbridge.bridge(first, ids)
    assert exports[0] == 1 and len(_entries(cache_dir)) == 1
    model = gpt2()  # a fresh model (another process would build the same)
    eager = model(ids).logits
    nnbridge.bridge(model, ids)
    assert exports[0] == 1  # the cache served it
    assert torch.equal(model(ids).logits, eager)
    pg = PatchableGraph(model, ids)
    with pg.patch({"transformer.h_0.mlp.act.output": ZeroPatch()}):
        patched = model(ids).logits
    nnbridge.unbridge(model)
    monkeypatch.setenv("NNBRIDGE_EXTRACTION_CACHE", "memory")
    reference = PatchableGraph(gpt2(), ids)  # a fresh export: patches act the same
    assert exports[0] == 2
    with reference.patch({"transformer.h_0.mlp.act.output": ZeroPatch()}):
        assert torch.equal(reference(ids).logits, patched)


def _untouched(model):
    from nnbridge.inplace.bridging import bridge_of
    root = bridge_of(model).dispatcher.all_extractions()[0].root
    return {name: m.graph_meta.untouched for name, m in root.named_modules() if hasattr(m, "graph_meta")}


def test_cache_hit_keeps_the_cache_layers_each_graph_never_touched(cache_dir, exports):
    """What the state check before each call may leave out (see state.SpecCheck) is read back from
    the entry, so a skipped layer does not extract later layers again after a cache hit either."""
    ids = _ids()
    first = gpt2()
    nnbridge.bridge(first, ids)
    model = gpt2()
    nnbridge.bridge(model, ids)
    assert exports[0] == 1  # the cache served it
    fresh, cached = _untouched(first), _untouched(model)
    assert cached == fresh
    assert fresh["transformer.h.1.attn"] == {("layers", (0,))}  # its own layer 1 is compared


def test_cache_hit_equals_fresh_extraction(cache_dir, monkeypatch, exports):
    ids = _ids()
    monkeypatch.setenv("NNBRIDGE_EXTRACTION_CACHE", "0")  # the process's memory cache off too
    fresh = PatchableGraph(gpt2(), ids)  # cache off
    assert not cache_dir.exists()
    monkeypatch.delenv("NNBRIDGE_EXTRACTION_CACHE")
    PatchableGraph(gpt2(), ids)  # fills the cache
    cached = PatchableGraph(gpt2(), ids)
    assert exports[0] == 2
    assert cached.node_paths() == fresh.node_paths() and same_tree(cached.graph, fresh.graph)
    assert torch.equal(cached(ids).logits, fresh(ids).logits)


def test_changed_config_misses(cache_dir, exports):
    ids = _ids()
    PatchableGraph(gpt2(), ids)
    other = gpt2()
    other.config.layer_norm_epsilon = 1e-3
    for module in other.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = 1e-3
    pg = PatchableGraph(other, ids)
    assert exports[0] == 2 and len(_entries(cache_dir)) == 2
    assert torch.equal(pg(ids).logits, other(ids).logits)


class _Offsets(torch.nn.Module):
    """A list attribute read in forward."""

    def __init__(self, offsets):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.offsets = offsets

    def forward(self, x):
        return self.lin(x) + self.offsets[1]


@pytest.mark.parametrize("kind", ["float", "tensor"])
def test_changed_container_attribute_misses(cache_dir, exports, kind):
    """The module-tree hash holds lists and dicts of plain values and tensors (by a hash of their
    values): a model that differs only in ``self.offsets`` was served the first one's program
    (its constant)."""
    x = torch.randn(2, 4)
    value = float if kind == "float" else torch.tensor
    PatchableGraph(_Offsets([value(0.0), value(1.0)]), x)
    other = _Offsets([value(0.0), value(5.0)])
    pg = PatchableGraph(other, x)
    assert exports[0] == 2 and len(_entries(cache_dir)) == 2
    assert torch.equal(pg(x), other(x))
    PatchableGraph(_Offsets([value(0.0), value(5.0)]), x)
    assert exports[0] == 2


class _Activated(torch.nn.Module):
    """A built-in and a partial held as instance attributes."""

    def __init__(self, act, slope):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.act = act
        self.leaky = functools.partial(torch.nn.functional.leaky_relu, negative_slope=slope)

    def forward(self, x):
        return self.leaky(self.act(self.lin(x)) - 0.3)


@pytest.mark.parametrize("other", [(torch.tanh, 0.1), (torch.relu, 0.5)], ids=["builtin", "partial_argument"])
def test_changed_function_attribute_misses(cache_dir, exports, other):
    """The code digest holds built-ins held as attributes (by name) and a partial's plain
    arguments: a model holding ``torch.tanh`` was served the program of one holding ``relu``."""
    x = torch.randn(2, 4)
    PatchableGraph(_Activated(torch.relu, 0.1), x)
    model = _Activated(*other)
    pg = PatchableGraph(model, x)
    assert exports[0] == 2 and len(_entries(cache_dir)) == 2
    assert torch.equal(pg(x), model(x))
    PatchableGraph(_Activated(*other), x)
    assert exports[0] == 2


def _untied(model):
    """``model`` with its own ``lm_head`` weight, no longer the embedding's (GPT-2 ties them)."""
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 2)
    return model


@pytest.mark.parametrize("first_tied", [True, False])
def test_changed_weight_tying_misses_and_equals_eager(cache_dir, exports, first_tied):
    """torch.export gives tied weights one placeholder: a program exported with ``lm_head`` tied
    to the embedding, served to a model whose ``lm_head`` has its own weight, computed with the
    embedding (logits differed from eager without an error)."""
    ids = _ids()
    first, second = gpt2(), _untied(gpt2())
    if not first_tied:
        first, second = second, first
    PatchableGraph(first, ids)
    assert (second.lm_head.weight is second.transformer.wte.weight) is not first_tied
    pg = PatchableGraph(second, ids)
    assert exports[0] == 2 and len(_entries(cache_dir)) == 2
    assert torch.equal(pg(ids).logits, second(ids).logits)


def test_attention_implementation_misses(cache_dir, exports):
    """Llama with sdpa after Llama with eager attention (``config.to_json_string`` is the same for
    both): the sdpa model is exported, not served eager's program; logits ``(1, 8, 100)`` equal
    eager torch for each."""
    ids = _ids()
    counts = []
    for attn in ("eager", "sdpa"):
        model = llama(attn)
        expected = model(ids).logits
        pg = PatchableGraph(model, ids)
        assert torch.equal(pg(ids).logits, expected)
        assert any("scaled_dot_product" in op for op in pg.node_paths()) == (attn == "sdpa")
        counts.append((exports[0], len(_entries(cache_dir))))
    assert counts[0][0] >= 1 and counts[1] == (2 * counts[0][0], 2 * counts[0][1])  # nothing served


class _Flagged(torch.nn.Module):
    """A module's own config look-alike read in forward (not a transformers config)."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(act="relu")
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return torch.relu(h) if self.config.act == "relu" else torch.tanh(h)


def test_changed_config_look_alike_misses(cache_dir, exports):
    x = torch.randn(2, 4)
    PatchableGraph(_Flagged(), x)
    other = _Flagged()
    other.config.act = "tanh"
    pg = PatchableGraph(other, x)
    assert exports[0] == 2 and len(_entries(cache_dir)) == 2
    assert torch.equal(pg(x), torch.tanh(other.fc(x)))


def test_class_without_source_is_never_cached(cache_dir, exports):
    """A module class defined by ``exec`` (as in a notebook cell) has no source file to key its
    programs by: nothing is stored or served, each extraction exports, outputs equal eager."""
    namespace: dict = {"torch": torch}
    exec(textwrap.dedent("""
        class Cell(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(4, 4)

            def forward(self, x):
                return self.fc(x).relu()
    """), namespace)
    x = torch.randn(2, 4)
    for _ in range(2):
        model = namespace["Cell"]()
        assert torch.equal(PatchableGraph(model, x)(x), model(x))
    assert exports[0] == 2
    assert not cache_dir.exists() or _entries(cache_dir) == []


def test_a_call_with_a_cache_argument_is_served_cleanly(cache_dir, exports):
    """A decode step (``past_key_values=DynamicCache``) cached by one model is served to a fresh
    one: no export, logits ``(1, 1, 100)`` and the cache equal eager, and nothing logged by torch's
    loader (the example inputs, which held the cache object, are not written)."""
    import logging

    class Records(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records = []

        def emit(self, record):
            self.records.append(record)
    ids, step = _ids(), torch.randint(0, 100, (1, 1))
    results, logged = [], Records()
    loader = logging.getLogger("torch._export.serde.serialize")
    loader.addHandler(logged)
    try:
        for _ in range(2):
            plain = gpt2()
            with torch.no_grad():
                expected = plain(step, past_key_values=plain(ids).past_key_values).logits
            model = nnbridge.bridge(gpt2(), ids)
            with torch.no_grad():
                got = model(step, past_key_values=model(ids).past_key_values).logits
            assert torch.equal(got, expected)
            results.append(exports[0])
    finally:
        loader.removeHandler(logged)
    assert results[1] == results[0]  # the fresh model's calls were all served
    assert [r.msg for r in logged.records] == []  # no "Fallback to weights_only=False"


def test_changed_library_version_misses(cache_dir, exports, monkeypatch):
    x = torch.randn(2, 3)
    PatchableGraph(_linear(), x)
    real = disk_cache.library_versions
    monkeypatch.setattr(disk_cache, "library_versions", lambda: {**real(), "transformers": "99.0"})
    PatchableGraph(_linear(), x)
    assert exports[0] == 2 and len(_entries(cache_dir)) == 2


def test_an_entry_written_by_another_torch_is_never_read(cache_dir, exports, monkeypatch):
    """A cache written under torch 2.13 is not read under 2.15: the torch version is in the key."""
    x = torch.randn(2, 3)
    real = disk_cache.library_versions
    monkeypatch.setattr(disk_cache, "library_versions", lambda: {**real(), "torch": "2.13.0+cpu"})
    PatchableGraph(_linear(), x)
    monkeypatch.setattr(disk_cache, "library_versions", lambda: {**real(), "torch": "2.15.0+cu130"})
    pg = PatchableGraph(_linear(), x)
    assert exports[0] == 2 and len(_entries(cache_dir)) == 2
    assert torch.equal(pg(x), pg._dispatcher.module(x))


def test_changed_recording_version_misses(cache_dir, exports, monkeypatch):
    """Entries recorded before helper lines were kept in stack traces (no aliases) are not reused."""
    x = torch.randn(2, 3)
    PatchableGraph(_linear(), x)
    monkeypatch.setattr(disk_cache, "RECORDING_VERSION", disk_cache.RECORDING_VERSION - 1)
    PatchableGraph(_linear(), x)
    assert exports[0] == 2 and len(_entries(cache_dir)) == 2


def test_an_entry_written_by_other_nnbridge_code_is_never_read(cache_dir, exports, monkeypatch):
    """The digest of nnbridge's own source is in the key: an entry another nnbridge code exported
    (under the same version number) misses; the digest covers every module of the package."""
    x = torch.randn(2, 3)
    PatchableGraph(_linear(), x)
    digest = disk_cache.source_digest()
    assert len(digest) == 64 and disk_cache.source_digest() is digest  # once per process
    monkeypatch.setattr(disk_cache, "source_digest", lambda: "0" * 64)
    pg = PatchableGraph(_linear(), x)
    assert exports[0] == 2 and len(_entries(cache_dir)) == 2
    assert torch.equal(pg(x), pg._dispatcher.module(x))


def test_changed_model_source_misses(cache_dir, exports, tmp_path, monkeypatch):
    source = tmp_path / "src" / "edited_model.py"
    source.parent.mkdir()
    source.write_text(textwrap.dedent("""
        import torch

        class Edited(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(3, 3)

            def forward(self, x):
                return self.linear(x).relu()
    """))
    monkeypatch.syspath_prepend(str(source.parent))
    module = importlib.import_module("edited_model")
    x = torch.randn(2, 3)
    PatchableGraph(module.Edited(), x)
    PatchableGraph(module.Edited(), x)
    assert exports[0] == 1
    source.write_text(source.read_text() + "\n# edited\n")
    programs.forget_source_digests()
    PatchableGraph(module.Edited(), x)
    assert exports[0] == 2


@pytest.mark.parametrize("replace", ["class_method", "module_helper", "attention_registry"])
def test_code_replaced_at_run_time_misses_and_equals_eager(cache_dir, exports, monkeypatch, replace):
    """A method or helper replaced at run time (the source files unchanged) is not served the graph
    of the old code: the cache misses and the bridged model equals eager with the new code. Before,
    the entry was served and the numbers silently differed."""
    ids = _ids()
    attn = "sdpa" if replace == "attention_registry" else "eager"
    nnbridge.bridge(gpt2(attn), ids)
    assert exports[0] == 1 and len(_entries(cache_dir)) == 1
    model = gpt2(attn)
    before = model(ids).logits
    replace_gpt2_code(monkeypatch, replace)
    eager = model(ids).logits
    assert not torch.equal(eager, before)  # the replacement changes the numbers
    nnbridge.bridge(model, ids)
    # missed; a replaced sdpa function also makes the mask-building module opaque (see
    # test_mask_skips): its children are exported one by one
    assert exports[0] == 2 if replace != "attention_registry" else exports[0] > 2
    assert torch.equal(model(ids).logits, eager)
    nnbridge.unbridge(model)
    exported = exports[0]
    monkeypatch.undo()  # the cache variable too: set it again, the original code hits again
    monkeypatch.setenv("NNBRIDGE_CACHE", str(cache_dir.parent))
    monkeypatch.delenv("NNBRIDGE_EXTRACTION_CACHE", raising=False)
    nnbridge.bridge(gpt2(attn), ids)
    assert exports[0] == exported


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_corrupt_entry_is_deleted_with_a_warning_and_rebuilt(cache_dir, exports, damage):
    ids = _ids()
    PatchableGraph(gpt2(), ids)
    (entry,) = cache_dir.glob("*.nnbridge")
    data = bytearray(entry.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[len(data) // 3] ^= 0xFF
    else:
        data = bytearray()
    entry.write_bytes(bytes(data))
    model = gpt2()
    with pytest.warns(NNBridgeWarning, match="unusable and was deleted"):
        pg = PatchableGraph(model, ids)
    assert exports[0] == 2
    assert torch.equal(pg(ids).logits, model(ids).logits)
    storage.read_bundle(entry)  # rewritten, readable
    PatchableGraph(gpt2(), ids)
    assert exports[0] == 2


def test_failed_write_warns_and_extraction_goes_on(cache_dir, exports, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(disk_cache, "write_bundle", broken)
    model, x = _linear(), torch.randn(2, 3)
    with pytest.warns(NNBridgeWarning, match="could not write.*disk full"):
        pg = PatchableGraph(model, x)
    assert torch.equal(pg(x), model(x))
    assert _entries(cache_dir) == []


def test_writes_are_atomic(cache_dir, monkeypatch):
    """A write interrupted after the temporary file was written leaves no entry and no temp file."""
    real_replace = storage.os.replace

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(storage.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        PatchableGraph(_linear(), torch.randn(2, 3))
    assert list(cache_dir.iterdir()) == []
    monkeypatch.setattr(storage.os, "replace", real_replace)
    PatchableGraph(_linear(), torch.randn(2, 3))
    assert len(_entries(cache_dir)) == 1 and [p for p in cache_dir.iterdir() if p.suffix == ".tmp"] == []


def test_cache_off_when_switched_off(cache_dir, monkeypatch):
    monkeypatch.setenv("NNBRIDGE_EXTRACTION_CACHE", "0")
    assert disk_cache.default_cache() is None
    PatchableGraph(_linear(), torch.randn(2, 3))
    assert not cache_dir.exists()


def test_cache_on_by_default_in_the_home_cache(tmp_path, monkeypatch, exports):
    monkeypatch.delenv("NNBRIDGE_CACHE", raising=False)
    monkeypatch.delenv("NNBRIDGE_EXTRACTION_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    cache = disk_cache.default_cache()
    assert cache is not None and cache.directory == tmp_path / ".cache" / "nnbridge" / "extractions"
    x = torch.randn(2, 3)
    expected = _linear()(x)
    PatchableGraph(_linear(), x)
    assert len(cache.entries()) == 1 and exports[0] == 1
    served = PatchableGraph(_linear(), x)  # another model: the memory cache and the disk entry
    assert torch.equal(served(x), expected)


def test_memory_only_switch_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("NNBRIDGE_CACHE", raising=False)
    monkeypatch.setenv("NNBRIDGE_EXTRACTION_CACHE", "memory")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert disk_cache.default_cache() is None
    PatchableGraph(_linear(), torch.randn(2, 3))
    assert list(tmp_path.iterdir()) == []


def _entry(directory, name, size, age):
    path = directory / f"{name}{disk_cache.SUFFIX}"
    path.write_bytes(b"x" * size)
    os.utime(path, (age, age))
    return path


def test_least_recently_used_entries_are_evicted_past_the_limit(cache_dir, monkeypatch):
    cache_dir.mkdir(parents=True, exist_ok=True)
    oldest, middle, newest = (_entry(cache_dir, name, 400, age) for name, age in
                              (("a", 1_000), ("b", 2_000), ("c", 3_000)))
    monkeypatch.setenv("NNBRIDGE_CACHE_LIMIT", "1K")
    cache = disk_cache.DiskCache(cache_dir)
    assert cache.evict(keep=oldest) == 1  # 1200 bytes > 1000: one goes, never the one just written
    assert oldest.exists() and not middle.exists() and newest.exists()
    monkeypatch.setenv("NNBRIDGE_CACHE_LIMIT", "2000")
    assert cache.evict() == 0


def test_a_hit_marks_its_entry_recently_used(cache_dir, monkeypatch):
    x = torch.randn(2, 3)
    PatchableGraph(_linear(), x)
    (entry,) = disk_cache.DiskCache(cache_dir).entries()
    os.utime(entry, (1_000, 1_000))
    monkeypatch.setenv("NNBRIDGE_EXTRACTION_CACHE", "1")
    memory = importlib.import_module("nnbridge.store.memory_cache")
    monkeypatch.setattr(memory, "memory_cache", lambda: None)  # served from disk, not from the live model
    PatchableGraph(_linear(), x)
    assert entry.stat().st_mtime > 1_000


@pytest.mark.parametrize("value, expected", [("", disk_cache.DEFAULT_LIMIT), ("500M", 500_000_000),
                                             ("2G", 2_000_000_000), ("1.5gb", 1_500_000_000), ("123", 123)])
def test_size_limit_spellings(monkeypatch, value, expected):
    monkeypatch.setenv("NNBRIDGE_CACHE_LIMIT", value)
    assert disk_cache.size_limit() == expected


def test_a_bad_size_limit_names_the_variable(monkeypatch):
    monkeypatch.setenv("NNBRIDGE_CACHE_LIMIT", "lots")
    with pytest.raises(nnbridge.NNBridgeError, match="NNBRIDGE_CACHE_LIMIT='lots' is not a size"):
        disk_cache.size_limit()


def _linear():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()).eval()


# -- CLI ------------------------------------------------------------------------------------------
def test_cli_info_and_clear(cache_dir, capsys):
    PatchableGraph(_linear(), torch.randn(2, 3))
    (cache_dir / ".leftover.nnbridge.x.tmp").write_bytes(b"partial")
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert f"directory: {cache_dir}" in out and "entries: 1" in out
    assert main(["cache", "clear"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert list(cache_dir.iterdir()) == []
    assert main(["cache", "info"]) == 0
    assert "entries: 0" in capsys.readouterr().out


def test_cli_cache_off(monkeypatch, capsys):
    monkeypatch.setenv("NNBRIDGE_EXTRACTION_CACHE", "0")
    assert main(["cache", "info"]) == 0
    assert "off (NNBRIDGE_EXTRACTION_CACHE is '0'" in capsys.readouterr().out


def test_cli_bad_action_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["cache", "purge"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_opaque_child_programs_are_cached_too(cache_dir, exports, monkeypatch):
    """The root's program and the separately exported children of an opaque module all hit."""
    model, x = data_dependent()
    with falls_back("branchy"):
        first = PatchableGraph(model, x)
    first(x)
    made = exports[0]
    assert made >= 2 and len(_entries(cache_dir)) >= 2  # failed export attempts store nothing

    def refuse(*args, **kwargs):
        raise AssertionError("torch.export ran with a warm cache")
    monkeypatch.setattr(extraction, "export_module", refuse)
    fresh, _ = data_dependent()
    fresh.load_state_dict(model.state_dict())  # same weights (the factory is not seeded)
    with falls_back("branchy"):  # from the cache as from an export
        pg = PatchableGraph(fresh, x)
    assert torch.equal(pg(x), fresh(x))
    assert pg.extractions[0].opaque == first.extractions[0].opaque
    with pg.patch({"branchy.inner.output": ZeroPatch()}):
        patched = pg(x)
    with first.patch({"branchy.inner.output": ZeroPatch()}):
        assert torch.equal(patched, first(x))


def test_entries_are_written_with_the_bytes_of_torch_export_save():
    """compat.torch.serialization.save_program leaves the example inputs out only: the bytes equal
    torch.export.save's of the program without them, the program loads back equal, and its example
    inputs are restored."""
    import io

    from nnbridge.compat.torch.serialization import load_program, save_program

    model, ids = gpt2(), _ids()
    from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model
    register_cache_pytrees_for_model(model)
    with torch.no_grad():
        exported = torch.export.export(model, (ids,), {"use_cache": False}, strict=False)
    examples = exported.example_inputs
    ours, theirs = io.BytesIO(), io.BytesIO()
    save_program(exported, ours)
    assert exported.example_inputs is examples  # restored
    exported.example_inputs = None  # save_program leaves the example inputs out
    torch.export.save(exported, theirs)
    assert ours.getvalue() == theirs.getvalue()
    ours.seek(0)
    loaded = load_program(ours)
    with torch.no_grad():
        assert torch.equal(loaded.module()(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


class _Scaled(torch.nn.Module):
    def forward(self, x):
        return x.softmax(-1) * x.shape[1]


def _saved_dynamic_program(stream):
    """A program with a dynamic size (so loading it constrains a symbol's range), saved to ``stream``."""
    from nnbridge.compat.torch.serialization import save_program

    x = torch.randn(2, 5)
    exported = torch.export.export(_Scaled(), (x,), dynamic_shapes=({1: torch.export.Dim("n", min=2, max=64)},))
    save_program(exported, stream)
    stream.seek(0)
    return exported


def test_a_loaded_program_has_torchs_own_symbol_ranges_and_a_failed_load_raises():
    """load_program gives the same ranges and outputs as torch.export.load; a truncated archive
    raises torch's error."""
    import io
    import zipfile

    from nnbridge.compat.torch.serialization import load_program

    stream = io.BytesIO()
    _saved_dynamic_program(stream)
    data = stream.getvalue()
    ours, theirs = load_program(io.BytesIO(data)), torch.export.load(io.BytesIO(data))
    assert ours.range_constraints == theirs.range_constraints and len(ours.range_constraints) == 1
    for width in (3, 17):
        x = torch.randn(2, width)
        assert torch.equal(ours.module()(x), _Scaled()(x))
        assert torch.equal(ours.module()(x), theirs.module()(x))
    with pytest.raises(zipfile.BadZipFile):  # a truncated archive
        load_program(io.BytesIO(data[: len(data) // 2]))


def test_loads_and_saves_in_several_threads_leave_torchs_globals_as_they_were():
    """save_program and load_program swap torch's globals one at a time: threads loading and
    saving at once each get the program, and the deserializer's own method is back afterwards."""
    import io
    import threading

    from torch._export.serde import serialize

    from nnbridge.compat.torch.serialization import load_program, save_program

    stream = io.BytesIO()
    exported = _saved_dynamic_program(stream)
    data = stream.getvalue()
    tensor_meta = serialize.GraphModuleDeserializer.__dict__["deserialize_tensor_meta"]
    results, errors = [], []

    def work():
        try:
            for _ in range(3):
                results.append(load_program(io.BytesIO(data)))
                save_program(exported, io.BytesIO())
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(results) == 12
    assert serialize.GraphModuleDeserializer.__dict__["deserialize_tensor_meta"] is tensor_meta
    x = torch.randn(2, 11)
    assert all(torch.equal(loaded.module()(x), _Scaled()(x)) for loaded in results[::4])


class _Projected(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.proj(x).softmax(-1) * x.shape[0] + x.shape[0]


def _fake_tensor_facts(value):
    """What a node's ``val`` is, in comparable form (symbolic sizes as their expressions)."""
    if not isinstance(value, torch.Tensor):
        return repr(value)
    return (type(value).__name__, str(value.shape), str(value.stride()), str(value.storage_offset()), value.dtype,
            value.device, value.requires_grad, value.layout)


def test_loaded_fake_tensors_and_symbolic_sizes_equal_torchs_own_load(monkeypatch):
    """load_program makes each node's fake tensor by the fake mode's constructor path: every
    node's value equals torch.export.load's (type,
    symbolic sizes and strides, dtype, device, requires_grad), all in one fake mode, outputs equal
    eager at other sizes, and the deserializer's methods are torch's again, also after a failed load."""
    import io

    from torch._export.serde import serialize

    from nnbridge.compat.torch.serialization import load_program, save_program

    torch.manual_seed(0)
    model = _Projected()
    exported = torch.export.export(model, (torch.randn(5, 4),), dynamic_shapes=({0: torch.export.Dim("n", min=2, max=64)},))
    stream = io.BytesIO()
    save_program(exported, stream)
    data = stream.getvalue()
    deserializer = serialize.GraphModuleDeserializer
    tensor_meta = deserializer.deserialize_tensor_meta
    ours = load_program(io.BytesIO(data))
    theirs = torch.export.load(io.BytesIO(data))
    assert deserializer.__dict__["deserialize_tensor_meta"] is tensor_meta
    facts = [_fake_tensor_facts(node.meta.get("val")) for node in ours.graph.nodes]
    assert facts == [_fake_tensor_facts(node.meta.get("val")) for node in theirs.graph.nodes]
    assert any(fact[6] for fact in facts if isinstance(fact, tuple))  # a parameter's (requires_grad)
    assert any("s" in fact[1] for fact in facts if isinstance(fact, tuple))  # symbolic sizes
    modes = {id(node.meta["val"].fake_mode) for node in ours.graph.nodes if isinstance(node.meta.get("val"), torch.Tensor)}
    assert len(modes) == 1
    assert ours.range_constraints == theirs.range_constraints
    for rows in (3, 17):
        x = torch.randn(rows, 4)
        assert torch.equal(ours.module()(x), model(x)) and torch.equal(ours.module()(x), theirs.module()(x))

    def broken(self, *args, **kwargs):  # a failure after the first fake tensors were made
        raise RuntimeError("unreadable outputs")
    monkeypatch.setattr(deserializer, "deserialize_outputs", broken)
    with pytest.raises(RuntimeError, match="error when deserializing"):  # (torch.export.load words it)
        load_program(io.BytesIO(data))
    assert deserializer.__dict__["deserialize_tensor_meta"] is tensor_meta


class _TwoSizes(torch.nn.Module):
    def forward(self, x, y):
        return (x.softmax(-1) * x.shape[0]).flatten(), y.cos() + y.shape[1], x.sum(0)


def test_a_symbolic_expression_is_parsed_once_per_load_with_torchs_own_symbols(monkeypatch):
    """load_program parses each symbolic size's text once per load (torch: once per size and
    stride of every node): the parses are fewer than torch's own load makes, each node's sizes,
    the shape env's hints and ranges and the outputs equal torch.export.load's, and nothing is
    kept after a load, a failed one included."""
    import io

    from torch._export.serde import serialize

    from nnbridge.compat.torch import serialization

    torch.manual_seed(0)
    examples = (torch.randn(5, 4), torch.randn(3, 6))
    dims = ({0: torch.export.Dim("n", min=2, max=64), 1: torch.export.Dim("m", min=2, max=64)},
            {1: torch.export.Dim("k", min=2, max=64)})
    stream = io.BytesIO()
    serialization.save_program(torch.export.export(_TwoSizes(), examples, dynamic_shapes=dims), stream)
    data = stream.getvalue()
    parse = serialize.GraphModuleDeserializer._parse_sym_expr
    parsed: list[str] = []

    def counted(self, expr_str, hint=None):
        parsed.append(expr_str)
        return parse(self, expr_str, hint)
    monkeypatch.setattr(serialize.GraphModuleDeserializer, "_parse_sym_expr", counted)
    ours = serialization.load_program(io.BytesIO(data))
    ours_parsed, parsed[:] = list(parsed), []
    theirs = torch.export.load(io.BytesIO(data))
    assert len(set(ours_parsed)) >= 3 and len(ours_parsed) < len(parsed)  # s.. of n, m, k, and n*m
    assert not serialization._PARSED
    assert ([_fake_tensor_facts(node.meta.get("val")) for node in ours.graph.nodes]
            == [_fake_tensor_facts(node.meta.get("val")) for node in theirs.graph.nodes])

    def shape_env(program):
        env = next(node.meta["val"].fake_mode.shape_env for node in program.graph.nodes
                   if isinstance(node.meta.get("val"), torch.Tensor))
        return ({str(k): v for k, v in env.backed_var_to_val.items()}, {str(k): str(v) for k, v in env.var_to_range.items()})
    assert shape_env(ours) == shape_env(theirs)
    assert ours.range_constraints == theirs.range_constraints
    x, y = torch.randn(7, 9), torch.randn(3, 11)
    for got, expected in zip(ours.module()(x, y), _TwoSizes()(x, y)):
        assert torch.equal(got, expected)

    def broken(self, *args, **kwargs):  # a failure after sizes were parsed
        raise RuntimeError("unreadable outputs")
    monkeypatch.setattr(serialize.GraphModuleDeserializer, "deserialize_outputs", broken)
    with pytest.raises(RuntimeError, match="error when deserializing"):
        serialization.load_program(io.BytesIO(data))
    assert not serialization._PARSED


_SECOND_PROCESS = """
import torch, nnbridge
from nnbridge.dispatch import extraction
from utils import gpt2
count = [0]
real = extraction.export_module
def counted(*args, **kwargs):
    count[0] += 1
    return real(*args, **kwargs)
extraction.export_module = counted
model = gpt2()
model.transformer.h[0].tags = {f"tag{i}" for i in range(16)}  # a set of strings repr's in a per-process order
ids = torch.arange(8).reshape(1, 8)
eager = model(ids).logits
nnbridge.bridge(model, ids)
assert torch.equal(model(ids).logits, eager)
print("exports", count[0])
"""


_BARRIER = """
import os, time, warnings
from nnbridge.store import storage
from nnbridge.errors import NNBridgeWarning
warnings.filterwarnings("error", category=NNBridgeWarning)  # a corrupt entry read would warn
barrier, me = os.environ["BARRIER"], os.environ["PYTHONHASHSEED"]
real_replace = storage.os.replace

def replace_together(source, target):
    # both writers hold a finished temporary file of the same entry before either renames it
    open(os.path.join(barrier, me), "w").close()
    deadline = time.monotonic() + 300
    while len(os.listdir(barrier)) < 2:
        assert time.monotonic() < deadline, "the other writer never reached its rename"
        time.sleep(0.01)
    real_replace(source, target)
storage.os.replace = replace_together
"""


@pytest.mark.integration  # end to end: two processes
def test_two_processes_writing_one_entry_at_once_leave_one_whole_entry(cache_dir, tmp_path):
    """Two processes that miss the same entry at once both write it (each its own temporary file,
    renamed over the entry: the last rename wins, either is whole); a third process is served by
    it without a warning, and no temporary file is left. The processes have other string-hash
    salts, as any two Python processes: a transformers model's ``generation_config`` holds a
    per-process hash, left out of the key, and a set attribute is keyed by its sorted elements."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)]), "BARRIER": str(barrier)}
    writers = [subprocess.Popen([sys.executable, "-c", _BARRIER + _SECOND_PROCESS], env={**env, "PYTHONHASHSEED": seed},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in ("1", "2")]
    outputs = [writer.communicate(timeout=600) for writer in writers]
    for writer, (out, err) in zip(writers, outputs):
        assert writer.returncode == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == "exports 1"  # both missed: each exported and wrote
    assert sorted(os.listdir(barrier)) == ["1", "2"]  # both renamed over the one entry
    assert len(_entries(cache_dir)) == 1 and [p for p in cache_dir.iterdir() if p.suffix == ".tmp"] == []
    reader = subprocess.run([sys.executable, "-c", _BARRIER + _SECOND_PROCESS], env={**env, "PYTHONHASHSEED": "3"},
                            capture_output=True, text=True, timeout=600)
    assert reader.returncode == 0, reader.stderr[-2000:]
    assert reader.stdout.strip().splitlines()[-1] == "exports 0"


def test_the_per_process_generation_config_hash_is_not_in_the_key():
    model = gpt2()
    before = programs.model_fingerprint(model)
    model.generation_config._original_object_hash = 12345
    assert programs.model_fingerprint(model) == before
    model.generation_config.max_length = 7  # a real value still counts
    assert programs.model_fingerprint(model) != before


