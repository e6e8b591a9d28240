"""Generated graph code that calls aten operators without ``OpOverload.__call__``'s Python frame.

fx generates ``torch.ops.aten.addmm.default(bias, x, weight)`` for every op of a graph. In torch
2.13 ``OpOverload.__call__`` is exactly ``return self._op(*args, **kwargs)`` (``_op`` is the C++
operator handle, which dispatches through every mode, subclass and Python kernel as usual), so
calling ``_op`` runs the same operator and skips one Python frame, a large share of what a graph
op costs over eager, paid by each of the hundreds of ops of a forward (678 for a 12-layer GPT-2).

:func:`with_fast_ops` makes a twin of a generated function: the same code object (so tracebacks and
nnbridge's node maps of that code still apply) with globals whose ``torch`` resolves
``torch.ops.<namespace>.<packet>.<overload>`` to the overload's ``_op`` when the overload is a plain
:class:`torch._ops.OpOverload` (``TorchBindOpOverload`` has a ``__call__`` of its own and is kept)
and every other attribute to the real ``torch``. Dynamo must trace the plain function instead (it
knows ``OpOverload`` objects, not the handles). Example::

    fast = with_fast_ops(type(graph).forward)
    fast(graph, x)      # == type(graph).forward(graph, x)

The operators of :data:`UNBOXED` (the ones GPT-2 and Llama graphs call most: ``mul``, ``add``,
``linear``, ``transpose``, ``view`` ...) resolve to torch's own Python binding of the operator
(``torch.mul``'s ``torch._C._VariableFunctions.mul``, ``Tensor.view``'s ``TensorBase.view``):
the same overload, kernels and result as the handle (each entry is checked by
``tests/graph/test_fast_ops.py``: the same dispatched ops and profiler events, ``torch.equal`` outputs),
without the handle's boxed call (the arguments converted to a stack of ``IValue``s), which is
what eager code pays. A binding picks its overload from the arguments' Python types; each entry is an overload the binding picks for every call of that overload's
schema with the keywords the entry allows (the name's other overloads need an ``out=``/
``out_dtype=`` keyword, a ``str`` dimension name, or another kind of operand: a tensor exponent
for ``pow``, a device or a tensor for ``to``; ``add.Scalar``/``mul.Scalar`` have no binding). A
generated function with a call of such an operator passing another keyword, or more positional
arguments than the binding takes, gets the handles instead (see :func:`bindings_fit`).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
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


_VF, _NN, _TENSOR = torch._C._VariableFunctions, torch._C._nn, torch._C.TensorBase

#: ``(aten overload name, its Python binding, keywords a call may pass)`` (see the module docstring)
_ENTRIES: list[tuple[str, Callable[..., Any], tuple[str, ...]]] = [
    ("aten::mul.Tensor", _VF.mul, ()), ("aten::add.Tensor", _VF.add, ("alpha",)),
    ("aten::sub.Tensor", _VF.sub, ("alpha",)), ("aten::div.Tensor", _VF.div, ()),
    ("aten::linear", _NN.linear, ()), ("aten::addmm", _VF.addmm, ("beta", "alpha")),
    ("aten::mm", _VF.mm, ()), ("aten::bmm", _VF.bmm, ()), ("aten::matmul", _VF.matmul, ()),
    ("aten::transpose.int", _VF.transpose, ()), ("aten::t", _VF.t, ()), ("aten::permute", _VF.permute, ()),
    ("aten::unsqueeze", _VF.unsqueeze, ()), ("aten::cat", _VF.cat, ()), ("aten::view", _TENSOR.view, ()),
    ("aten::reshape", _VF.reshape, ()), ("aten::expand", _TENSOR.expand, ("implicit",)),
    ("aten::clone", _VF.clone, ("memory_format",)),
    ("aten::pow.Tensor_Scalar", _VF.pow, ()), ("aten::mean.dim", _VF.mean, ("dtype",)),
    ("aten::rsqrt", _VF.rsqrt, ()), ("aten::neg", _VF.neg, ()), ("aten::tanh", _VF.tanh, ()),
    ("aten::silu", _NN.silu, ()), ("aten::softmax.int", _VF.softmax, ("dtype",)),
    ("aten::dropout", _VF.dropout, ()), ("aten::layer_norm", _VF.layer_norm, ()),
    ("aten::embedding", _VF.embedding, ()), ("aten::to.dtype", _TENSOR.to, ("memory_format",)),
    ("aten::detach_", _VF.detach_, ()),
]
#: ``{aten overload name: (Python binding, keywords a call may pass)}``
UNBOXED: dict[str, tuple[Callable[..., Any], frozenset[str]]] = {
    name: (binding, frozenset(keywords)) for name, binding, keywords in _ENTRIES}
#: positional arguments a binding takes, where fewer than its schema's (``Tensor.to`` takes
#: ``memory_format`` by keyword only)
_POSITIONAL = {"aten::to.dtype": 4}


def _overload(value: Any) -> Any:
    """An overload's operator handle when calling the overload only calls it, else the value."""
    if type(value) is OpOverload and type(value).__call__ is _PLAIN_CALL:
        return value._op
    return value


