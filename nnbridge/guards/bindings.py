"""Bindings: the lookups a model's code made, each as ``(where, namespace, name, value)``, and the
namespaces such a lookup reads besides a dict or a class's attributes.

A binding says that ``namespace.get(name)`` was ``value`` when the code was walked
(:mod:`.code_walk`); ``value`` is :data:`MISSING` where the namespace must not hold the name (a
class earlier in an MRO than the one defining a method). :class:`~.code_check.CodeCheck` tells
whether each lookup still finds the same object, and :mod:`.global_state` watches and restores
the bindings that hold plain values. A namespace is any object with ``get``, ``[]`` and ``in``: a
module's globals, a class's ``vars()``, an object's ``__dict__``, a registry of functions, or one
of the adapters here (a function's own parts, its closure cells, a list's items, an object's
attributes, ``os.environ``, a context variable).

*State* is not kept here: every namespace is read afresh on each lookup.
"""

from __future__ import annotations

import contextvars
import os
import sys
import types
from typing import Any

#: A binding's value where the namespace must not hold the name.
MISSING: Any = object()
#: ``(where, namespace, name, value)``: ``namespace.get(name)`` was ``value`` when walked.
Binding = tuple[str, Any, Any, Any]
#: The attributes of a function that decide what calling it computes, besides its globals and closure.
FUNCTION_PARTS = ("__code__", "__defaults__", "__kwdefaults__")


class FunctionParts:
    """A function's :data:`FUNCTION_PARTS` as a binding's namespace (``get``, ``[]``, ``in``), so
    that ``f.__defaults__ = (5.0,)`` after bridging is a replacement like any other lookup."""

    __slots__ = ("function",)

    def __init__(self, function: types.FunctionType):
        self.function = function

    def __getitem__(self, name: str) -> Any:
        return getattr(self.function, name)

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self.function, name, default)

    def __contains__(self, name: str) -> bool:
        return name in FUNCTION_PARTS


class ClosureCells:
    """A function's closure cells as a binding's namespace, by the names of its free variables:
    ``["n"]`` is what the cell of ``n`` holds now, and ``["n"] = value`` assigns it (as
    ``nonlocal n; n = value`` does). An empty cell is not ``in`` it."""

    __slots__ = ("cells",)

    def __init__(self, function: types.FunctionType):
        self.cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))

    def __getitem__(self, name: str) -> Any:
        return self.cells[name].cell_contents

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self.cells[name].cell_contents
        except (KeyError, ValueError):  # not a free variable, or an empty cell
            return default

    def __contains__(self, name: str) -> bool:
        return self.get(name, MISSING) is not MISSING

    def __setitem__(self, name: str, value: Any) -> None:
        self.cells[name].cell_contents = value


class SequenceItems:
    """A list or tuple a global holds as a binding's namespace, by index: ``[i]`` is what it holds
    at index ``i`` now (:data:`MISSING` past its end, so a list emptied since is a change, not an
    error), and ``[i] = value`` assigns it in a list (as :class:`~.global_state.GlobalValues` puts items back)."""

    __slots__ = ("sequence",)

    def __init__(self, sequence: list[Any] | tuple[Any, ...]):
        self.sequence = sequence

    def __getitem__(self, index: int) -> Any:
        return self.sequence[index] if -len(self.sequence) <= index < len(self.sequence) else MISSING

    def get(self, index: int, default: Any = None) -> Any:
        return self[index]

    def __contains__(self, index: int) -> bool:
        return self[index] is not MISSING

    def __setitem__(self, index: int, value: Any) -> None:
        self.sequence[index] = value  # type: ignore[index]  # (a tuple's items are never replaced)


class Attributes:
    """An object's attributes as a binding's namespace (``get``, ``[]``, ``in``, ``[] =``, ``pop``,
    read and written by ``getattr``/``setattr``/``delattr``): ``["keywords"]`` of a
    ``functools.partial`` is the dict of keyword arguments it binds now, ``["scale"]`` of an object
    with ``__slots__`` its slot."""

    __slots__ = ("owner",)

    def __init__(self, owner: Any):
        self.owner = owner

    def __getitem__(self, name: str) -> Any:
        return getattr(self.owner, name)

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self.owner, name, default)

    def __contains__(self, name: str) -> bool:
        return hasattr(self.owner, name)

    def __setitem__(self, name: str, value: Any) -> None:
        setattr(self.owner, name, value)

    def pop(self, name: str, default: Any = None) -> Any:
        value = getattr(self.owner, name, default)
        if hasattr(self.owner, name):
            delattr(self.owner, name)
        return value


class _Environment:
    """``os.environ`` as a binding's namespace: a variable's value interned (``sys.intern``), so
    that an unchanged value is the same object (``os.environ.get`` decodes a new string each time)
    and a set, changed or deleted variable is another one (None when unset)."""

    __slots__ = ()

    def __getitem__(self, name: str) -> str | None:
        value = os.environ.get(name)
        return None if value is None else sys.intern(value)

    def get(self, name: str, default: Any = None) -> str | None:
        return self[name]

    def __contains__(self, name: str) -> bool:
        return name in os.environ


ENVIRONMENT = _Environment()


class ContextValue:
    """A ``contextvars.ContextVar`` as a binding's namespace: ``["value"]`` is its value in the
    current context (:data:`MISSING` when unset)."""

    __slots__ = ("var",)

    def __init__(self, var: contextvars.ContextVar[Any]):
        self.var = var

    def __getitem__(self, name: str) -> Any:
        return self.var.get(MISSING)

    def get(self, name: str, default: Any = None) -> Any:
        return self.var.get(MISSING)

    def __contains__(self, name: str) -> bool:
        return True
