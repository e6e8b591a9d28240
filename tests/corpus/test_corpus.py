"""Issue 9 "Faithful or loud": the differential corpus (``tests/corpus``) through every front-end.

For each entry, front-end (``bridge``, ``pg`` = PatchableGraph, ``nnsight`` = nnbridge.NNsight) and
mode (``train``/``eval``), the module is built from seed 0 and deep-copied before any nnbridge
call (the eager reference). Both sides then run the entry's script from seed 1 (for the front-end,
bridging is part of that run, so RNG drawn by extraction counts) and are compared on:

- every call's output (tree structure; tensors: dtype, shape, ``requires_grad``, ``torch.equal``);
- parameter gradients after ``backward()`` of the sum of each grad-mode call's float outputs,
  and gradients of inputs that require grad;
- every parameter and buffer (names and values) after the script;
- the CPU RNG state after the script;
- the Python-visible attributes the entry names;
- once more through ``bridge`` in the entry's first mode (``-hooks`` in the test id), with a forward
  pre-hook and a forward hook on every module that replace its floating-point inputs and output
  (shifted by 0.5 and 0.25), and a full backward pre-hook and backward hook that scale its output
  gradients by 1.5: what each saw, the module calls and backward steps in order with their
  arguments, outputs and gradients (``harness.HookLog``), besides all of the above;
- once more through ``nnsight`` in the entry's first mode (``-set-output``), its traces running the
  graphs and setting the output of the first module every call reaches to that output + 0.5
  (``envoy.output = envoy.output + 0.5``), against eager with a forward hook doing the same.

The rule accepts a loud outcome instead: an :class:`nnbridge.NNBridgeError` whose message names a
module of the model (its class name or its path). A silent difference fails.

``KNOWN`` lists the (entry, front-end, mode) cases that fail on the current code, with the issue-9
item and the symptom; they are ``xfail(strict=True)``, so a fix that makes one pass fails the
suite until its line is removed.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import pytest

from corpus import Entry, all_entries
from corpus.harness import FRONT_ENDS, check

# "entry-front_end-mode" glob -> reason. Keep each reason "issue 9 item N: <symptom>".
KNOWN: dict[str, str] = {}  # none now


# entries whose edits nnbridge's disk-cache key does not see (the test run's cache would serve the
# program of the unedited model): they run with the cache off
NO_EXTRACTION_CACHE = {"edit_config_flags"}


def _known(case_id: str) -> str | None:
    for pattern, reason in KNOWN.items():
        if fnmatch.fnmatchcase(case_id, pattern):
            return reason
    return None


def _params() -> list[Any]:
    params = []
    for entry in all_entries():
        # (front-end, variant), variants in the entry's first mode only: the bridge with editing
        # torch hooks on every module (without hooks, modules are called without
        # nn.Module.__call__), NNsight traces setting a module's output
        for front_end, variant in [*((f, "") for f in FRONT_ENDS), ("bridge", "hooks"), ("nnsight", "set-output")]:
            for mode in entry.modes[:1] if variant else entry.modes:
                case_id = f"{entry.name}-{front_end}{'-' + variant if variant else ''}-{mode}"
                reason = _known(case_id)
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                if entry.name in NO_EXTRACTION_CACHE:
                    marks.append(pytest.mark.no_extraction_cache)
                params.append(pytest.param(entry, front_end, mode, variant, id=case_id, marks=marks))
    return params


# -- the test -----------------------------------------------------------------------------------
@pytest.mark.parametrize("entry,front_end,mode,variant", _params())
def test_corpus(entry: Entry, front_end: str, mode: str, variant: str) -> None:
    hooks = variant == "hooks"
    problems = check(entry, front_end, mode, hooks=hooks, edit=0.5 if hooks else 0.0,
                     set_output=variant == "set-output", nnsight_graphs=variant == "set-output")
    assert not problems, f"{entry.name} through {front_end} in {mode} mode differs from eager:\n  " + "\n  ".join(
        problems)


def test_corpus_size() -> None:
    """Issue 9 asks for at least 40 modules and every listed item covered."""
    entries = all_entries()
    assert len(entries) >= 40
    assert {3, 4, 5, 6, 7, 8, 9, 11} <= {e.item for e in entries}
