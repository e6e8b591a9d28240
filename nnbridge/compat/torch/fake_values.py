"""A fake-tensor mode for checking a graph's shapes without computing it.

``torch._subclasses.fake_tensor.FakeTensorMode`` (torch 2.0 - 2.13, a private module) runs aten
operators on tensors that carry only shape, dtype, device and strides. Usage::

    with fake_mode() as mode:
        x = torch.empty(2, 3)          # a fake tensor
        y = torch.relu(x)              # its metadata only
"""

from __future__ import annotations

from typing import Any

import torch


def fake_mode() -> Any:
    """A new ``FakeTensorMode`` without a shape environment (static sizes) that accepts real
    tensors as inputs (a graph's parameters), converting them to fake ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(value: Any) -> bool:
    """Whether ``value`` is a fake tensor (of any mode)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def fake_from(mode: Any, value: torch.Tensor) -> torch.Tensor:
    """``value`` (a real tensor) as a fake tensor of ``mode``, sharing nothing with it."""
    return mode.from_tensor(value)
