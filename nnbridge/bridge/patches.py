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
from typing import Any

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
    """Base class: ``patch(value) -> new value``."""

    @abc.abstractmethod
    def __call__(self, original: Any) -> Any:
        """The value the rest of the graph sees instead of ``original``."""


@dataclass(kw_only=True)
class ZeroPatch(Patch):
    """Zero the value, or only ``value[slice]`` (as graphpatch's ZeroPatch).

    Example: ``ZeroPatch(slice=(slice(None), 0))`` zeroes column 0 of a ``(rows, cols)`` tensor.
    """

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

    value: torch.Tensor | float
    slice: Slice | None = None

    def __call__(self, original: torch.Tensor) -> torch.Tensor:
        if self.slice is None:
            return original + self.value
        return _patched(original, self.slice, lambda part: part + self.value)


@dataclass(kw_only=True)
class ReplacePatch(Patch):
    """Replace the value, or ``value[slice]``, by ``value`` (as graphpatch's ReplacePatch)."""

    value: Any
    slice: Slice | None = None

    def __call__(self, original: Any) -> Any:
        if self.slice is None:
            return self.value
        return _patched(original, self.slice, lambda part: torch.as_tensor(self.value).to(part).expand_as(part))


@dataclass(kw_only=True)
class ProbePatch(Patch):
    """Keep a detached copy of the latest value in ``activation``; the value passes unchanged."""

    activation: torch.Tensor | None = None

    def __call__(self, original: Any) -> Any:
        self.activation = original.detach().clone() if isinstance(original, torch.Tensor) else original
        return original


@dataclass(kw_only=True)
class RecordPatch(Patch):
    """Append a detached copy of every value seen to ``activations``; the value passes unchanged."""

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
