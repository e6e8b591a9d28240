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
