"""Call structures: which extraction serves which call (like Dynamo's guards).

A graph is specialised to the structure of the call it was exported from: which positional and
keyword arguments were passed, their non-tensor values, tensor dtypes, devices and ranks, and the
train/eval flags. :func:`structure_key` captures that as a hashable key; :class:`ShapeGuard` records
which tensor dimensions export kept dynamic (``Dim.AUTO``) and their allowed ranges.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch.utils import _pytree as pytree


def _leaf_key(leaf: Any) -> Hashable:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", leaf.dtype, leaf.device, leaf.dim())
    try:
        hash(leaf)
    except TypeError:
        return (type(leaf), id(leaf))
    return (type(leaf), leaf)


def structure_key(modules: list[torch.nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """Hashable description of a call's structure (everything except tensor values and sizes).

    Args:
        modules: the module and its submodules, whose train/eval flags are part of the structure.
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return (str(spec), tuple(_leaf_key(leaf) for leaf in leaves), tuple(m.training for m in modules))


def tensor_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors of a call, in pytree order (the order torch.export numbers its user inputs)."""
    return [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]


class ShapeGuard:
    """Tensor sizes an extraction is valid for.

    Args:
        dims: per tensor input (pytree order), per dimension either an ``int`` (static size) or
            ``(symbol, low, high)`` (dynamic size; ``high`` may be ``None`` for unbounded). Dimensions
            sharing a symbol must be equal at call time.
    """

    def __init__(self, dims: list[list[int | tuple[str, int, int | None]]]):
        self.dims = dims

    @classmethod
    def static(cls, tensors: list[torch.Tensor]) -> ShapeGuard:
        """A guard accepting exactly the sizes of ``tensors``."""
        return cls([list(t.shape) for t in tensors])

    @classmethod
    def from_export(cls, exported: torch.export.ExportedProgram) -> ShapeGuard:
        """Read the dynamic dimensions and their ranges off an exported program's user inputs."""
        user_inputs = set(exported.graph_signature.user_inputs)
        dims: list[list[int | tuple[str, int, int | None]]] = []
        for node in exported.graph.nodes:
            if node.op != "placeholder" or node.name not in user_inputs:
                continue
            value = node.meta.get("val")
            if not isinstance(value, torch.Tensor):
                continue
            tensor_dims: list[int | tuple[str, int, int | None]] = []
            for size in value.shape:
                if isinstance(size, int):
                    tensor_dims.append(size)
                    continue
                expr = size.node.expr
                bounds = exported.range_constraints.get(expr)
                if bounds is None or not expr.is_Symbol:
                    tensor_dims.append(int(size.node.hint))
                    continue
                try:
                    high: int | None = int(bounds.upper)
                except (TypeError, ValueError, AttributeError, OverflowError):
                    high = None  # unbounded (torch's int_oo)
                tensor_dims.append((str(expr), int(bounds.lower), high))
            dims.append(tensor_dims)
        return cls(dims)

    def matches(self, tensors: list[torch.Tensor]) -> bool:
        """Whether ``tensors`` (pytree order) have sizes this extraction accepts."""
        if len(tensors) != len(self.dims):
            return False
        symbols: dict[str, int] = {}
        for tensor, dims in zip(tensors, self.dims):
            shape = tensor.shape
            if len(shape) != len(dims):
                return False
            for size, rule in zip(shape, dims):
                if isinstance(rule, int):
                    if size != rule:
                        return False
                    continue
                symbol, low, high = rule
                if size < low or (high is not None and size > high):
                    return False
                if symbols.setdefault(symbol, size) != size:
                    return False
        return True
