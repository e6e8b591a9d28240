"""The ``nnbridge`` command answers ``--help`` and argument errors at once: neither the console
script's entry point nor ``python -m nnbridge`` imports torch, transformers or nnsight for them
(issue 51, "a new user's first hour"). ``import nnbridge`` is light too; its public names load the
rest on first use."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "nnsight")

#: argv, exit status: help of the command and of each subcommand, then argparse's errors
CASES = [
    (["--help"], 0), (["tree", "--help"], 0), (["demo", "--help"], 0), (["cache", "--help"], 0),
    (["doctor", "--help"], 0), ([], 2), (["frobnicate"], 2), (["tree"], 2), (["tree", "x", "--depth", "0"], 2),
    (["tree", "x", "--depth", "a"], 2), (["cache", "wipe"], 2),
]

# Runs the console script's entry point as the installed script does (``sys.exit(main())``), then
# reports the exit status and which heavy libraries were imported.
_RUNNER = """
import importlib, json, sys
module, _, function = sys.argv[1].partition(":")
sys.argv = ["nnbridge", *json.loads(sys.argv[2])]
try:
    code = getattr(importlib.import_module(module), function)()
except SystemExit as exited:
    code = exited.code
heavy = sorted(name for name in sys.modules if name.split(".")[0] in {heavy!r})
print(json.dumps({{"code": code, "heavy": heavy}}))
"""


def _entry_point() -> str:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"nnbridge"}
    return scripts["nnbridge"]


@pytest.mark.integration  # end to end: second processes
@pytest.mark.parametrize("argv, code", CASES, ids=lambda value: " ".join(value) if isinstance(value, list) else None)
def test_console_script_help_and_errors_import_no_heavy_library(argv, code):
    done = subprocess.run([sys.executable, "-c", _RUNNER.format(heavy=set(HEAVY)), _entry_point(), json.dumps(argv)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["code"] == code, done.stderr
    assert report["heavy"] == [], f"nnbridge {' '.join(argv)} imported {report['heavy'][:5]}"
    if code == 2:
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("nnbridge: error:"), done.stderr


def _imported(arguments: list[str]) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``python -X importtime <arguments>``: the process, and every module it imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", *arguments], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    modules = {line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return done, modules


@pytest.mark.integration  # end to end: second processes
@pytest.mark.parametrize("argv", [["--help"], ["tree", "--help"], ["frobnicate"]])
def test_python_dash_m_help_imports_no_heavy_library(argv):
    """``python -m nnbridge`` runs ``nnbridge/__init__`` before ``__main__``: it must stay light."""
    done, modules = _imported(["-m", "nnbridge", *argv])
    assert done.returncode == (2 if argv == ["frobnicate"] else 0), done.stderr[-2000:]
    assert "nnbridge.cli" in modules and "argparse" in modules, "importtime saw the run"
    assert not {name.split(".")[0] for name in modules} & set(HEAVY)
    if argv == ["--help"]:
        assert "{demo,tree,cache,doctor}" in done.stdout


@pytest.mark.integration  # end to end: a second process
def test_import_nnbridge_is_light_and_its_names_load_on_use():
    """The package root imports nothing heavy; a public name loads the API (version check and
    nnsight routing included), and ``from nnbridge import *`` gives every name of ``__all__``."""
    script = (
        "import sys, nnbridge\n"
        f"assert not [m for m in sys.modules if m.split('.')[0] in {set(HEAVY)!r}], 'import nnbridge is light'\n"
        "from nnbridge.graph.op_point import OpPoint\n"
        "assert OpPoint.wanted(None) is False, 'routing is installed only when the API loads'\n"
        "pg = nnbridge.PatchableGraph\n"
        "assert 'torch' in sys.modules and OpPoint.wanted.__name__ == 'trace_wants', OpPoint.wanted\n"
        "namespace = {}\n"
        "exec('from nnbridge import *', namespace)\n"
        "assert sorted(n for n in namespace if n != '__builtins__') == sorted(nnbridge.__all__)\n"
        "assert set(nnbridge.__all__) <= set(dir(nnbridge))\n"
        "try:\n    nnbridge.no_such_name\nexcept AttributeError as error:\n    print(error)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "module 'nnbridge' has no attribute 'no_such_name'"
