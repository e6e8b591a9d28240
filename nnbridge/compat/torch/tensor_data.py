"""Notice ``tensor.data`` reads and assignments (torch 2.0 - 2.13).

``tensor.data`` returns a tensor sharing ``tensor``'s storage but with a version counter of its
own, so an in-place write through it (``weight.data -= delta``, what peft's LoRA layers do to
merge and unmerge) changes ``tensor`` without bumping ``tensor._version``; ``tensor.data = other``
swaps its storage, also without a bump. ``data`` is a getset descriptor of ``torch._C.TensorBase``
that ``torch.Tensor`` and its subclasses (``nn.Parameter``) inherit: while at least one
:func:`data_accesses` body runs, ``torch.Tensor.data`` is a property that reports the access and
then runs the original descriptor, so ``tensor.data`` behaves as without it (``__torch_function__``
subclasses included). :func:`raw_data` is the original descriptor's read, which reports nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import registry

_DESCRIPTOR = torch._C.TensorBase.__dict__["data"]
_LOCK = threading.Lock()
#: the watchers of the running bodies: (thread id, callback), in entry order
_WATCHERS: list[tuple[int, Callable[[torch.Tensor], None]]] = []
_PREVIOUS: list[Any] = []  # what registry.uninstall puts back, while the property is installed


def raw_data(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.data``, not reported to any :func:`data_accesses` watcher."""
    return _DESCRIPTOR.__get__(tensor, type(tensor))


def _report(tensor: torch.Tensor) -> None:
    thread = threading.get_ident()
    for owner, callback in list(_WATCHERS):
        if owner == thread:
            callback(tensor)


def _get(self: torch.Tensor) -> torch.Tensor:
    if _WATCHERS:
        _report(self)
    return _DESCRIPTOR.__get__(self, type(self))


def _set(self: torch.Tensor, value: Any) -> None:
    if _WATCHERS:
        _report(self)
    _DESCRIPTOR.__set__(self, value)


_PROPERTY = property(_get, _set, doc=_DESCRIPTOR.__doc__)


@contextlib.contextmanager
def data_accesses(on_access: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call ``on_access(tensor)`` before every ``tensor.data`` read or assignment made in the
    thread that entered the body (before the access happens, so the tensor's values are still
    those before any write through it). Bodies may nest and run in several threads; the property
    is removed when the last one exits, also when a body raises."""
    entry = (threading.get_ident(), on_access)
    with _LOCK:
        if not _WATCHERS and registry.enabled("tensor_data"):
            _PREVIOUS[:] = [registry.install("tensor_data", torch.Tensor, "data", value=_PROPERTY)]
        _WATCHERS.append(entry)
    try:
        yield
    finally:
        with _LOCK:
            _WATCHERS.remove(entry)
            if not _WATCHERS and _PREVIOUS:
                registry.uninstall("tensor_data", torch.Tensor, "data", previous=_PREVIOUS.pop(), only_if=_PROPERTY)


def set_raw_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """``tensor.data = value``, not reported to any :func:`data_accesses` watcher."""
    _DESCRIPTOR.__set__(tensor, value)
