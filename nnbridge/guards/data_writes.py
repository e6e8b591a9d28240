"""Put back parameters and buffers that extraction's own eager runs wrote through ``.data``.

Extraction runs the model's code eagerly (observed runs of opaque modules, example recording, a
warm-up before an nnsight trace) and must leave no trace of those runs. Most writes to a parameter
or buffer bump its version counter, which :mod:`nnbridge.extract.capture_watch` compares. A write through
``tensor.data`` does not (``lin.weight.data -= delta``, ``lin.weight.data = merged``: peft's LoRA
layers merging or unmerging an adapter), and without care it stayed: each extra run moved the
weight once more.

:class:`DataWrites` copies a watched tensor's values on the first ``.data`` access during the body
(before the access returns, so before any write through it; see
:func:`nnbridge.compat.torch.tensor_data.data_accesses`) and :meth:`DataWrites.restore` puts its storage
and values back. The choice, against the alternatives:

- a copy of every parameter up front would double the model's memory for each run;
- a checksum of every weight before and after costs a read of the whole model per run, can miss
  a change that keeps the checksum, and cannot restore what it finds;
- a copy taken when ``.data`` is first touched costs nothing for a model whose forward never
  touches ``.data`` (the usual case), and for one that does, one copy of just those tensors.

Not seen: writes through a NumPy array or an ``untyped_storage()`` of a parameter (no torch call
at all), and ``.data`` aliases taken before the body and written inside it (a plain tensor
attribute holding one is restored by :mod:`.preservation` as any tensor attribute).

*State* here means saved state: the copies of the parameters and buffers touched through
``.data``, taken to put them back (see :mod:`.preservation`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..compat.torch.tensor_data import raw_data, set_raw_data


def _layout(tensor: torch.Tensor) -> tuple[object, ...]:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride(),
            tensor.dtype, tensor.device)


class DataWrites:
    """The ``.data`` accesses of ``tensors`` (parameters and buffers; meta tensors are skipped)
    during a body: pass :meth:`seen` to :func:`~nnbridge.compat.torch.tensor_data.data_accesses`, then
    call :meth:`restore`."""

    def __init__(self, tensors: Iterable[torch.Tensor | None]):
        self.watched = {id(t): t for t in tensors if t is not None and not t.is_meta}
        # id -> (tensor, its data before the body, a copy of its values)
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def seen(self, tensor: torch.Tensor) -> None:
        """Copy a watched tensor's values on its first access."""
        key = id(tensor)
        if key not in self.saved and self.watched.get(key) is tensor:
            data = raw_data(tensor)
            self.saved[key] = (tensor, data, data.clone())

    def restore(self) -> None:
        """Put each accessed tensor's storage and values back as before the body, without bumping
        its version counter (the body's writes did not bump it either)."""
        with torch.no_grad():
            for tensor, data, copy in self.saved.values():
                if _layout(raw_data(tensor)) != _layout(data):
                    set_raw_data(tensor, data)
                current = raw_data(tensor)
                if not torch.equal(current, copy):
                    current.copy_(copy)
        self.saved.clear()
