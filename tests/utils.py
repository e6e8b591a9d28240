"""Helpers shared by the tests."""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from nnbridge import CompiledGraphModule

REPO = Path(__file__).resolve().parents[1]

FIXTURES = [
    "tuple_output_module.TupleOutputModule",
    "minimal_module.MinimalModule",
    "nested_module.NestedModule",
    "container_module.ContainerModule",
    "buffer_module.BufferModule",
    "attribute_module.AttributeModule",
    "unused_submodule.UnusedSubmoduleModule",
    "varargs_module.VarargsModule",
    "layer_norm_module.LayerNormModule",
    "data_dependent_module.DataDependentModule",
    "protected_names_module.ProtectedNamesModule",
]


def shared_dir() -> Path:
    """The project's ``shared/`` folder: ``$NNBRIDGE_SHARED``, else beside the checkout, else beside
    the checkout this one was cloned from (a clone made elsewhere, e.g. in a temp dir)."""
    candidates = [os.environ.get("NNBRIDGE_SHARED"), REPO.parent / "shared"]
    origin = subprocess.run(["git", "-C", str(REPO), "config", "remote.origin.url"], capture_output=True, text=True)
    if origin.returncode == 0 and origin.stdout.strip():
        candidates.append(Path(origin.stdout.strip()).parent / "shared")
    for candidate in candidates:
        if candidate and (Path(candidate) / "data" / "gpt2_tokenizer").is_dir():
            return Path(candidate)
    raise FileNotFoundError("shared/data/gpt2_tokenizer not found beside the checkout; set NNBRIDGE_SHARED")


def gpt2_tokenizer_dir() -> Path:
    """The real GPT-2 BPE tokenizer files (``shared/data/gpt2_tokenizer``)."""
    return shared_dir() / "data" / "gpt2_tokenizer"


def load_fixture(name: str) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    """A seeded instance of a fixture module (``file.Class``) and its example inputs."""
    file, cls = name.split(".")
    module = importlib.import_module(f"fixtures.{file}")
    torch.manual_seed(0)
    model = getattr(module, cls)().eval()
    args, kwargs = module.inputs()
    return model, args, kwargs


def leaves(value: Any) -> list[Any]:
    """Pytree leaves, looking into ModelOutput (a dict) too."""
    return pytree.tree_leaves(value.to_tuple() if hasattr(value, "to_tuple") else value)


def assert_same(actual: Any, expected: Any) -> None:
    """Exact equality of two (nested) outputs: same structure, ``torch.equal`` tensors."""
    got, want = leaves(actual), leaves(expected)
    assert len(got) == len(want), f"{len(got)} leaves vs {len(want)}"
    for a, b in zip(got, want):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and torch.equal(a, b), f"tensors differ: {a} vs {b}"
        else:
            assert a == b


def graph_modules(root: torch.nn.Module) -> list[CompiledGraphModule]:
    return [m for m in root.modules() if isinstance(m, CompiledGraphModule)]


@contextlib.contextmanager
def forward_spy(*modules: torch.nn.Module) -> Iterator[list[str]]:
    """Record every call of the given modules (and of every submodule of them)."""
    calls: list[str] = []
    handles = [sub.register_forward_pre_hook(lambda m, a: calls.append(type(m).__name__))
               for module in modules for sub in module.modules()]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
