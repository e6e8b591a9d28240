"""A static scan of nnbridge's sources for run-time patches of torch, transformers or nnsight made
outside ``nnbridge/compat/registry.py`` (used by tests/compat/test_patch_registry.py).

A name is *foreign* when it is bound by an import from one of those libraries, or assigned (or
looped over) from an expression rooted in a foreign name (``torch.autograd.Function``,
``importlib.import_module("torch.export._trace")``, ``sys.modules["torch.export.unflatten"]``,
``getattr(foreign, ...)``, a tuple holding one). The analysis is per file and ignores scopes,
which can only make it report more. Reported:

- ``setattr(F, ...)`` / ``delattr(F, ...)``, ``F.attr = ...``, ``del F.attr`` and
  ``F.__dict__[key] = ...`` with ``F`` foreign;
- every assignment to a ``__code__`` attribute, whatever the object;
- ``F.patch(...)`` (torch's config patching) and ``mock.patch...``, unless the line carries
  ``# registry: <patch name>`` naming a registered patch.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

FOREIGN = ("torch", "transformers", "nnsight")
_PRAGMA = re.compile(r"#\s*registry:\s*([A-Za-z_][A-Za-z_0-9]*)")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def _foreign_module(name: str | None) -> bool:
    return bool(name) and str(name).split(".")[0] in FOREIGN


class _Scanner:
    def __init__(self, tree: ast.AST):
        self.tree = tree
        self.foreign: set[str] = set()

    def is_foreign(self, node: ast.AST | None) -> bool:
        if node is None:
            return False
        if isinstance(node, ast.Name):
            return node.id in self.foreign
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
            if isinstance(node, ast.Subscript) and self._sys_modules_entry(node):
                return True
            return self.is_foreign(node.value)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(self.is_foreign(element) for element in node.elts)
        if isinstance(node, ast.Call):
            function = node.func
            name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
            if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
                return _foreign_module(str(node.args[0].value))
            if name == "getattr" and node.args:
                return self.is_foreign(node.args[0])
        return False

    @staticmethod
    def _sys_modules_entry(node: ast.Subscript) -> bool:
        value = node.value
        return (isinstance(value, ast.Attribute) and value.attr == "modules" and isinstance(value.value, ast.Name)
                and value.value.id == "sys" and isinstance(node.slice, ast.Constant)
                and _foreign_module(str(node.slice.value)))

    def _bind(self, target: ast.AST) -> bool:
        """Mark the names ``target`` binds (not the objects of attribute or item targets)."""
        if isinstance(target, (ast.Tuple, ast.List)):
            return any([self._bind(element) for element in target.elts])
        if isinstance(target, ast.Starred):
            return self._bind(target.value)
        if isinstance(target, ast.Name) and target.id not in self.foreign:
            self.foreign.add(target.id)
            return True
        return False

    def collect(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _foreign_module(alias.name):
                        self.foreign.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and _foreign_module(node.module):
                for alias in node.names:
                    self.foreign.add(alias.asname or alias.name)
        changed = True
        while changed:  # to a fixpoint: aliases of aliases
            changed = False
            for node in ast.walk(self.tree):
                if isinstance(node, ast.Assign) and self.is_foreign(node.value):
                    for target in node.targets:
                        changed |= self._bind(target)
                elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and self.is_foreign(node.value):
                    changed |= self._bind(node.target)
                elif isinstance(node, (ast.For, ast.comprehension)) and self.is_foreign(node.iter):
                    changed |= self._bind(node.target)

    def findings(self) -> Iterable[tuple[int, str, bool]]:
        """``(line, description, pragma allowed)`` of each patch found."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call):
                function = node.func
                name = getattr(function, "id", None)
                if name in ("setattr", "delattr") and node.args and self.is_foreign(node.args[0]):
                    yield node.lineno, f"{name}() on {ast.unparse(node.args[0])}", False
                if isinstance(function, ast.Attribute) and function.attr == "patch" and (
                        self.is_foreign(function.value) or "mock" in ast.unparse(function.value)):
                    yield node.lineno, f"{ast.unparse(function)}()", True
                if isinstance(function, ast.Attribute) and function.attr == "object" and "mock" in ast.unparse(function):
                    yield node.lineno, f"{ast.unparse(function)}()", True
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = list(node.targets)
            for target in targets:
                for part in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]):
                    if isinstance(part, ast.Attribute) and part.attr == "__code__":
                        yield node.lineno, f"{ast.unparse(part)} replaced", False
                    elif isinstance(part, ast.Attribute) and self.is_foreign(part.value):
                        yield node.lineno, f"{ast.unparse(part)} assigned", False
                    elif (isinstance(part, ast.Subscript) and isinstance(part.value, ast.Attribute)
                          and part.value.attr == "__dict__" and self.is_foreign(part.value.value)):
                        yield node.lineno, f"{ast.unparse(part)} assigned", False


def scan_source(source: str, path: str, registered: Iterable[str]) -> list[Finding]:
    """The unregistered patches in one file's ``source``."""
    names = set(registered)
    scanner = _Scanner(ast.parse(source))
    scanner.collect()
    lines = source.splitlines()
    found = []
    for line, text, pragma_allowed in sorted(set(scanner.findings())):
        pragma = _PRAGMA.search(lines[line - 1]) if pragma_allowed else None
        if pragma is not None and pragma.group(1) in names:
            continue
        found.append(Finding(path, line, text))
    return found


def scan_tree(root: Path, registered: Iterable[str], skip: Iterable[str] = ("compat/registry.py",)) -> list[Finding]:
    """The unregistered patches in every ``.py`` file under ``root`` (paths in ``skip`` relative to it)."""
    names = list(registered)
    skipped = {root / path for path in skip}
    found = []
    for path in sorted(root.rglob("*.py")):
        if path in skipped:
            continue
        found.extend(scan_source(path.read_text(), str(path.relative_to(root.parent)), names))
    return found
