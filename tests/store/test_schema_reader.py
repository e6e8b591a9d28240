"""The schema reader a load of a stored program uses (nnbridge/compat/torch/schema_reader.py, the
``load_schema_reader`` patch): torch's JSON read into the same schema objects as torch's own
``_dict_to_dataclass`` (types, union tags and values at every level), torch's errors for malformed
JSON, each schema type's reader made once per load, and torch's function back in place after a
load, a failed one included."""

from __future__ import annotations

import dataclasses
import io
import json
import typing
import zipfile
from typing import Any

import pytest
import torch

import nnbridge
from nnbridge.compat import registry
from nnbridge.compat.torch import serialization
from nnbridge.compat.torch.schema_reader import SchemaReader

from utils import llama

serialize = pytest.importorskip("torch._export.serde.serialize")
schema = pytest.importorskip("torch._export.serde.schema")
package = pytest.importorskip("torch.export.pt2_archive._package")

pytestmark = pytest.mark.no_extraction_cache  # the test reads the entries of a cache of its own


def _same(ours: Any, theirs: Any, path: str = "") -> None:
    """``ours`` and ``theirs`` are the same schema tree: the same type at every level (an ``int``
    is not a ``float``), the same union tags, the same keys in the same order, equal leaves."""
    assert type(ours) is type(theirs), f"{path}: {type(ours).__name__} against {type(theirs).__name__}"
    if isinstance(theirs, list):
        assert len(ours) == len(theirs), path
        for index, (a, b) in enumerate(zip(ours, theirs)):
            _same(a, b, f"{path}[{index}]")
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), path
        for key in theirs:
            _same(ours[key], theirs[key], f"{path}.{key}")
    elif dataclasses.is_dataclass(theirs):
        assert getattr(ours, "_type", None) == getattr(theirs, "_type", None), path
        for field in dataclasses.fields(theirs):
            _same(vars(ours)[field.name], vars(theirs)[field.name], f"{path}.{field.name}")
    else:
        assert ours == theirs, path


def _stored_json(entry: bytes) -> list[tuple[str, Any]]:
    """``[(schema class name, JSON)]`` of every program and payload config in a disk-cache entry."""
    found = []
    with zipfile.ZipFile(io.BytesIO(entry)) as outer:
        for name in outer.namelist():
            if not name.endswith(".pt2"):
                continue
            with zipfile.ZipFile(io.BytesIO(outer.read(name))) as archive:
                for member in archive.namelist():
                    if member.endswith("models/model.json"):
                        found.append(("ExportedProgram", json.loads(archive.read(member))))
                    elif member.endswith("_config.json"):
                        found.append(("PayloadConfig", json.loads(archive.read(member))))
    return found


def test_every_stored_program_reads_as_torchs_own_reader_reads_it(tmp_path, monkeypatch):
    """A bridged Llama's disk-cache entry (a decoder layer reused, a DynamicCache, symbolic sizes):
    each program's and payload config's JSON reads into the same tree as torch's reader, and the
    bridge from that entry equals eager."""
    monkeypatch.setenv("NNBRIDGE_CACHE", str(tmp_path))
    monkeypatch.delenv("NNBRIDGE_EXTRACTION_CACHE", raising=False)
    ids = torch.randint(0, 100, (1, 9))
    nnbridge.bridge(llama(), ids)
    entries = list((tmp_path / "extractions").glob("*.nnbridge"))
    assert len(entries) == 1
    stored = _stored_json(entries[0].read_bytes())
    assert {name for name, _ in stored} == {"ExportedProgram", "PayloadConfig"}
    for name, data in stored:
        cls = getattr(schema, name)
        _same(SchemaReader()(cls, data), serialize._dict_to_dataclass(cls, data), name)
    model = llama()
    eager = model(ids).logits
    nnbridge.bridge(model, ids)  # from the entry: load_program with the reader
    assert torch.equal(model(ids).logits, eager)


