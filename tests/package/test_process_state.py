"""Process-wide state is listed in one place (docs/design.md, "Process-wide state").

A module-level name counts when it is a lock, thread-local, context variable or weak registry, or
a dict, list or set that its module mutates (``.append``, ``[key] = ...``, ``del x[key]``...): what
the code writes at run time, not a list of known names.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALWAYS = {"Lock", "RLock", "local", "ContextVar", "WeakSet", "WeakKeyDictionary", "WeakValueDictionary"}
MUTATORS = {"append", "add", "update", "pop", "clear", "setdefault", "extend", "remove", "discard", "insert",
            "popitem"}
CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter"}


def module_state(path: Path) -> list[str]:
    """The module-level names of ``path`` that hold process-wide mutable state."""
    tree = ast.parse(path.read_text())
    assigned: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            assigned[node.targets[0].id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            assigned[node.target.id] = node.value
    mutated = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                and isinstance(node.func.value, ast.Name)):
            mutated.add(node.func.value.id)
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, ast.AugAssign) else []
        mutated |= {t.value.id for t in targets if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)}
    found = []
    for name, value in assigned.items():
        callee = None
        if isinstance(value, ast.Call):
            callee = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", None)
        container = isinstance(value, (ast.Dict, ast.List, ast.Set)) or callee in CONTAINERS
        if callee in ALWAYS or (name in mutated and container):
            found.append(name)
    return found


def package_state(package: Path) -> set[str]:
    return {".".join([*path.relative_to(package).with_suffix("").parts, name])
            for path in sorted(package.rglob("*.py")) for name in module_state(path)}


def documented_state(design: str) -> set[str]:
    section = design.split("## Process-wide state", 1)[1].split("\n## ", 1)[0]
    names = set()
    for row in re.findall(r"^\| (`.*?) \|", section, flags=re.MULTILINE):
        cells = re.findall(r"`([^`]+)`", row)
        module = cells[0].rsplit(".", 1)[0]
        names |= {cell if "." in cell else f"{module}.{cell}" for cell in cells}
    return names


def test_process_wide_state_is_documented_in_one_place():
    design = (ROOT / "docs" / "design.md").read_text()
    assert package_state(ROOT / "nnbridge") == documented_state(design)


def test_a_new_registry_is_found(tmp_path):
    (tmp_path / "graph").mkdir()
    (tmp_path / "graph" / "points.py").write_text(
        "import threading\nimport weakref\n"
        "SEEN = {}\nCONSTANT = {'a': 1}\nLOCK = threading.Lock()\nPOINTS = weakref.WeakSet()\n"
        "def note(key):\n    SEEN[key] = True\n    return CONSTANT['a']\n")
    assert package_state(tmp_path) == {"graph.points.SEEN", "graph.points.LOCK", "graph.points.POINTS"}
