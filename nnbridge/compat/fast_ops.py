"""Generated graph code that calls aten operators without ``OpOverload.__call__``'s Python frame.

fx generates ``torch.ops.aten.addmm.default(bias, x, weight)`` for every op of a graph. In torch
2.13 ``OpOverload.__call__`` is exactly ``return self._op(*args, **kwargs)`` (``_op`` is the C++
operator handle, which dispatches through every mode, subclass and Python kernel as usual), so
calling ``_op`` runs the same operator and skips one Python frame: about 0.35 µs of the 0.66 µs a
graph op costs over eager (timed on GPT-2's ``NewGELUActivation``, 8 ops), 678 ops per forward of a
12-layer GPT-2.

:func:`with_fast_ops` makes a twin of a generated function: the same code object (so tracebacks and
nnbridge's node maps of that code still apply) with globals whose ``torch`` resolves
``torch.ops.<namespace>.<packet>.<overload>`` to the overload's ``_op`` when the overload is a plain
:class:`torch._ops.OpOverload` (``TorchBindOpOverload`` has a ``__call__`` of its own and is kept)
and every other attribute to the real ``torch``. Dynamo must trace the plain function instead (it
knows ``OpOverload`` objects, not the handles). Example::

    fast = with_fast_ops(type(graph).forward)
    fast(graph, x)      # == type(graph).forward(graph, x)
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload

_PLAIN_CALL = OpOverload.__call__


class _Fallback:
    """An attribute namespace: each attribute read once from ``source`` (resolved by ``resolve``)
    and then kept as a plain instance attribute, so later reads cost a dict lookup."""

    def __init__(self, source: Any, resolve: Callable[[Any], Any]):
        self.__dict__["_source"] = source
        self.__dict__["_resolve"] = resolve

    def __getattr__(self, name: str) -> Any:
        value = self.__dict__["_resolve"](getattr(self.__dict__["_source"], name))
        self.__dict__[name] = value
        return value


def _overload(value: Any) -> Any:
    """An overload's operator handle when calling the overload only calls it, else the value."""
    if type(value) is OpOverload and type(value).__call__ is _PLAIN_CALL:
        return value._op
    return value


def _packet(value: Any) -> Any:
    return _Fallback(value, _overload) if isinstance(value, torch._ops.OpOverloadPacket) else value


def _namespace(value: Any) -> Any:
    return _Fallback(value, _packet) if isinstance(value, torch._ops._OpNamespace) else value


#: ``torch`` for generated code: ``ops`` resolves through namespaces, packets and overloads
FAST_TORCH = _Fallback(torch, lambda value: value)
FAST_TORCH.__dict__["ops"] = _Fallback(torch.ops, _namespace)


def with_fast_ops(function: types.FunctionType) -> types.FunctionType:
    """``function`` (fx-generated code reading ``torch`` from its globals) with ``torch`` replaced
    by :data:`FAST_TORCH`; other globals shared by value. Same code, defaults and closure."""
    if function.__globals__.get("torch") is not torch:
        return function
    fast = types.FunctionType(function.__code__, {**function.__globals__, "torch": FAST_TORCH}, function.__name__,
                              function.__defaults__, function.__closure__)
    fast.__kwdefaults__ = function.__kwdefaults__
    return fast
