"""The package's layout: layers import downwards only, every module imports on its own, and no two
modules import each other.

The checks read the source (``ast``), so an import placed inside a function, which would hide a
cycle from a plain import, is counted like any other. The layer rule counts imports under
``if TYPE_CHECKING:`` too (a lower layer names what it needs with a small ``Protocol``); the
cycle check does not, since those never run.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "nnbridge"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _type_checking_only(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return ids


#: nnbridge's layers, lowest first (each subpackage's docstring says what it owns): a module imports
#: only modules of its own layer or of lower ones. The front modules (``nnbridge/__init__``, the
#: CLI, the demo, the model loaders) sit above every layer.
LAYERS = ("errors", "compat", "graph", "guards", "extract", "store", "dispatch", "inplace", "patching", "surgery",
          "envoys")


def layer_of(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))


def import_graph(annotations: bool = False) -> dict[str, set[str]]:
    """``{module: modules it imports}`` within nnbridge; ancestors' ``__init__`` (run by any import
    of a submodule) are not edges. With ``annotations``, imports under ``if TYPE_CHECKING:`` count."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = set() if annotations else _type_checking_only(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                if target in modules and target != name and not name.startswith(target + "."):
                    deps.add(target)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_cycle_check_finds_a_hidden_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_function_local_imports_count(tmp_path, monkeypatch):
    package = tmp_path / "nnbridge"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "one.py").write_text("from . import two\n")
    (package / "two.py").write_text("def f():\n    from .one import x\n")
    (package / "three.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import one\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    graph = import_graph()
    assert cycles(graph) == [["nnbridge.one", "nnbridge.two"]]
    assert graph["nnbridge.three"] == set()


def test_imports_go_down_the_layers():
    assert layer_violations(import_graph(annotations=True)) == []


def test_layer_rule_finds_a_planted_violation(tmp_path, monkeypatch):
    """An upward import is found wherever it hides: in a function, or under ``TYPE_CHECKING``."""
    package = tmp_path / "nnbridge"
    for layer in ("graph", "patching", "compat"):
        (package / layer).mkdir(parents=True)
        (package / layer / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "patching" / "patches.py").write_text("from ..graph import ir\n")
    (package / "graph" / "ir.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                             "    from ..patching.patches import Patch\n")
    (package / "compat" / "shim.py").write_text("def f():\n    from ..graph import ir\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert layer_violations(import_graph(annotations=True)) == [
        "nnbridge.compat.shim -> nnbridge.graph.ir", "nnbridge.graph.ir -> nnbridge.patching.patches"]
    assert layer_violations(import_graph()) == ["nnbridge.compat.shim -> nnbridge.graph.ir"]


def test_every_layer_is_a_documented_subpackage():
    """Each layer folder's docstring says what it owns."""
    import importlib

    for layer in LAYERS[1:]:
        module = importlib.import_module(f"nnbridge.{layer}")
        assert module.__file__ is not None and module.__file__.endswith("__init__.py"), layer
        assert len((module.__doc__ or "").split()) >= 20, f"nnbridge.{layer} has no package docstring"


@pytest.mark.integration  # end to end: a second process per module
def test_every_module_imports_alone():
    """Each module imported first in a clean interpreter state (torch stays loaded: only nnbridge's
    modules are dropped between imports), so none relies on another having been imported before.
    A module the public API loads (``import nnbridge``, then every name of ``nnbridge.__all__``,
    which the package root imports on first use) imports alone exactly when that succeeds: it is
    checked once, and every module it does not load is then imported alone."""
    names = sorted(n for n in _modules() if not n.endswith("__main__"))  # __main__ runs the CLI
    script = (
        "import importlib, sys, torch, transformers, nnsight\n"
        "def clean():\n"
        "    for loaded in [m for m in sys.modules if m == 'nnbridge' or m.startswith('nnbridge.')]:\n"
        "        del sys.modules[loaded]\n"
        "failed, alone = [], []\n"
        "try:\n    root = importlib.import_module('nnbridge')\n    [getattr(root, n) for n in root.__all__]\n"
        "except Exception as error:\n    failed.append(f'nnbridge: {type(error).__name__}: {error}')\n"
        "package = {m for m in sys.modules if m == 'nnbridge' or m.startswith('nnbridge.')}\n"
        f"for name in {names!r}:\n"
        "    if name in package:\n        continue\n"
        "    clean()\n    alone.append(name)\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except Exception as error:\n        failed.append(f'{name}: {type(error).__name__}: {error}')\n"
        "print(len(package), len(alone))\nprint('\\n'.join(failed))\nsys.exit(1 if failed else 0)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=PACKAGE.parent, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    loaded, alone = map(int, result.stdout.split()[:2])
    assert loaded + alone >= len(names), "every module is loaded by the package or imported alone"
    assert alone >= 3, "the lazily imported modules (the CLI, the demo, the model loaders) are imported alone"
