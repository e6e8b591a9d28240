"""Programs found by the generated corpus (``tests/corpus/test_fuzz.py``), shrunk by hypothesis and kept
as corpus entries: each module here is a program rendered by ``tests/corpus/generated.py`` (its
classes, edits, script and an ``ENTRIES`` list of one entry), named for what it found."""

from __future__ import annotations

import importlib
import pkgutil

from .. import Entry


def entries() -> list[Entry]:
    """The entries of every module of this package, by module name."""
    found: list[Entry] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        found.extend(importlib.import_module(f"{__name__}.{info.name}").ENTRIES)
    return found
