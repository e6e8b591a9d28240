"""Serialising call structures and reading library versions for nnbridge's on-disk format.

``torch.utils._pytree.treespec_dumps`` / ``treespec_loads`` (torch 2.1 - 2.13) turn a pytree
``TreeSpec`` into JSON text and back; only specs of built-in containers (tuple, list, dict,
namedtuple) and of types registered with a serialized name round-trip.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from .pytree import pytree


def spec_to_json(spec: Any) -> str:
    """``spec`` as JSON text (raises ``TypeError``/``NotImplementedError`` for unserialisable nodes)."""
    return pytree.treespec_dumps(spec)


def spec_from_json(text: str) -> Any:
    """The ``TreeSpec`` that :func:`spec_to_json` wrote."""
    return pytree.treespec_loads(text)


def library_versions() -> dict[str, str]:
    """``{"torch": ..., "transformers": ..., "nnbridge": ...}``: the versions a saved graph depends on
    (``"absent"`` for a library that is not installed)."""
    import torch

    versions = {"torch": torch.__version__}
    for name in ("transformers", "nnbridge"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions
