"""Edits checked where they are made: a value put in place of a node's tensor must be able to stand
for it.

A graph is traced for its nodes' shapes, dtypes and devices: a value of another shape handed on by
a patch, a torch hook on an op point or an nnsight edit (``envoy.output = ...``) would otherwise
fail later, in some other op (``matmul_1``), with a message that does not name the edit. Every
front-end's value passes :func:`check_replacement` where it enters the graph, and a mismatch raises
:class:`~nnbridge.errors.PatchError` naming the NodePath, the edit, what the node holds and what was
given, and the fix. The comparison is with the value the op produced on this call (not the example
the graph was extracted with), so sizes that vary between calls (batch, sequence) are never
mistaken for an error.

Example (the error a torch hook returning a slice of GPT-2's attention weights gets)::

    PatchError: A torch hook on the op point (<lambda>) on 'transformer.h_0.attn.softmax' put a tensor of
    shape (1, 4, 6, 5), torch.float32, on cpu in place of the node's value of shape (1, 4, 6, 6), ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import PatchError

_FIX = ("A value put in place of a node's must have the node's shape, dtype and device on this call (the graph"
        " after it was traced for those): slice, expand or .to() it first, or edit a copy and assign that.")


def _describe(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> str:
    return f"shape {tuple(shape)}, {dtype}, on {device}"


def check_replacement(original: torch.Tensor, result: Any, *, node_path: str | Callable[[], str],
                      edit: str | Callable[[], str], shape: torch.Size | None = None) -> None:
    """Raise unless ``result`` can stand for ``original``, the tensor the node produced on this call.

    Args:
        original: the node's value on this call, before the edit.
        result: the value the edit hands on (the same tensor after an in-place edit).
        node_path: the node's NodePath (``transformer.h_0.attn.softmax``), or a function giving it,
            called only to word the error.
        edit: who made the edit, as the message's subject (``Patch ZeroPatch(...)``, ``A torch hook
            on the op point (halve)``), or a function giving it, called only to word the error.
        shape: ``original``'s shape before the edit, when the edit may have changed it in place
            (``unsqueeze_``); ``original.shape`` otherwise.

    Raises:
        PatchError: ``result`` is not a tensor, or has another shape, dtype or device than the
            node's value. The message names ``node_path``, ``edit``, both, and the fix.
    """
    before = original.shape if shape is None else shape
    if isinstance(result, torch.Tensor) and (result.shape, result.dtype, result.device) == (
            before, original.dtype, original.device):
        return
    expected = _describe(before, original.dtype, original.device)
    if result is original:
        problem = f"changed the node's value in place to {_describe(result.shape, result.dtype, result.device)}; it was of"
    elif isinstance(result, torch.Tensor):
        problem = f"put a tensor of {_describe(result.shape, result.dtype, result.device)} in place of the node's value of"
    else:
        given = f"{type(result).__name__} {result!r:.60}" if result is not None else "None"
        problem = f"put {given} in place of the node's value of"
    if callable(node_path):
        node_path = node_path()
    if callable(edit):
        edit = edit()
    raise PatchError(f"{edit} on '{node_path}' {problem} {expected}. {_FIX}")
