"""Symbolic sizes (torch 2.1 - 2.13): the private ``SymInt.node`` fields export's fake tensors carry.

Usage: ``symbolic_hint(size)`` is the concrete example value of a ``torch.SymInt`` (an ``int``
stays as it is); ``symbolic_expr(size)`` its sympy expression (``s0``), None for an ``int``.
"""

from __future__ import annotations

from typing import Any

import torch


def symbolic_hint(size: torch.SymInt | int) -> int:
    """The example value behind a symbolic size (``SymInt.node.hint``)."""
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def has_hint(size: torch.SymInt | int) -> bool:
    """Whether a size has an example value (an unbacked, data-dependent size has none)."""
    return not isinstance(size, torch.SymInt) or size.node.hint is not None


def symbolic_expr(size: torch.SymInt | int) -> Any:
    """The sympy expression of a symbolic size (``SymInt.node.expr``), None for an ``int``."""
    return size.node.expr if isinstance(size, torch.SymInt) else None


def sizes_unified(a: torch.SymInt | int, b: torch.SymInt | int) -> bool:
    """While exporting: record that two sizes are equal (``torch._check(a == b)``: export then
    treats them as one symbol, as it would had the traced code combined them), when their example
    values are; False, recording nothing, when the example values differ."""
    if symbolic_hint(a) != symbolic_hint(b):
        return False
    torch._check(a == b)
    return True