@pytest.mark.parametrize("cls, data", [
    ("Argument", {"as_float": 2}),  # a float field given an int: float() as torch does
    ("Argument", {"as_tensors": []}),  # an empty list, returned as it is
    ("Argument", {"as_none": True}),
    ("TensorArgument", {"name": "x", "added_by_a_later_torch": 1}),  # unknown fields ignored
    ("Optional[TensorArgument]", None),
    ("Optional[TensorArgument]", {"name": "y"}),
    ("Annotated[TensorArgument, 10]", {"name": "z"}),
    ("dict[str, TensorArgument]", {"a": {"name": "a"}, "b": {"name": "b"}}),
    ("SymInt", {"as_expr": {"expr_str": "s0", "hint": {"as_int": 3}}}),
], ids=["float", "empty_list", "bool", "unknown_field", "none", "optional", "annotated", "dict", "nested_union"])
def test_each_branch_reads_as_torchs(cls, data):
    cls = eval(cls, {**vars(schema), **vars(typing)})  # noqa: S307 - the test's own type expressions
    _same(SchemaReader()(cls, data), serialize._dict_to_dataclass(cls, data))


@pytest.mark.parametrize("cls, data", [
    ("Argument", [1]),
    ("Argument", {"as_int": 1, "as_float": 2.0}),
    ("Argument", {1: 2}),
    ("Argument", {"as_nothing_torch_knows": 1}),
    ("NoSuchSchemaClass", {}),
    ("Optional[TensorArgument, int]", {"name": "x"}),
    ("TensorArgument", [{"name": "x"}]),
], ids=["union_not_a_dict", "union_two_tags", "union_tag_not_a_string", "union_unknown_tag", "unresolved_name",
        "three_way_optional", "list_for_a_dataclass"])
def test_malformed_json_raises_torchs_error(cls, data):
    if cls == "Optional[TensorArgument, int]":
        cls = typing.Union[schema.TensorArgument, int, None]
    elif cls != "NoSuchSchemaClass":
        cls = getattr(schema, cls)
    with pytest.raises(Exception) as theirs:
        serialize._dict_to_dataclass(cls, data)
    with pytest.raises(type(theirs.value)) as ours:
        SchemaReader()(cls, data)
    assert str(ours.value) == str(theirs.value)


def test_a_load_makes_each_types_reader_once_and_puts_torchs_reader_back(monkeypatch):
    """load_program reads through one reader per load (each schema type's reader made once), both
    modules holding torch's function get it back afterwards, also after a failed load, and with
    the patch off, or on a torch it was not verified on, torch's own reader runs (none is made)."""
    examples = (torch.randn(5, 4),)
    stream = io.BytesIO()
    serialization.save_program(torch.export.export(torch.nn.Linear(4, 3), examples,
                                                   dynamic_shapes=({0: torch.export.Dim("n")},)), stream)
    data = stream.getvalue()
    torchs = serialize._dict_to_dataclass
    made: list[Any] = []
    make = SchemaReader._make

    def counted(self, cls):
        made.append(cls)
        return make(self, cls)
    monkeypatch.setattr(SchemaReader, "_make", counted)
    loaded = serialization.load_program(io.BytesIO(data))
    assert made and len(made) == len(set(made))
    assert serialize._dict_to_dataclass is torchs and package._dict_to_dataclass is torchs
    x = torch.randn(7, 4)
    assert torch.equal(loaded.module()(x), torch.export.load(io.BytesIO(data)).module()(x))

    made.clear()
    with registry.disabled("load_schema_reader"):
        assert torch.equal(serialization.load_program(io.BytesIO(data)).module()(x), loaded.module()(x))
    assert not made

    def unbuildable(self):
        raise AssertionError("a reader was made where the patch is skipped")
    monkeypatch.setattr(SchemaReader, "__init__", unbuildable)  # (a torch whose names it would not find)
    with registry.assumed("torch", "2.15", kinds=["speed"]):
        assert torch.equal(serialization.load_program(io.BytesIO(data)).module()(x), loaded.module()(x))
    monkeypatch.undo()

    def broken(self, *args, **kwargs):
        raise RuntimeError("unreadable outputs")
    monkeypatch.setattr(serialize.GraphModuleDeserializer, "deserialize_outputs", broken)
    with pytest.raises(RuntimeError, match="error when deserializing"):
        serialization.load_program(io.BytesIO(data))
    assert serialize._dict_to_dataclass is torchs and package._dict_to_dataclass is torchs
