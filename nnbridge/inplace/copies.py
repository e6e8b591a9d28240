"""Copies of bridged modules: ``copy.deepcopy``, ``pickle`` and ``torch.save``.

A bridged module's body, op points and call lock refer to its bridge, which a generic copy would
either share with the original (the copy would run the original's graphs and weights) or fail to
pickle (weak references). So every module whose body the bridge swapped carries a
:class:`Copier` as its instance ``__reduce_ex__`` (looked up on the instance by :mod:`copy` and
:mod:`pickle`). A copy is made from the module exactly as it was before
bridging (the bridge is detached for the copy's duration, under the call lock) and is bridged again,
with the same :class:`~nnbridge.extract.options.ExtractionOptions`, lazily: its graphs and op points
are extracted at its first call, so hooks registered on the original's op points are not copied.

Example::

    nnbridge.bridge(model, input_ids)
    twin = copy.deepcopy(model)             # bridged, independent weights
    torch.save(model, "model.pt")           # loads as a bridged model (op points at first call)
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import operator
import pickle
import weakref
from collections.abc import Callable
from typing import Any, SupportsIndex

import torch

from ..errors import NNBridgeError
from ..extract.options import ExtractionOptions


class CarriedOptions:
    """A bridge's options, carried into its copies: deep-copied with them, and pickled only if they
    can be (a lambda in ``custom_extraction_functions`` cannot)."""

    def __init__(self, options: ExtractionOptions):
        self.options = options

    def __deepcopy__(self, memo: dict[int, Any]) -> CarriedOptions:
        return CarriedOptions(copy.deepcopy(self.options, memo))

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        """Raises:
            NNBridgeError: the options cannot be pickled; the model stays bridged."""
        try:
            pickle.dumps(self.options, operator.index(protocol))
        except Exception as error:
            raise NNBridgeError(
                f"cannot pickle a bridged model: its ExtractionOptions cannot be pickled ({type(error).__name__}:"
                f" {error}). Use module-level functions in the options, or call nnbridge.unbridge(model)"
                " before pickling (or save model.state_dict())."
            ) from error
        return CarriedOptions, (self.options,)


class Copier:
    """``__reduce_ex__`` of one bridged module, used by ``pickle``, ``torch.save`` and
    ``copy.deepcopy`` alike (an instance ``__deepcopy__`` would also be found through wrappers that
    forward attribute reads to the module, such as nnsight's envoys, and copy the module instead of
    the wrapper).

    Args:
        module: the bridged module.
        detached: ``detached()`` is a context manager in which the whole model is exactly as
            before bridging (``Bridge.detached``).
        rebridge: ``rebridge(plain_copy, carried_options)`` bridges a copy again (importable by
            reference, since pickles call it at load).
        options: the bridge's options.
    """

    def __init__(self, module: torch.nn.Module, detached: Callable[[], contextlib.AbstractContextManager[object]],
                 rebridge: Callable[[torch.nn.Module, CarriedOptions], torch.nn.Module], *, options: ExtractionOptions):
        self.module_ref = weakref.ref(module)  # the module owns this object
        self.detached, self.rebridge, self.options = detached, rebridge, CarriedOptions(options)

    def reduce_ex(self, protocol: int) -> tuple[Any, ...]:
        """Reduce to ``rebridge(plain module, options)``: the module as it was before bridging,
        sharing the module's own parameter and buffer tensors, which the pickler (``torch.save``:
        as storages) or ``copy.deepcopy`` then copies as usual; only the module structure is
        copied here. An unpicklable option raises ``NNBridgeError`` when pickled (see
        :class:`CarriedOptions`)."""
        with self.detached():
            module = self.module_ref()
            assert module is not None  # called as the module's own __reduce_ex__: it is alive
            tensors = itertools.chain(module.parameters(), module.buffers())
            plain = copy.deepcopy(module, {id(t): t for t in tensors})
        return self.rebridge, (plain, self.options)


def install_copier(module: torch.nn.Module, copier: Copier) -> None:
    """Make ``copy.deepcopy(module)``, ``pickle`` and ``torch.save`` use ``copier``."""
    module.__dict__["__reduce_ex__"] = copier.reduce_ex


def remove_copier(module: torch.nn.Module) -> None:
    """Undo :func:`install_copier`."""
    module.__dict__.pop("__reduce_ex__", None)
