"""Source files read while extracting, dropped from ``linecache`` again when extraction ends.

Extraction reads source lines of the model's, transformers' and torch's files: each exported node's
``stack_trace`` is formatted from them, and the code digest reads the source of the code a module
reaches. Python's ``linecache`` keeps every file it read, whole, for the life of the process (about
3 MB after one ``bridge()`` of SmolLM2-135M), so that memory stayed after ``unbridge()``.
:func:`source_lines_released` removes, when the outermost extraction ends, the entries of files
that were not in ``linecache`` when it began; a later traceback reads them again. Entries that were
there before, and entries without a file behind them (generated code registered with a loader,
such as fx's), are left as they are. Example::

    with source_lines_released():
        ...  # export, build graphs
"""

from __future__ import annotations

import contextlib
import linecache
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_depth = 0
_before: set[str] = set()


def _read_from_file(entry: object) -> bool:
    """Whether a ``linecache.cache`` entry holds a file's lines read from disk: ``(size, mtime,
    lines, fullname)`` with a modification time (entries made from a loader's source have none;
    a lazy entry is a 1-tuple)."""
    return isinstance(entry, tuple) and len(entry) == 4 and entry[1] is not None


@contextlib.contextmanager
def source_lines_released() -> Iterator[None]:
    """Within: files ``linecache`` reads are kept as usual; when the outermost of nested (or
    concurrent) uses ends, the entries of files read since it began are removed (see the module
    docstring). Thread-safe and re-entrant."""
    global _depth
    with _LOCK:
        if _depth == 0:
            _before.clear()
            _before.update(linecache.cache)
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0:
                for name in [name for name in list(linecache.cache) if name not in _before]:
                    if _read_from_file(linecache.cache.get(name)):
                        linecache.cache.pop(name, None)
                _before.clear()
