"""torch.func transforms (functorch) around an extraction: torch 2.13's private functorch API.

A bridged model called inside ``torch.func.grad`` / ``vjp`` / ``jacrev`` / ``jvp`` / ``vmap`` gets
functorch's wrapped tensors (``GradTrackingTensor``, ``BatchedTensor``: ``TensorWrapper``\\s whose
storage cannot be read) and runs under functorch's interpreter stack. Extraction cannot work on
them: it copies inputs with ``requires_grad_()`` (refused inside a transform), reads storages for
its aliasing checks, and exports with fake tensors. So an extraction started inside a transform
runs outside it (:func:`transforms_suspended`: the interpreter stack popped, and pushed back
after), from plain example tensors with each input's logical value (:func:`plain_examples`); the
graph it gives is then run on the wrapped tensors inside the transform, which functorch
differentiates like any eager code. A call whose inputs ``vmap`` batches is not: it is extracted
inside the transforms (graph code may call an operator functorch has no batching rule for, such
as ``aten::sym_size.int``, where the module's own ``x.size(1)`` calls none; the extraction then
falls back to the module's own code): see :func:`wrapper_kinds`.

- ``torch._C._functorch.peek_interpreter_stack()``: the innermost active transform, or None;
- ``is_functorch_wrapped_tensor`` / ``is_batchedtensor`` / ``get_unwrapped`` / ``maybe_get_bdim``:
  one wrapper level of a tensor, and a ``BatchedTensor``'s batch dimension;
- ``torch._functorch.pyfunctorch.temporarily_clear_interpreter_stack``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .pytree import pytree


def transforming() -> bool:
    """Whether a torch.func transform is active (this code runs inside ``grad``, ``vmap``...)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def wrapped(value: object) -> bool:
    """Whether ``value`` is a tensor wrapped by a torch.func transform."""
    return isinstance(value, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(value)


def wrapper_kinds(call: Any) -> frozenset[str]:
    """The kinds of torch.func wrappers around the tensors of ``call`` (any pytree): ``"vmap"``
    (a ``BatchedTensor`` level), ``"autograd"`` (a ``grad``/``vjp``/``jvp`` level)."""
    kinds: set[str] = set()
    for leaf in pytree.tree_leaves(call):
        value = leaf
        while isinstance(value, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(value):
            kinds.add("vmap" if torch._C._functorch.is_batchedtensor(value) else "autograd")
            value = torch._C._functorch.get_unwrapped(value)
    return frozenset(kinds)


def _unwrapped(tensor: torch.Tensor) -> tuple[torch.Tensor, list[int], bool]:
    """``tensor``'s innermost value, the batch dimension of each ``vmap`` level over it (outermost
    first) and its ``requires_grad`` at the current level. Read inside the transforms."""
    requires_grad = tensor.requires_grad
    batch_dims: list[int] = []
    value = tensor
    while torch._C._functorch.is_functorch_wrapped_tensor(value):
        if torch._C._functorch.is_batchedtensor(value):
            batch_dims.append(torch._C._functorch.maybe_get_bdim(value))
        value = torch._C._functorch.get_unwrapped(value)
    return value, batch_dims, requires_grad


def _logical(value: torch.Tensor, batch_dims: list[int], requires_grad: bool) -> torch.Tensor:
    """The plain example from :func:`_unwrapped`'s parts. Built outside the transforms."""
    with torch.no_grad():
        for dim in reversed(batch_dims):  # an outer level's batch dimension indexes the inner level's value
            value = value.select(dim, 0)
        value = value.detach().clone()
    return value.requires_grad_(requires_grad)


def plain_examples(call: Any) -> Any:
    """``call`` (any pytree: ``(args, kwargs)``) with every tensor wrapped by a torch.func transform
    replaced by a plain tensor holding the logical value the code running now sees: the innermost
    value under every wrapper, the first entry of each ``vmap`` batch dimension taken, and
    ``requires_grad`` as the wrapped tensor reports it at the current level. Other leaves are kept.
    Call it inside the transforms (it suspends them itself to build the tensors)."""
    leaves, spec = pytree.tree_flatten(call)
    parts = {i: _unwrapped(leaf) for i, leaf in enumerate(leaves) if wrapped(leaf)}
    if not parts:
        return call
    with transforms_suspended():
        for i, (value, batch_dims, requires_grad) in parts.items():
            leaves[i] = _logical(value, batch_dims, requires_grad)
    return pytree.tree_unflatten(leaves, spec)


@contextlib.contextmanager
def transforms_suspended() -> Iterator[None]:
    """The body runs outside every active torch.func transform (functorch's interpreter stack
    popped, and pushed back afterwards, also on error): plain tensors compute and autograd works
    as outside any transform. The transforms' wrapped tensors must not be used meanwhile."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    with temporarily_clear_interpreter_stack():
        yield
