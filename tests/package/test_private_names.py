"""No private attribute of torch, transformers, nnsight or accelerate outside ``nnbridge/compat/``.

The private names are read off the libraries themselves (class attributes along the MRO of their
public classes, and the instance attributes of small live objects), so a name a new release adds
is found without a list kept here. A use is an attribute access (``module._modules``), a
``__dict__`` key (``module.__dict__["_call_impl"]``), a string passed to ``getattr``/``setattr``/
``hasattr``, or an import of a private module (``torch._dynamo``, ``torch.utils._pytree``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parents[2] / "nnbridge"
LIBRARIES = ("torch", "transformers", "nnsight", "accelerate")

#: ``sys._getframe`` is CPython's documented way to reach a caller's frame (warnings' stacklevel)
ALLOWED = {"_getframe"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def library_private_names() -> set[str]:
    import nnsight
    import torch.fx
    import transformers
    from nnsight.intervention.envoy import Envoy
    from nnsight.intervention.interleaver import Interleaver
    from nnsight.intervention.tracer import InterleavingTracer

    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10)
    model = transformers.GPT2LMHeadModel(config)
    wrapped = nnsight.NNsight(torch.nn.Linear(2, 2))
    graph_module = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    objects = [torch.nn.Linear(2, 2), model, config, transformers.DynamicCache(), wrapped, graph_module,
               graph_module.graph, next(iter(graph_module.graph.nodes)), torch.zeros(1)]
    classes = [type(o) for o in objects] + [Envoy, InterleavingTracer, Interleaver, nnsight.LanguageModel, torch.nn.Module,
                                            torch.nn.Parameter]
    names = {n for cls in classes for klass in cls.__mro__ if klass is not object for n in vars(klass)}
    names |= {n for o in objects for n in getattr(o, "__dict__", {})}
    return {n for n in names if _private(n)}


def _dict_key(node: ast.AST) -> str | None:
    if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__"
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
        return node.slice.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop")
            and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "__dict__"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return node.args[0].value
    return None


def private_uses(package: Path, private: set[str]) -> list[str]:
    """``path:line: use`` for every use of a name in ``private`` (or a private library module)
    in ``package`` outside its ``compat/`` folder."""
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if relative.parts[0] == "compat":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{relative}:{getattr(node, 'lineno', 0)}"
            names = []
            if isinstance(node, ast.Attribute):
                names.append(node.attr)
            if (key := _dict_key(node)) is not None:
                names.append(key)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                names.append(node.args[1].value)
            found += [f"{where}: {name}" for name in names if name in private and name not in ALLOWED]
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            found += [f"{where}: import {m}" for m in modules
                      if m.split(".")[0] in LIBRARIES and any(_private(part) for part in m.split("."))]
    return found


@pytest.fixture(scope="module")
def private() -> set[str]:
    return library_private_names()


def test_the_libraries_private_names_are_found(private):
    assert {"_modules", "_parameters", "_buffers", "_call_impl", "_non_persistent_buffers_set",
            "_forward_hooks"} <= private
    assert {"_module", "_batcher_class"} <= private  # nnsight's


def test_no_private_library_attribute_outside_compat(private):
    assert private_uses(PACKAGE, private) == []


def test_a_planted_private_use_is_found(tmp_path, private):
    (tmp_path / "compat").mkdir()
    (tmp_path / "compat" / "shim.py").write_text("def f(m):\n    return m._modules\n")
    (tmp_path / "graph.py").write_text(
        "import torch._dynamo\n"
        "from torch.utils._pytree import tree_map\n"
        "def f(module, envoy):\n"
        "    module.__dict__['_call_impl'] = None\n"
        "    getattr(envoy, '_module')\n"
        "    return module._parameters, module.__dict__.get('_buffers'), module._own_thing\n")
    assert private_uses(tmp_path, private) == [
        "graph.py:1: import torch._dynamo", "graph.py:2: import torch.utils._pytree",
        "graph.py:4: _call_impl", "graph.py:5: _module", "graph.py:6: _parameters", "graph.py:6: _buffers"]
