"""Keyword-only arguments past the third: no function in ``nnbridge/`` takes more than three
positional parameters (a leading ``self`` or ``cls`` not counted), so that a call reads without the
signature beside it.

The check reads the source (``ast``): methods, nested functions and ``staticmethod``s count alike.
A signature fixed by someone else (an override of a torch/nnsight/transformers method, a
replacement installed through ``nnbridge/compat/registry.py`` that must take what the function it
replaces takes, a torch hook, a protocol method) is listed in :data:`FIXED_ELSEWHERE` with the
reason.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "nnbridge"

#: ``module:qualified name`` of each function whose positional parameters someone else fixes, and who.
FIXED_ELSEWHERE = {
    "nnbridge.compat.nnsight.models:ModelSlots._remote_backend":
        "overrides nnsight's LanguageModel._remote_backend, which nnsight calls positionally",
    "nnbridge.compat.torch.duck_sizing:duck_sized.duck":
        "replaces torch's _create_symbolic_context_for_tensor, called by torch.export positionally",
    "nnbridge.compat.torch.export:_DistinctConversions.__torch_function__":
        "torch's __torch_function__ protocol (func, types, args, kwargs)",
    "nnbridge.compat.torch.fx:fx_patches_confined.confined_patch":
        "replaces torch.fx's _Patcher.patch, called by torch.fx positionally",
    "nnbridge.compat.torch.fx:fx_patches_confined.confined_patch_method":
        "replaces torch.fx's _Patcher.patch_method, called by torch.fx positionally",
    "nnbridge.compat.torch.tracepoints:tracepoint_bookkeeping_skipped.create_node":
        "replaces torch.fx's Tracer.create_node, called by torch.fx positionally",
    "nnbridge.surgery.pattern_spec:ValueTracer.create_proxy":
        "overrides torch.fx's Tracer.create_proxy, called by torch.fx positionally",
    "nnbridge.envoys.tracer:OpCacheTracer.cache":
        "overrides nnsight's InterleavingTracer.cache: same positional arguments as nnsight documents",
    "nnbridge.extract.eager_checks:_run_with_call_stack.leave":
        "a torch forward hook with kwargs: (module, args, kwargs, output)",
    "nnbridge.extract.exporting:_Instruments._saw.hook":
        "a torch forward hook with kwargs: (module, args, kwargs, output)",
    "nnbridge.patching.torch_file:_rebuild":
        "called by unpickling (pickle's REDUCE), which passes the saved arguments positionally",
    "nnbridge.graph.state:write_state":
        "an fx call_function target: graph nodes (and saved programs) call it with positional args",
}


def _positional(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    names = [a.arg for a in function.args.posonlyargs + function.args.args]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def violations(package: Path | None = None) -> list[str]:
    """``module:qualified name(parameters)`` of each function of ``package`` (default: nnbridge)
    with more than three positional parameters and no entry in :data:`FIXED_ELSEWHERE`."""
    package = package or PACKAGE
    found = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

        def walk(node: ast.AST, scope: tuple[str, ...]) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{module}:{'.'.join(scope + (child.name,))}"
                    positional = _positional(child)
                    if len(positional) > 3 and name not in FIXED_ELSEWHERE:
                        found.append(f"{name}({', '.join(positional)})")
                    walk(child, scope + (child.name,))
                elif isinstance(child, ast.ClassDef):
                    walk(child, scope + (child.name,))
                else:
                    walk(child, scope)

        walk(ast.parse(path.read_text()), ())
    return found


def test_arguments_past_the_third_are_keyword_only():
    assert violations() == []


def test_every_exemption_names_a_function_that_exists(monkeypatch):
    """An allowlist entry outlives no function: each names a function with more than three
    positional parameters today."""
    listed = set(FIXED_ELSEWHERE)
    monkeypatch.setattr(sys.modules[__name__], "FIXED_ELSEWHERE", {})
    assert {line.split("(")[0] for line in violations()} == listed


def test_signature_rule_finds_a_planted_violation(tmp_path, monkeypatch):
    """Four positional parameters are found in a function, a method and a nested function;
    ``self``/``cls`` and keyword-only parameters are not counted; an allowlisted name passes."""
    package = tmp_path / "nnbridge"
    (package / "graph").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "graph" / "__init__.py").write_text("def fine(a, b, c, *, d):\n    pass\n")
    (package / "graph" / "planted.py").write_text(
        "def four(a, b, c, d):\n    pass\n"
        "class C:\n"
        "    def method(self, a, b, c):\n        pass\n"
        "    def too_many(self, a, b, c, d=1):\n        pass\n"
        "    @classmethod\n"
        "    def make(cls, a, b, c, /, *rest, d):\n        pass\n"
        "def outer():\n"
        "    def inner(a, b, c, d):\n        pass\n"
        "def hook(module, args, kwargs, output):\n    pass\n")
    monkeypatch.setitem(FIXED_ELSEWHERE, "nnbridge.graph.planted:hook", "a torch hook")
    assert violations(package) == [
        "nnbridge.graph.planted:four(a, b, c, d)",
        "nnbridge.graph.planted:C.too_many(a, b, c, d)",
        "nnbridge.graph.planted:outer.inner(a, b, c, d)",
    ]
