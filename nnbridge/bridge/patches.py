"""Patches: what to do to a node's value, as graphpatch's patch classes (keyword dataclasses).

A patch is called with the node's current value and returns the value the rest of the graph sees.
Patches on one node apply in list order; nested ``pg.patch`` contexts append. Example::

    with pg.patch({"linear_0.output": [AddPatch(value=torch.ones(1)), ZeroPatch(slice=(0,))]}):
        pg(x)
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

Slice = Any  # anything ``tensor[...]`` accepts: an int, a slice, a tuple of them, a mask


def _patched(original: torch.Tensor, index: Slice, new: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``original`` with ``original[index]`` replaced by ``new(original[index])``, out of place
    (autograd-safe: the node's original value is never written)."""
    result = original.clone()
    result[index] = new(original[index])
    return result


@dataclass(kw_only=True)
class Patch(abc.ABC):
    """Base class: ``patch(value) -> new value``.

    ``requires_clone`` (as graphpatch's ``Patch.requires_clone``): whether the patch may write into
    the value it is given. When true (the default, for :class:`CustomPatch` and user subclasses)
    the patch receives a clone of the node's tensors, so an in-place op (``t.add_(1)``) cannot
    change the model's weights, a caller's input or another consumer of the node. nnbridge's own
    patches are out of place and receive the node's value itself.
    """

    requires_clone: ClassVar[bool] = True

    @abc.abstractmethod
    def __call__(self, original: Any) -> Any:
        """The value the rest of the graph sees instead of ``original``."""


@dataclass(kw_only=True)
class ZeroPatch(Patch):
    """Zero the value, or only ``value[slice]`` (as graphpatch's ZeroPatch).

    Example: ``ZeroPatch(slice=(slice(None), 0))`` zeroes column 0 of a ``(rows, cols)`` tensor.
    """

    requires_clone: ClassVar[bool] = False

    slice: Slice | None = None

    def __call__(self, original: torch.Tensor) -> torch.Tensor:
        if self.slice is None:
            return torch.zeros_like(original)
        return _patched(original, self.slice, torch.zeros_like)


@dataclass(kw_only=True)
class AddPatch(Patch):
    """Add ``value`` (broadcast) to the value or to ``value[slice]`` (as graphpatch's AddPatch).

    ``value`` may require grad: the sum is differentiable, so the addend can be optimised.
    """

    requires_clone: ClassVar[bool] = False

    value: torch.Tensor | float
    slice: Slice | None = None

    def __call__(self, original: torch.Tensor) -> torch.Tensor:
        if self.slice is None:
            return original + self.value
        return _patched(original, self.slice, lambda part: part + self.value)


@dataclass(kw_only=True)
class ReplacePatch(Patch):
    """Replace the value, or ``value[slice]``, by ``value`` (as graphpatch's ReplacePatch)."""

    requires_clone: ClassVar[bool] = False

    value: Any
    slice: Slice | None = None

    def __call__(self, original: Any) -> Any:
        if self.slice is None:
            return self.value
        return _patched(original, self.slice, lambda part: torch.as_tensor(self.value).to(part).expand_as(part))


@dataclass(kw_only=True)
class ProbePatch(Patch):
    """Keep a detached copy of the latest value in ``activation``; the value passes unchanged."""

    requires_clone: ClassVar[bool] = False

    activation: torch.Tensor | None = None

    def __call__(self, original: Any) -> Any:
        self.activation = original.detach().clone() if isinstance(original, torch.Tensor) else original
        return original


@dataclass(kw_only=True)
class RecordPatch(Patch):
    """Append a detached copy of every value seen to ``activations``; the value passes unchanged."""

    requires_clone: ClassVar[bool] = False

    activations: list[Any] = field(default_factory=list)

    def __call__(self, original: Any) -> Any:
        self.activations.append(original.detach().clone() if isinstance(original, torch.Tensor) else original)
        return original


@dataclass(kw_only=True)
class CustomPatch(Patch):
    """Replace the value by ``custom_op(value)`` (as graphpatch's CustomPatch)."""

    custom_op: Callable[[Any], Any]

    def __call__(self, original: Any) -> Any:
        return self.custom_op(original)
