"""The disk extraction cache: a second process that extracts the same model skips ``torch.export``.

On by default, in the ``extractions/`` subdirectory of ``$NNBRIDGE_CACHE`` (default
``~/.cache/nnbridge``, where :mod:`nnbridge.models` also caches dequantized weights), created if
needed. ``NNBRIDGE_EXTRACTION_CACHE=0`` turns it off (and the process's :mod:`.memory_cache`);
``NNBRIDGE_EXTRACTION_CACHE=memory`` keeps only the memory cache (the test suite points
``NNBRIDGE_CACHE`` at a directory of its own, so a developer's cache cannot change what tests see).
The directory is bounded: after each write, the least recently used entries (by modification
time; a hit touches its entry) are deleted until the entries take at most
``$NNBRIDGE_CACHE_LIMIT`` bytes (default 2 GB; ``500M``, ``2G`` accepted). Each ``torch.export`` result (one per extracted
module and call, see :mod:`.programs`) is one :mod:`.storage` bundle, ``<key>.nnbridge``, where
``key`` is a sha256 of:

- the bundle format version, the recording version (:data:`RECORDING_VERSION`), the torch,
  transformers and nnbridge versions, and a digest of nnbridge's own source files
  (:func:`source_digest`: an entry that another nnbridge code exported, even under the same
  version number, misses);
- the module's class, the hash of its transformers config (if any), the hash of its module tree
  (classes, train flags, plain attribute values, parameter and buffer names, shapes, dtypes) and
  the hash of the source files of every module class in it and the digest of the code its modules
  reach, which sees methods and helpers replaced at run time (:func:`~.programs.model_fingerprint`,
  :func:`~nnbridge.guards.code_digest.code_digest`);
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

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TypedDict

from ..compat.torch.functorch import transforming, transforms_suspended
from ..compat.torch.serialization import library_versions
from ..errors import NNBridgeError, SaveLoadError, warn
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


#: Environment variable bounding the cache's size in bytes (suffixes K, M, G: powers of 1000).
LIMIT_VARIABLE = "NNBRIDGE_CACHE_LIMIT"
#: The default bound of the cache's size, in bytes.
DEFAULT_LIMIT = 2_000_000_000
_UNITS = {"": 1, "K": 1000, "M": 1000 ** 2, "G": 1000 ** 3}


def cache_root() -> Path:
    """``$NNBRIDGE_CACHE`` (``~`` expanded), or ``~/.cache/nnbridge`` when it is unset or empty."""
    value = os.environ.get(ENVIRONMENT_VARIABLE, "")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "nnbridge"


def cache_directory() -> Path | None:
    """``<cache_root()>/extractions``, or None when ``NNBRIDGE_EXTRACTION_CACHE`` is ``0`` or ``memory``."""
    if os.environ.get(SWITCH_VARIABLE, "1") in ("0", "memory"):
        return None
    return cache_root() / "extractions"


def size_limit() -> int:
    """``$NNBRIDGE_CACHE_LIMIT`` in bytes, or :data:`DEFAULT_LIMIT`.

    Raises:
        NNBridgeError: the variable is not a number of bytes with an optional K, M or G suffix.
    """
    value = os.environ.get(LIMIT_VARIABLE, "").strip().upper().removesuffix("B")
    if not value:
        return DEFAULT_LIMIT
    number, unit = (value[:-1], value[-1]) if value[-1] in _UNITS else (value, "")
    try:
        return int(float(number) * _UNITS[unit])
    except ValueError:
        raise NNBridgeError(f"{LIMIT_VARIABLE}={os.environ[LIMIT_VARIABLE]!r} is not a size: give bytes, or a number"
                            " with K, M or G (for example 500M or 2G)") from None


def default_cache() -> DiskCache | None:
    """The cache in :func:`cache_directory`, or None when it is off."""
    directory = cache_directory()
    return DiskCache(directory) if directory is not None else None


#: What export records into an entry beyond the bundle format (2: helper functions' lines in each
#: node's stack trace, which variable-name aliases read); entries recorded otherwise miss.
RECORDING_VERSION = 2


def source_digest() -> str:
    """Hex sha256 of every ``.py`` file of the installed nnbridge package (relative paths and
    contents, in path order), computed once per process."""
    if not _SOURCE_DIGEST:
        root = Path(__file__).resolve().parents[1]
        digest = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
        _SOURCE_DIGEST.append(digest.hexdigest())
    return _SOURCE_DIGEST[0]


#: the digest :func:`source_digest` computed (empty before its first call)
_SOURCE_DIGEST: list[str] = []


def request_key(request: ExportRequest) -> str:
    """The cache key of ``request`` (hex sha256 of the format, recording and library versions, the
    model's fingerprint and the call's; see the module docstring), computed once per request."""
    if request.cache_key is None:
        text = json.dumps({"format": FORMAT_VERSION, "recording": RECORDING_VERSION,
                           "versions": library_versions(), "source": source_digest(),
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
    #: the bound of that size (:func:`size_limit`)
    limit: int


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
            # (outside any torch.func transform: torch.export.load sets requires_grad on the
            # program's tensors, which functorch refuses inside a transform)
            with transforms_suspended() if transforming() else contextlib.nullcontext():
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
        try:
            os.utime(path)  # recently used: the last to be evicted
        except OSError:
            pass
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
            return
        self.evict(keep=path)

    def evict(self, keep: Path | None = None) -> int:
        """Delete the least recently used entries (oldest modification time first; never ``keep``)
        until the entries take at most :func:`size_limit` bytes; returns how many were deleted. An
        entry another process deleted meanwhile is passed over."""
        limit, sized = size_limit(), []
        for path in self.entries():
            try:
                stat = path.stat()
            except OSError:
                continue
            sized.append((stat.st_mtime, path, stat.st_size))
        total, removed = sum(size for _, _, size in sized), 0
        for _, path, size in sorted(sized, key=lambda item: (item[0], item[1].name)):
            if total <= limit:
                break
            if path == keep:
                continue
            try:
                path.unlink()
            except OSError:
                continue
            total -= size
            removed += 1
        return removed

    def entries(self) -> list[Path]:
        """Entry files, sorted by name (temporary files of interrupted writes excluded)."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if p.suffix == SUFFIX and not p.name.startswith("."))

    def info(self) -> CacheInfo:
        """``{"directory", "entries", "bytes"}`` of the cache."""
        entries = self.entries()
        return {"directory": str(self.directory), "entries": len(entries),
                "bytes": sum(p.stat().st_size for p in entries), "limit": size_limit()}

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
