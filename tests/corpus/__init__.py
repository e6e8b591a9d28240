"""The differential corpus of issue 9 ("Faithful or loud"): small modules, each run eagerly and
through ``nnbridge.bridge``, ``PatchableGraph`` and ``nnbridge.NNsight`` by ``tests/corpus/test_corpus.py``.

An :class:`Entry` declares a seeded module factory and a script of :class:`Call` and :class:`Edit`
steps. The harness builds the module, deep-copies it before any nnbridge call (the eager
reference), runs the same script on both sides from the same random seed and compares outputs,
gradients, parameters, buffers, the CPU RNG state and the Python-visible attributes the entry names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

MODES = ("train", "eval")


@dataclass
class Call:
    """One call of the module.

    Attributes:
        args: positional inputs (built once, shared by both sides; never mutated by the corpus).
        kwargs: keyword inputs.
        grad: run with gradients enabled (``False``: under ``torch.no_grad()``).
        context: a factory of an extra context manager around the call (e.g. autocast).
    """

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    grad: bool = True
    context: Callable[[], contextlib.AbstractContextManager] | None = None


@dataclass
class Edit:
    """A change made to the module after bridging, applied identically to the eager reference.

    ``fn(module)`` runs under its own fixed seed (``torch.random.fork_rng``), so new submodules
    are initialised alike on both sides and the global RNG stream is untouched.
    """

    fn: Callable[[torch.nn.Module], None]


@dataclass
class Entry:
    """One corpus module.

    Attributes:
        name: the id in ``corpus[<name>-<front-end>-<mode>]``.
        make: builds the module (called under ``torch.manual_seed(0)``).
        script: builds the steps (called under ``torch.manual_seed(0)`` after ``make``); the
            first :class:`Call` is the example given to ``bridge``/``PatchableGraph``.
        item: the issue-9 item number it covers (0: an ordinary case).
        modes: the modes it runs in.
        attrs: ``fn(module)`` -> Python-visible state compared after the script (counters...).
        backward_hooks: the harness's hooks include full backward hooks (False where eager itself
            refuses them: an in-place op on a module's output).
    """

    name: str
    make: Callable[[], torch.nn.Module]
    script: Callable[[], list[Call | Edit]]
    item: int = 0
    modes: tuple[str, ...] = MODES
    attrs: Callable[[torch.nn.Module], Any] | None = None
    backward_hooks: bool = True


def calls(*steps: Any) -> Callable[[], list[Call | Edit]]:
    """Script helper: each step is a :class:`Call`/:class:`Edit`, a tuple of positional inputs or a
    callable returning either (called lazily, under the corpus seed)."""

    def build() -> list[Call | Edit]:
        out: list[Call | Edit] = []
        for step in steps:
            if callable(step) and not isinstance(step, (Call, Edit)):
                step = step()
            if isinstance(step, tuple):
                step = Call(step)
            out.append(step)
        return out

    return build


def all_entries() -> list[Entry]:
    """Every corpus entry, in a stable order."""
    from . import (edits, found, grad_mode, graphpatch_fixtures, ordinary, parametrized, recurrent, registry_walks,
                   shapes_dtypes, side_effects, state)

    entries: list[Entry] = []
    for module in (ordinary, recurrent, grad_mode, edits, state, shapes_dtypes, side_effects, parametrized,
                   registry_walks, graphpatch_fixtures):
        entries.extend(module.ENTRIES)
    entries.extend(found.entries())  # programs the generated corpus found (tests/corpus/test_fuzz.py)
    names = [e.name for e in entries]
    assert len(names) == len(set(names)), "duplicate corpus entry names"
    return entries
