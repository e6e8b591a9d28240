"""The ``integration`` marker (pyproject.toml) covers what its definition names: a test that calls
``torch.compile`` or starts a second process (``subprocess.run``) is marked, by a decorator or by its
file's ``pytestmark``, so the development loop (``-m "not integration"``) leaves it out."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parents[1]
#: Calls that make a test end to end, as dotted names.
END_TO_END = {"torch.compile", "subprocess.run"}


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _marks_integration(nodes: list[ast.expr]) -> bool:
    return any("integration" in ast.unparse(node) for node in nodes)


def unmarked_end_to_end(source: str) -> list[str]:
    """The test functions of ``source`` that call one of :data:`END_TO_END` without the marker."""
    tree = ast.parse(source)
    marked_file = any(isinstance(node, ast.Assign) and any(_dotted(t) == "pytestmark" for t in node.targets)
                      and _marks_integration([node.value]) for node in tree.body)
    if marked_file:
        return []
    found = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
            continue
        calls = {_dotted(call.func) for call in ast.walk(node) if isinstance(call, ast.Call)}
        if calls & END_TO_END and not _marks_integration(node.decorator_list):
            found.append(f"{node.name} calls {', '.join(sorted(calls & END_TO_END))}")
    return found


def test_every_test_calling_torch_compile_or_a_second_process_is_marked_integration():
    found = [f"{path.relative_to(TESTS)}::{test}" for path in sorted(TESTS.rglob("test_*.py"))
             for test in unmarked_end_to_end(path.read_text())]
    assert not found, ("mark these @pytest.mark.integration (with a comment saying why), or their file with "
                       f"pytestmark: {found}")


def test_the_check_finds_an_unmarked_compile_and_accepts_a_marked_one():
    source = ("import pytest, torch\n"
              "def test_a():\n    torch.compile(f)\n"
              "@pytest.mark.integration\ndef test_b():\n    torch.compile(f)\n"
              "def test_c():\n    f()\n")
    assert unmarked_end_to_end(source) == ["test_a calls torch.compile"]
    assert unmarked_end_to_end("import pytest\npytestmark = pytest.mark.integration\n" + source) == []
