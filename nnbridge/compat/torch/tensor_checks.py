"""A C-level check that tensors keep their properties, for guards asked on every call.

:class:`~nnbridge.guards.module_state.StateGuard` checks on every bridged call that each parameter,
buffer and tensor attribute keeps its dtype, device, shape and requires_grad (``.double()`` and
``.to(...)`` change a parameter in place). Read in Python, four properties of every tensor (149
for a 12-layer GPT-2) cost several times what torch's own tensor check for Dynamo guards
(``torch._C._dynamo.guards.TensorGuards``, private in torch 2.13) costs.

That check is stricter: it also compares strides and dispatch keys, which ``torch.inference_mode``
changes for every tensor. So it only accepts: when it fails, the caller confirms with its exact
check (:func:`fast_tensor_check`'s contract).

Example::

    check = fast_tensor_check(list(model.parameters()))
    check is None or check()   # True: every tensor has its dtype, device, sizes, strides, grad flag
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch


def fast_tensor_check(tensors: Sequence[torch.Tensor]) -> Callable[[], bool] | None:
    """A no-argument check that every tensor of ``tensors`` (kept alive by the caller, read again
    on each check) still has the dtype, device, sizes, strides, requires_grad and dispatch keys it
    has now; None when torch's check cannot describe one of them (a sparse or nested tensor) or is
    missing. True means unchanged; False means changed *or* only a stricter property moved (strides,
    or dispatch keys under ``torch.inference_mode``): confirm a False with the exact check."""
    unique = list({id(tensor): tensor for tensor in tensors}.values())  # aliases are refused by torch's check
    try:
        from torch._C._dynamo.guards import TensorGuards

        # one list of sizes (strides) per tensor, as torch's C++ reads them (the .pyi says a flat list)
        sizes: Any = [list(t.size()) for t in unique]
        strides: Any = [list(t.stride()) for t in unique]
        guards = TensorGuards(*unique, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)
        if not guards.check(*unique):
            return None
    except Exception:  # noqa: BLE001 - a layout without strides, or another torch: no fast check
        return None
    return functools.partial(guards.check, *unique)
