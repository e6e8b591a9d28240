"""The disk extraction cache: a second process that extracts the same model skips ``torch.export``.

On when the environment variable ``NNBRIDGE_CACHE`` names a directory (the one
:mod:`nnbridge.models` caches dequantized weights in); entries go to its ``extractions/``
subdirectory (created if needed). Off when ``NNBRIDGE_CACHE`` is unset or empty, so nothing is
written unless asked (extraction then consults the process's :mod:`.memory_cache`, same key),
or when ``NNBRIDGE_EXTRACTION_CACHE=0`` (the test suite sets it, so a developer's cache cannot
change what tests see). Each ``torch.export`` result (one per extracted
module and call, see :mod:`.programs`) is one :mod:`.storage` bundle, ``<key>.nnbridge``, where
``key`` is a sha256 of:

- the bundle format version, the recording version (:data:`RECORDING_VERSION`) and the torch,
  transformers and nnbridge versions;
- the module's class, the hash of its transformers config (if any), the hash of its module tree
  (classes, train flags, plain attribute values, parameter and buffer names, shapes, dtypes) and
  the hash of the source files of every module class in it and the digest of the code its modules
  reach, which sees methods and helpers replaced at run time (:func:`~.programs.model_fingerprint`,
  :func:`~.code_identity.code_digest`);
- the call (:meth:`~.programs.ExportRequest.call_fingerprint`: argument structure, non-tensor
  values, tensor dtypes and sizes, grad mode, train/eval flags, autocast, export-relevant options).

So a changed model source (or a method or helper function replaced at run time), library version,
config (every value, the attention implementation included) or call misses; a model with a module
class whose source file cannot be read (defined in a notebook cell or by ``exec``) is never served
or stored. Entries hold no weights (the
given module's tensors are put back) and no pickled code. Writes are atomic (temporary file, then
rename). A corrupt or partial entry is deleted with an :class:`~nnbridge.errors.NNBridgeWarning`
and the module is exported again; a failed write warns and extraction goes on, except for a
program ``torch.export.save`` cannot serialise (a ``PackedSequence`` argument), which is logged
(``logging.INFO``) and left out. ``nnbridge cache
info`` / ``nnbridge cache clear`` show and empty the directory.

Example::

    NNBRIDGE_CACHE=~/.cache/nnbridge python script.py     # the second run skips torch.export
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TypedDict

from ..compat.serialization import library_versions
from ..errors import SaveLoadError, warn
from .programs import ExportRequest, ProgramRecord, model_fingerprint, source_known
from .storage import FORMAT_VERSION, UnserialisableProgram, read_bundle, write_bundle

#: Environment variable naming nnbridge's cache directory (cache off when unset or empty).
ENVIRONMENT_VARIABLE = "NNBRIDGE_CACHE"
#: Environment variable that turns the extraction cache off when ``"0"``.
SWITCH_VARIABLE = "NNBRIDGE_EXTRACTION_CACHE"
#: ``header["kind"]`` of a cache entry.
KIND = "cache_entry"
SUFFIX = ".nnbridge"

logger = logging.getLogger(__name__)


def cache_directory() -> Path | None:
    """``$NNBRIDGE_CACHE/extractions`` (``~`` expanded), or None when the cache is off."""
    value = os.environ.get(ENVIRONMENT_VARIABLE, "")
    if not value or os.environ.get(SWITCH_VARIABLE, "1") == "0":
        return None
    return Path(value).expanduser() / "extractions"


def default_cache() -> DiskCache | None:
    """The cache in :func:`cache_directory`, or None when it is off."""
    directory = cache_directory()
    return DiskCache(directory) if directory is not None else None


#: What export records into an entry beyond the bundle format (2: helper functions' lines in each
#: node's stack trace, which variable-name aliases read); entries recorded otherwise miss.
RECORDING_VERSION = 2


def request_key(request: ExportRequest) -> str:
    """The cache key of ``request`` (hex sha256 of the format, recording and library versions, the
    model's fingerprint and the call's; see the module docstring), computed once per request."""
    if request.cache_key is None:
        text = json.dumps({"format": FORMAT_VERSION, "recording": RECORDING_VERSION,
                           "versions": library_versions(),
                           "model": model_fingerprint(request.module), "call": request.call_fingerprint()},
                          sort_keys=True)
        request.cache_key = hashlib.sha256(text.encode()).hexdigest()
    return request.cache_key


class CacheInfo(TypedDict):
    """What :meth:`DiskCache.info` reports."""

    directory: str
    entries: int
    #: total size of the entry files
    bytes: int


class DiskCache:
    """Program records on disk, one bundle per key (see module docstring); a program source.

    Args:
        directory: where entries live (created on the first write).
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def key(self, request: ExportRequest) -> str:
        """The entry key of ``request`` (see :func:`request_key`)."""
        return request_key(request)

    def entry(self, request: ExportRequest) -> Path:
        """The file of ``request``'s entry."""
        return self.directory / f"{self.key(request)}{SUFFIX}"

    def lookup(self, request: ExportRequest) -> ProgramRecord | None:
        """The cached record, with ``request.module``'s tensors; None on a miss. A corrupt,
        partial or mismatching entry is deleted with a warning (a miss)."""
        if not source_known(request.module):  # no code to key it by: never served
            return None
        path = self.entry(request)
        if not path.is_file():
            return None
        try:
            bundle = read_bundle(path)
            if bundle.header.get("kind") != KIND or bundle.header.get("key") != self.key(request):
                raise SaveLoadError(f"{path} is not the cache entry of its key")
            record = bundle.record(0, request.module)
        except (SaveLoadError, OSError) as error:
            warn(f"nnbridge disk cache: entry {path.name} is unusable and was deleted; extracting again ({error})")
            try:
                path.unlink()
            except OSError:
                pass
            return None
        return dataclasses.replace(record, path=request.path)

    def store(self, request: ExportRequest, record: ProgramRecord) -> None:
        """Write ``record`` as ``request``'s entry (atomically) unless it exists; a failed write warns."""
        if not source_known(request.module):  # see lookup
            return
        path = self.entry(request)
        if path.is_file():
            return
        header = {"kind": KIND, "key": self.key(request), "module": type(request.module).__qualname__}
        try:
            write_bundle(path, header, [record])
        except UnserialisableProgram as error:  # this call's programs are not cached: each process exports them
            logger.info("nnbridge disk cache: %s is not stored: %s", path.name, error)
        except Exception as error:  # noqa: BLE001 - the cache must never break extraction
            warn(f"nnbridge disk cache: could not write {path}: {type(error).__name__}: {error}")

    def entries(self) -> list[Path]:
        """Entry files, sorted by name (temporary files of interrupted writes excluded)."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if p.suffix == SUFFIX and not p.name.startswith("."))

    def info(self) -> CacheInfo:
        """``{"directory", "entries", "bytes"}`` of the cache."""
        entries = self.entries()
        return {"directory": str(self.directory), "entries": len(entries),
                "bytes": sum(p.stat().st_size for p in entries)}

    def clear(self) -> int:
        """Delete every entry and leftover temporary file; returns the number of entries deleted."""
        removed = 0
        if not self.directory.is_dir():
            return 0
        for path in self.directory.iterdir():
            if path.suffix == SUFFIX and not path.name.startswith("."):
                path.unlink()
                removed += 1
            elif path.name.startswith(".") and path.suffix == ".tmp":
                path.unlink()
        return removed
