"""Duck sizing for chosen export inputs: equal sizes share one symbol.

torch 2.13's non-strict ``torch.export`` gives every ``Dim.AUTO`` dimension a symbol of its own
(``DimDynamic.DYNAMIC``, in ``torch._export.non_strict_utils._create_symbolic_context_for_tensor``).
A transformers ``Cache`` passed to a module (a decoder layer called with ``past_key_values``, a
``generate`` step) holds two tensors per layer, so a module called with the cache of 29 filled
layers starts its export with ~170 symbols, and torch's symbolic reasoning costs grow with them:
a late layer of SmolLM2-135M exports several times slower than its first layer, with the same
layer code (not so with the cache's dimensions static). :func:`duck_sized` makes the dimensions
of the given tensors ``DimDynamic.DUCK`` instead, as ``torch.compile`` does by default: dimensions of
these tensors with equal sizes share one symbol, so every cache layer's sequence length is one
symbol.

Faithfulness: a shared symbol is an assumption that the sizes are equal, and nnbridge's shape
guard (:class:`~nnbridge.guards.call_structure.ShapeGuard`) requires every dimension sharing a
symbol to be equal at call time; a call whose cache layers differ in length extracts again. Other
inputs keep symbols of their own (duck sizing only reuses symbols made by duck sizing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import threading
from collections.abc import Collection, Iterator
from typing import Any

import torch

from .. import registry


@contextlib.contextmanager
def duck_sized(tensors: Collection[torch.Tensor]) -> Iterator[None]:
    """For the body's duration, exports made by this thread give the dynamic dimensions of
    ``tensors`` (the real tensors passed to ``torch.export.export``, matched by identity) duck-sized
    symbols (see the module docstring). Dimensions with a constraint (a named ``Dim``) and static
    ones are left as export made them. Nothing is patched when ``tensors`` is empty."""
    if not tensors:
        yield
        return
    utils = importlib.import_module("torch._export.non_strict_utils")
    symbolic = importlib.import_module("torch.fx.experimental.symbolic_shapes")
    original = utils._create_symbolic_context_for_tensor
    ids, owner = {id(t) for t in tensors}, threading.get_ident()

    def duck(t: Any, source: Any, t_constraints: Any, sources: Any, mode: Any) -> Any:
        context = original(t, source, t_constraints, sources, mode)
        if id(t) not in ids or threading.get_ident() != owner \
                or not isinstance(context, symbolic.StatelessSymbolicContext) \
                or isinstance(context, symbolic.SubclassSymbolicContext):
            return context
        sizes = [symbolic.DimDynamic.DUCK if size is symbolic.DimDynamic.DYNAMIC and constraint is None else size
                 for size, constraint in zip(context.dynamic_sizes, context.constraint_sizes)]
        return dataclasses.replace(context, dynamic_sizes=sizes)

    with registry.replaced("duck_sizing", utils, "_create_symbolic_context_for_tensor", value=duck):
        yield
