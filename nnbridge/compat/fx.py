"""Shims over ``torch.fx.GraphModule`` behaviour."""

from __future__ import annotations

from typing import Any


class NoSubmoduleRecompile:
    """Mixin for a ``GraphModule`` subclass whose child graph modules manage their own code.

    torch 2.13's ``GraphModule.recompile`` ends with ``self._recompile_submodules()``, which
    recompiles every child ``GraphModule``; building a hierarchy bottom-up then recompiles each
    subtree once per ancestor. Children here are compiled when built, so the recursion is skipped.
    """

    def _recompile_submodules(self) -> list[tuple[str, Any]]:
        return []


def generated_line_map(code: Any) -> tuple[dict[int, int | None], int]:
    """``(line -> node index, prologue start)`` of fx-generated code: a ``PythonCode`` from
    ``Graph.python_code`` or a ``GraphModule`` after ``recompile`` (``_lineno_map`` and
    ``_prologue_start``, torch 2.1 - 2.13). The node index of a frame at ``lineno`` in the generated
    forward is ``map[lineno - prologue start]``, in ``graph.nodes`` order."""
    return dict(getattr(code, "_lineno_map", None) or {}), int(getattr(code, "_prologue_start", 0))


def keep_tracebacks(graph_module: Any) -> None:
    """Call ``graph_module`` as a plain ``nn.Module``.

    ``GraphModule.recompile`` (torch 2.0 - 2.13) installs ``cls.__call__ = call_wrapped``, whose
    ``_WrappedCall`` prints the generated line to stderr when an error is raised in generated code
    and re-raises it *without its traceback*; nnbridge locates the failing node from that traceback
    (see ``nnbridge.bridge.failures``), so the class gets ``nn.Module.__call__`` back (the same call
    otherwise).
    """
    import torch

    type(graph_module).__call__ = torch.nn.Module.__call__
