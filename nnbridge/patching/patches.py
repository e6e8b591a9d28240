"""Patches: what to do to a node's value, as graphpatch's patch classes (generic keyword dataclasses
overriding ``op``).

A patch is called with the node's current value and returns the value the rest of the graph sees.
Extend it as in graphpatch::

    @dataclass(kw_only=True)
    class ScalePatch(Patch[torch.Tensor]):
        factor: float

        def op(self, original_output: torch.Tensor) -> torch.Tensor:
            return original_output * self.factor

Deliberate difference from graphpatch 0.2: nnbridge's built-in patches (``ZeroPatch``, ``AddPatch``,
``ReplacePatch``, ``ProbePatch``, ``RecordPatch``) compute out of place, so they are autograd-safe
and need no clone (``requires_clone=False``); graphpatch's write into a clone of the node's value.
The values they return are equal.
Patches on one node apply in list order; nested ``pg.patch`` contexts append. Example::

    with pg.patch({"linear_0.output": [AddPatch(value=torch.ones(1)), ZeroPatch(slice=(0,))]}):
        pg(x)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Any, Generic, TypeVar

import torch

_IndexPart = int | slice | EllipsisType | torch.Tensor | None
#: What ``tensor[...]`` accepts: an int, a slice, ``...``, an index or mask tensor, or a tuple of them
Slice = _IndexPart | Sequence[_IndexPart]
#: The type of value a patch applies to (graphpatch's ``PatchTarget``).
PatchTarget = TypeVar("PatchTarget")


def _patched(original: torch.Tensor, index: Slice, new: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``original`` with ``original[index]`` replaced by ``new(original[index])``, out of place
    (autograd-safe: the node's original value is never written)."""
    result = original.clone()
    result[index] = new(original[index])
    return result


@dataclass(kw_only=True)
class Patch(Generic[PatchTarget]):
    """Base class, as graphpatch's ``Patch``: subclasses are ``@dataclass(kw_only=True)`` and
    override :meth:`op` (or ``__call__``, which calls it).

    Attributes:
        requires_clone: whether the patch may write into the value it is given (not a constructor
            argument, except for :class:`CustomPatch`; a subclass may redeclare it). When true
            (the default) the patch receives a clone of the node's tensors, so an in-place op
            (``t.add_(1)``) cannot change the model's weights, a caller's input or another consumer
            of the node. nnbridge's own patches are out of place and receive the node's value.
        path: for a NodePath that digs into a container value (``"output|sub_0.logits"``), the
            dig part (``"sub_0.logits"``), set by ``pg.patch`` as graphpatch does; None otherwise.
            Not a constructor argument. The patch receives the dug element, never the container.
    """

    requires_clone: bool = field(default=True, init=False)
    path: str | None = field(default=None, init=False)

    def op(self, original_output: PatchTarget) -> PatchTarget:
        """The value the rest of the graph sees instead of ``original_output`` (the node's value:
        a tensor, or whatever the node produces). The base class returns it unchanged."""
        return original_output

    def __call__(self, original: PatchTarget) -> PatchTarget:
        return self.op(original)


@dataclass(kw_only=True)
class ZeroPatch(Patch[torch.Tensor]):
    """Zero the value, or only ``value[slice]`` (as graphpatch's ZeroPatch).

    Example: ``ZeroPatch(slice=(slice(None), 0))`` zeroes column 0 of a ``(rows, cols)`` tensor.
    """

    requires_clone: bool = field(default=False, init=False)

    slice: Slice | None = None

    def op(self, original: torch.Tensor) -> torch.Tensor:
        if self.slice is None:
            return torch.zeros_like(original)
        return _patched(original, self.slice, torch.zeros_like)


@dataclass(kw_only=True)
class AddPatch(Patch[torch.Tensor]):
    """Add ``value`` (broadcast) to the value or to ``value[slice]`` (as graphpatch's AddPatch).

    ``value`` may require grad: the sum is differentiable, so the addend can be optimised.
    """

    requires_clone: bool = field(default=False, init=False)

    value: torch.Tensor | float
    slice: Slice | None = None

    def op(self, original: torch.Tensor) -> torch.Tensor:
        if self.slice is None:
            return original + self.value
        return _patched(original, self.slice, lambda part: part + self.value)


# Patch[Any] (Replace, Probe, Record): these apply to any node's value, which may be a tensor, a
# Python scalar, a tuple or any object the graph passes along.
@dataclass(kw_only=True)
class ReplacePatch(Patch[Any]):
    """Replace the value, or ``value[slice]``, by ``value`` (as graphpatch's ReplacePatch).

    A tensor node is replaced as graphpatch's ``original[slice] = value``: ``value`` is broadcast to
    the node's shape and converted to its dtype and device (``torch.zeros(1, vocab)`` replaces the
    logits of every position), in a copy of the node's tensor (gradients through it are zero). A
    non-tensor node is replaced by ``value`` itself.

    Raises:
        PatchError: (when the graph runs) ``value`` does not broadcast to the node's shape, named
            with the NodePath as for any patch whose value does not fit.
        RuntimeError: (torch's) ``value`` does not broadcast to the node's ``slice``.
    """

    requires_clone: bool = field(default=False, init=False)

    value: Any
    slice: Slice | None = None

    def op(self, original: Any) -> Any:
        if self.slice is None:
            if not isinstance(original, torch.Tensor):
                return self.value
            value = torch.as_tensor(self.value, device=original.device)
            try:
                fits = torch.broadcast_shapes(value.shape, original.shape) == original.shape
            except RuntimeError:
                fits = False
            if not fits:  # handed on as given: the check after every patch names the mismatch (PatchError)
                return self.value
            return original.clone().copy_(value)
        return _patched(original, self.slice, lambda part: torch.as_tensor(self.value).to(part).expand_as(part))


@dataclass(kw_only=True)
class ProbePatch(Patch[Any]):
    """Keep a detached copy of the latest value in ``activation``; the value passes unchanged."""

    requires_clone: bool = field(default=False, init=False)

    activation: torch.Tensor | None = None

    def op(self, original: Any) -> Any:
        self.activation = original.detach().clone() if isinstance(original, torch.Tensor) else original
        return original


@dataclass(kw_only=True)
class RecordPatch(Patch[Any]):
    """Append a detached copy of every value seen to ``activations``; the value passes unchanged."""

    requires_clone: bool = field(default=False, init=False)

    activations: list[Any] = field(default_factory=list)

    def op(self, original: Any) -> Any:
        self.activations.append(original.detach().clone() if isinstance(original, torch.Tensor) else original)
        return original


@dataclass(kw_only=True)
class CustomPatch(Patch[PatchTarget]):
    """Replace the value by ``custom_op(value)`` (as graphpatch's CustomPatch, which also exposes
    ``requires_clone``: pass ``requires_clone=False`` for a read-only op to skip the clone)."""

    custom_op: Callable[[PatchTarget], PatchTarget]
    requires_clone: bool = field(default=True, init=True)

    def op(self, original: PatchTarget) -> PatchTarget:
        return self.custom_op(original)
