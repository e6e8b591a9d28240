"""Extractions shared between model instances of one process: a second instance of the same model
(same class, config, module tree, source files and code, called the same way: the disk cache's
key, :func:`~.disk_cache.request_key`) skips ``torch.export`` while the first is alive.

Extraction consults it when the disk cache is off (``NNBRIDGE_EXTRACTION_CACHE=memory``); like the
disk cache it is off with ``NNBRIDGE_EXTRACTION_CACHE=0``. Nothing is copied or serialised until a second
instance asks: the cache keeps, per key, a weak reference to the program record of each
extraction made or loaded (the record is owned by the extraction's root graph module,
``root.__dict__[PROGRAM_RECORD]``), so an entry goes with its graphs, when the model is garbage
collected or the extraction evicted: the cache never keeps a model or its weights alive. A hit writes the record into an in-memory bundle
(the disk cache's format, without weights, :mod:`.storage`) and reads it back bound to the asking
module's own parameters and buffers, exactly as a disk cache hit. A record that cannot be serialised is passed
over (extraction exports).
Example::

    nnbridge.bridge(first, ids)       # exported
    nnbridge.bridge(second, ids)      # same model class, config and call: loaded from first's record
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import threading
import weakref
from typing import Any

from .disk_cache import KIND, SWITCH_VARIABLE, request_key
from .programs import ExportRequest, ProgramRecord, source_known
from .storage import read_bundle, write_bundle


class MemoryCache:
    """The process's cache (:func:`memory_cache`); a :class:`~.programs.ProgramSource`."""

    def __init__(self) -> None:
        self._live: dict[str, list[weakref.ref[ProgramRecord]]] = {}
        # reentrant: a weak reference's callback (:meth:`_drop`) may run in a garbage collection
        # that an allocation made while the lock is held triggers
        self._lock = threading.RLock()

    def __len__(self) -> int:
        """The number of records referred to (of extractions still alive)."""
        with self._lock:
            return sum(len(entries) for entries in self._live.values())

    def _drop(self, key: str, ref: weakref.ref[Any]) -> None:
        with self._lock:
            kept = [entry for entry in self._live.get(key, []) if entry is not ref]
            if kept:
                self._live[key] = kept
            else:
                self._live.pop(key, None)

    def store(self, request: ExportRequest, record: ProgramRecord) -> None:
        """Refer to ``record`` (weakly) under ``request``'s key."""
        if not source_known(request.module):  # as the disk cache: no code to key it by
            return
        key = request_key(request)
        with self._lock:
            entries = self._live.setdefault(key, [])
            if not any(ref() is record for ref in entries):
                entries.append(weakref.ref(record, functools.partial(self._drop, key)))

    def lookup(self, request: ExportRequest) -> ProgramRecord | None:
        """A live module's record for ``request``'s key, bound to ``request.module``; else None."""
        if not source_known(request.module):
            return None
        key = request_key(request)
        with self._lock:
            records = [ref() for ref in self._live.get(key, [])]
        for record in records:
            if record is None:
                continue
            buffer = io.BytesIO()
            try:
                write_bundle(buffer, {"kind": KIND, "key": key, "module": type(request.module).__qualname__}, [record])
                buffer.seek(0)
                found = read_bundle(buffer).record(0, request.module)
            except Exception:  # noqa: BLE001 - a program that cannot be serialised: export instead
                continue
            found = dataclasses.replace(found, path=request.path)
            self.store(request, found)  # kept while the asking module's graphs live, too
            return found
        return None


#: Where an extraction's root graph module keeps the program record it was built from.
PROGRAM_RECORD = "_nnbridge_program_record"
_CACHE = MemoryCache()


def memory_cache() -> MemoryCache | None:
    """The process's :class:`MemoryCache`, or None when ``NNBRIDGE_EXTRACTION_CACHE=0``."""
    return None if os.environ.get(SWITCH_VARIABLE, "1") == "0" else _CACHE
