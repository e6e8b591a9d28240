"""nnbridge's on-disk format for extractions, shared by ``pg.save`` and the disk cache.

A *bundle* is one zip file:

- ``nnbridge.json``: the header (format version, library versions, the model fingerprint of
  :func:`~.programs.model_fingerprint`, options, and one metadata entry per program record:
  NodePath, call fingerprint, dynamic flag, threaded state keys, stubs, shape guard, the cache
  layers each threaded call's code never touched, and which parameters and buffers were left out);
- ``programs/<i>.pt2``: each exported program, written by ``torch.export.save`` (through
  :func:`~nnbridge.compat.torch.serialization.save_program`) with every
  parameter and persistent buffer of the model replaced by a meta tensor (no weights; no pickled
  code; non-persistent buffers, computed by the module, are written);
- ``inputs.pt`` (``pg.save`` only): the example inputs' leaves, plain tensors and numbers written
  by ``torch.save`` and read back with ``weights_only=True``; their tree is JSON in the header.

Reading puts the given model's own tensors back in place of the meta tensors, so the rebuilt
graphs share the model's parameters exactly as a fresh extraction does. A bundle is written to a
temporary file next to its destination and renamed into place (atomic on POSIX); zip checksums
catch a corrupt or partial file, reported as :class:`~nnbridge.errors.SaveLoadError`.

Example::

    write_bundle(path, header, records)
    bundle = read_bundle(path)
    record = bundle.record(0, model)      # a ProgramRecord whose program uses model's tensors
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import IO, Any, cast

import torch

from ..compat.torch.serialization import library_versions, load_program, save_program
from ..errors import SaveLoadError
from ..guards.call_structure import ShapeGuard
from .programs import ProgramRecord
from ..graph.state import Path as StatePath, UntouchedLayers

#: Version of the bundle layout written; a bundle of a version not in :data:`READABLE_FORMATS` is
#: refused (explicit load) or a cache miss. 2: shape guards may hold derived dimensions
#: (``(symbol, low, high, coefficient, offset)``, see :class:`~.call_structure.ShapeGuard`), which
#: a format-1 reader would take for plain symbols.
FORMAT_VERSION = 2
#: Versions this nnbridge reads (format 1 is format 2 without derived dimensions).
READABLE_FORMATS = (1, 2)
HEADER_NAME = "nnbridge.json"
INPUTS_NAME = "inputs.pt"


class UnserialisableProgram(SaveLoadError):
    """``torch.export.save`` cannot write an exported program of this call (a namedtuple argument
    such as an LSTM's ``PackedSequence`` has no serialised type name in torch 2.13): not a fault of
    the file or the disk."""


def _program_name(index: int) -> str:
    return f"programs/{index}.pt2"


def write_atomically(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write`` on a temporary file beside ``path``, then rename it to ``path``: a reader never
    sees a partial file, and on any exception nothing is left (the exception propagates)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            write(stream)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def write_bundle(target: str | os.PathLike[str] | IO[bytes], header: dict[str, Any], records: list[ProgramRecord],
                 *, inputs: list[Any] | None = None) -> None:
    """Write ``records`` (and the example inputs' leaves) with ``header`` as a bundle.

    Args:
        target: a path (written atomically: temporary file, then rename) or a binary file object.
        header: JSON-able values; ``format``, ``versions`` and ``records`` are added.
        records: the program records; their programs' parameters and buffers are not written.
        inputs: leaves of the example inputs (tensors, numbers, strings, None), or None.

    Raises:
        SaveLoadError: a program could not be serialised (nothing is left at ``target``).
    """
    if isinstance(target, (str, os.PathLike)):
        write_atomically(target, lambda stream: write_bundle(stream, header, records, inputs=inputs))
        return
    entries = []
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_STORED) as archive:
        for index, record in enumerate(records):
            buffer = io.BytesIO()
            left_out = _save_without_weights(record.exported, buffer)
            archive.writestr(_program_name(index), buffer.getvalue())
            entries.append({
                "path": record.path, "call": record.call, "dynamic": record.dynamic, "states": record.states,
                "stubs": {k: str(v) for k, v in record.stubs.items()},
                "guard": {"dims": record.guard.dims, "code": record.guard.code}, "left_out": left_out,
                "reuse": record.reuse, "untouched": _untouched_json(record.untouched), "watched": record.watched,
                "grad_reads": record.grad_reads,
            })
        if inputs is not None:
            buffer = io.BytesIO()
            torch.save(inputs, buffer)
            archive.writestr(INPUTS_NAME, buffer.getvalue())
        full = {**header, "format": FORMAT_VERSION, "versions": library_versions(), "records": entries}
        archive.writestr(HEADER_NAME, json.dumps(full, indent=1))


def _save_without_weights(exported: torch.export.ExportedProgram, stream: IO[bytes]) -> list[list[str]]:
    """``torch.export.save`` with the program's parameters and buffers swapped for meta tensors
    for the duration (restored after, also on error). Returns ``[[section, name], ...]`` of what was
    left out (``state_dict`` or ``constants``: non-persistent buffers); lifted constants created by
    the module's code are kept."""
    signature = exported.graph_signature
    names = set(signature.inputs_to_parameters.values()) | set(signature.inputs_to_buffers.values())
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    left_out: list[list[str]] = []
    try:
        for section, store in (("state_dict", exported.state_dict), ("constants", exported.constants)):
            for name in [n for n in store if n in names]:
                left_out.append([section, name])
                if section == "constants":
                    # non-persistent buffers (computed: rotary ``inv_freq``, masks): torch.export.load
                    # (2.13) cannot read a meta constant, so their values are written, and still
                    # replaced by the module's own tensors on reading
                    continue
                value = store[name]
                meta = torch.empty_like(value, device="meta")
                if isinstance(value, torch.nn.Parameter):
                    meta = torch.nn.Parameter(meta, requires_grad=value.requires_grad)
                swapped.append((store, name, value))
                store[name] = meta
        try:
            save_program(exported, stream)
        except Exception as error:  # noqa: BLE001 - reported with the cause
            raise UnserialisableProgram(f"torch.export.save could not serialise an exported program: {error}") \
                from error
    finally:
        for store, name, value in swapped:
            store[name] = value
    return left_out


@dataclass
class Bundle:
    """A bundle read by :func:`read_bundle`: the header and the raw members."""

    source: str
    header: dict[str, Any]
    programs: list[bytes]
    inputs: list[Any] | None

    def record(self, index: int, module: torch.nn.Module) -> ProgramRecord:
        """Program record ``index`` with ``module``'s own parameters and buffers in its program.

        Args:
            module: the module the record's program was exported from (the root, or the child
                at the record's path).

        Raises:
            SaveLoadError: the program cannot be read, or a parameter or buffer it needs is
                missing from ``module`` or has another shape or dtype.
        """
        entry = self.header["records"][index]
        try:
            exported = load_program(io.BytesIO(self.programs[index]))
        except Exception as error:  # noqa: BLE001 - reported with the cause
            raise SaveLoadError(f"{self.source}: program {index} cannot be read by torch.export.load: {error}."
                                " Delete the file and extract again.") from error
        for name, value in exported.constants.items():
            # torch.export.load gives empty constants one shared storage; unflatten, which tells
            # constants apart by storage, would then merge them (``lifted_tensor_0_1``), unlike
            # the program as exported: each gets its own (the module's buffers are put back below)
            if isinstance(value, torch.Tensor):
                exported.constants[name] = value.clone()
        for section, name in entry["left_out"]:
            store = exported.state_dict if section == "state_dict" else exported.constants
            store[name] = _own_tensor(self.source, module, name, meta=store[name])
        dims = [[d if isinstance(d, int) else tuple(d) for d in tensor] for tensor in entry["guard"]["dims"]]
        return ProgramRecord(path=entry["path"], call=entry["call"], exported=exported, dynamic=entry["dynamic"],
                             states=entry["states"], stubs=dict(entry["stubs"]),
                             guard=ShapeGuard(dims, entry["guard"]["code"]), reuse=dict(entry.get("reuse", {})),
                             untouched=_untouched_from_json(entry.get("untouched", {})),
                             watched=entry.get("watched"), grad_reads=entry.get("grad_reads"))


def _untouched_json(untouched: dict[str, list[UntouchedLayers | None]]) -> dict[str, list[Any]]:
    """:attr:`ProgramRecord.untouched` as JSON: a path's item steps ``(3,)`` become lists ``[3]``."""
    def path(p: StatePath) -> list[Any]:
        return [list(step) if isinstance(step, tuple) else step for step in p]
    return {fqn: [None if u is None else {"paths": sorted(map(path, u.paths), key=repr),
                                          "by_index": sorted(map(path, u.by_index), key=repr)} for u in per]
            for fqn, per in untouched.items()}


def _untouched_from_json(value: dict[str, list[Any]]) -> dict[str, list[UntouchedLayers | None]]:
    """The inverse of :func:`_untouched_json` (an entry that does not record it: ``{}``)."""
    def path(p: list[Any]) -> StatePath:
        return cast(StatePath, tuple(tuple(step) if isinstance(step, list) else step for step in p))
    return {fqn: [None if u is None else UntouchedLayers(frozenset(map(path, u["paths"])),
                                                        frozenset(map(path, u["by_index"]))) for u in per]
            for fqn, per in value.items()}


def _own_tensor(source: str, module: torch.nn.Module, name: str, *, meta: torch.Tensor) -> torch.Tensor:
    """``module``'s tensor for the program's name ``model.<path>`` (the export root wraps the
    module as ``model``), checked against the saved meta tensor's shape and dtype."""
    value: object = module
    for part in name.removeprefix("model.").split("."):
        value = getattr(value, part, None)
    if not isinstance(value, torch.Tensor):
        raise SaveLoadError(f"{source}: the model has no parameter or buffer '{name.removeprefix('model.')}' that the"
                            " saved graphs use; load with the model the file was saved from.")
    if value.shape != meta.shape or value.dtype != meta.dtype:
        raise SaveLoadError(
            f"{source}: '{name.removeprefix('model.')}' is {tuple(value.shape)} {value.dtype} in the model but was"
            f" {tuple(meta.shape)} {meta.dtype} when saved; load with the model the file was saved from.")
    return value


def read_bundle(source: str | os.PathLike[str] | IO[bytes], *, name: str | None = None) -> Bundle:
    """Read a bundle written by :func:`write_bundle` (checksums verified); ``name`` is the file
    messages name (default: the path, or the file object's ``name``).

    Raises:
        SaveLoadError: the file is missing, not a bundle, corrupt or partial (names the file),
            or of another format version.
        FileNotFoundError: ``source`` is a path that does not exist.
    """
    if name is None:
        name = str(source) if isinstance(source, (str, os.PathLike)) else getattr(source, "name", "<file object>")
    try:
        with zipfile.ZipFile(source) as archive:
            header = json.loads(archive.read(HEADER_NAME))
            if header.get("format") not in READABLE_FORMATS:
                raise SaveLoadError(f"{name} was written in nnbridge format {header.get('format')!r}; this nnbridge"
                                    f" reads formats {', '.join(map(str, READABLE_FORMATS))}. Extract the model"
                                    " again and save it anew.")
            programs = [archive.read(_program_name(i)) for i in range(len(header["records"]))]
            inputs = None
            if INPUTS_NAME in archive.namelist():
                inputs = torch.load(io.BytesIO(archive.read(INPUTS_NAME)), weights_only=True)
    except FileNotFoundError:
        raise
    except SaveLoadError:
        raise
    except Exception as error:  # noqa: BLE001 - zip, JSON or checksum errors: one message
        raise SaveLoadError(f"{name} is not a readable nnbridge file (corrupt or partial: {type(error).__name__}:"
                            f" {error}). Delete it and save or extract again.") from error
    return Bundle(name, header, programs, inputs)
