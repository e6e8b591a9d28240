"""graphpatch's test-fixture structures (our own modules in ``tests/fixtures``: nested modules called
with keywords, tuple and nested outputs, containers, buffers, layer norm, unused submodules,
varargs, data-dependent control flow, protected names) as corpus entries, so that each runs through
every front-end and mode like the rest of the corpus. Each is called twice with its example inputs
and once with the inputs repeated (one tensor in every tensor argument: the aliasing a layer
reuse or a cached graph must not assume away)."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from fixtures import FIXTURES

from . import Call, Entry


def _fixture(name: str) -> Any:
    file, cls = name.split(".")
    return importlib.import_module(f"fixtures.{file}"), cls


def _entry(name: str) -> Entry:
    module, cls = _fixture(name)

    def make() -> torch.nn.Module:
        return getattr(module, cls)()

    def script() -> list[Any]:
        args, kwargs = module.inputs()
        steps: list[Any] = [Call(args, kwargs), Call(args, kwargs)]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if len(tensors) > 1 and all(t.shape == tensors[0].shape and t.dtype == tensors[0].dtype for t in tensors):
            one = tensors[0]
            steps.append(Call(tuple(one if isinstance(a, torch.Tensor) else a for a in args), kwargs))
        return steps

    return Entry(f"graphpatch_{name.split('.')[0]}", make, script)


ENTRIES = [_entry(name) for name in FIXTURES]
