"""Process memory around an extraction: the C heap's free memory back to the operating system
(glibc's ``malloc_trim``), and Python's cyclic garbage collector held off while it runs.

An extraction allocates and frees hundreds of megabytes of small objects (torch.export's nodes,
fake tensors, sympy expressions). glibc keeps freed heap memory in its free lists, so the process's
resident set stays at its peak after the objects are gone (hundreds of megabytes more after
``bridge()`` + ``unbridge()`` + ``gc.collect()`` than before them, with no graph left alive);
``malloc_trim(0)`` returns those pages to the operating system.

The same allocations start the cyclic garbage collector: torch.export makes millions of Python
objects (about 400,000 containers per SmolLM2 extraction), and every few hundred thousand
allocations the collector walks every object the process holds (torch and transformers alone are
~1e6), a long walk each time. :func:`collection_paused` holds it off for an extraction, as torch's
``distributed.checkpoint.state_dict`` does for its own bulk work; the objects that became cyclic
garbage meanwhile are collected by the first automatic collection after it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import sys
from collections.abc import Iterator


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)  # glibc only (not musl)


def release_free_heap() -> bool:
    """Return the C heap's free pages to the operating system (glibc ``malloc_trim(0)``); a no-op
    returning False where there is no glibc. Objects in use are untouched."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def release_garbage() -> bool:
    """Collect the process's cyclic garbage (a full ``gc.collect()``), then return the C heap's
    free pages to the operating system (:func:`release_free_heap`); returns what that returned.

    For :func:`nnbridge.unbridge`: a bridge's graphs (fx graphs and nodes, op points, generated
    code) are reference cycles, freed only by the cyclic collector: they are collected first,
    so that the trim returns their memory (trimming first leaves it in the heap, and the
    resident set grows with each bridge/unbridge cycle).
    """
    gc.collect()
    return release_free_heap()


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector is off for the block, and on again after it (also on
    error) if it was on before, so nesting, and a caller who turned it off, are kept. Reference
    counting still frees every object outside a cycle at once. The collector is process-wide:
    another thread's cyclic garbage also waits until the block ends.

    Used around export (``extraction.extract``) and around everything else an extraction does
    (``GraphDispatcher.add_extraction``: building, linking op points, generating code; a
    PatchableGraph's example recording): each full collection in between would walk every object
    of the process, the collections owed afterwards included.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