def _unboxed(value: Any) -> Any:
    """The overload's Python binding when :data:`UNBOXED` has it, else :func:`_overload`'s value."""
    handle = _overload(value)
    return UNBOXED[value.name()][0] if handle is not value and value.name() in UNBOXED else handle


def _fast_torch(overload: Callable[[Any], Any]) -> _Fallback:
    """``torch`` for generated code: ``ops`` resolves through namespaces, packets and ``overload``."""
    def packet(value: Any) -> Any:
        return _Fallback(value, overload) if isinstance(value, torch._ops.OpOverloadPacket) else value

    def namespace(value: Any) -> Any:
        return _Fallback(value, packet) if isinstance(value, torch._ops._OpNamespace) else value
    fast = _Fallback(torch, lambda value: value)
    fast.__dict__["ops"] = _Fallback(torch.ops, namespace)
    return fast


#: ``torch`` for generated code: overloads resolve to their handles
FAST_TORCH = _fast_torch(_overload)
#: as :data:`FAST_TORCH`, with the overloads of :data:`UNBOXED` resolved to their bindings
UNBOXED_TORCH = _fast_torch(_unboxed)


def bindings_fit(calls: Iterable[tuple[Any, tuple[Any, ...], dict[str, Any]]]) -> bool:
    """Whether every ``(target, args, kwargs)`` call of an :data:`UNBOXED` overload passes only
    the keywords its entry allows and no more positional arguments than its schema has (than its
    binding takes, where fewer): then the binding picks that overload for it."""
    for target, args, kwargs in calls:
        if type(target) is OpOverload and target.name() in UNBOXED:
            positional = _POSITIONAL.get(target.name(), sum(not a.kwarg_only for a in target._schema.arguments))
            if not kwargs.keys() <= UNBOXED[target.name()][1] or len(args) > positional:
                return False
    return True


def with_fast_ops(function: types.FunctionType, unboxed: bool = False) -> types.FunctionType:
    """``function`` (fx-generated code reading ``torch`` from its globals) with ``torch`` replaced
    by :data:`FAST_TORCH` (``unboxed``: :data:`UNBOXED_TORCH`, for code whose calls all pass
    :func:`bindings_fit`); other globals shared by value. Same code, defaults and closure."""
    if function.__globals__.get("torch") is not torch:
        return function
    fast = types.FunctionType(function.__code__, {**function.__globals__, "torch": UNBOXED_TORCH if unboxed else FAST_TORCH},
                              function.__name__, function.__defaults__, function.__closure__)
    fast.__kwdefaults__ = function.__kwdefaults__
    return fast

