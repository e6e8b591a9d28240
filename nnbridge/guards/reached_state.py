"""State a module reaches through its attributes: the mutable containers nested inside an
attribute's value (``self.log = [[]]``, ``self.seen = {"ids": set()}``, a ``deque`` in a list),
the attribute dicts of the plain objects and configs found there (``self.ns.items``), the
tensors and random generator objects (:mod:`.rng_objects`) held anywhere inside them, and arrays
held as attributes or inside them (``self.counts = np.zeros(8)``, ``self.counts += ...``: any
writable object with the buffer protocol, compared and put back by its bytes).

Extraction's own runs must leave such state as it was, and a forward that writes it must run its
own code (a graph never appends to ``self.log[0]``). :class:`~.preservation.ModuleState` keeps a
shallow copy of each attribute; :func:`reached` gives it everything one level further in, at any
depth, so the snapshot compares and puts back each container reached in place (by the identity
of its items, as for the attribute itself).

The walk goes through lists, tuples, dicts, sets, ``deque``\\ s and any other ``MutableSequence``,
``MutableMapping`` or ``MutableSet``, the arguments a ``functools.partial`` binds, the receiver of
a bound method (``self.add = log.append``), and through the ``__dict__`` of config-like and other held
objects (:func:`~.plain_values.config_like`, :func:`~.held_objects.held_object`); it stops at
modules, tensors, arrays, functions, classes and plain values. Each object is reached once per ``seen``
set (a config shared by every layer is walked once per snapshot), and at most :data:`LIMIT`
objects are reached from one module: state beyond that is watched by the repeat check only
(:mod:`nnbridge.extract.repeat_check`).
"""

from __future__ import annotations

import functools
import itertools
import types
from collections.abc import Iterator, Mapping, MutableMapping, MutableSequence, MutableSet, Sequence, Set as AbstractSet
from typing import Any, NamedTuple

import torch

from .held_objects import held_object
from .plain_values import config_like, writable_array
from .rng_objects import generator_state

#: Containers copied by their own type (others as a list, dict or set, see :func:`copy_container`).
_CONTAINERS = (list, dict, set)
#: Values the walk stops at without looking further.
_ATOMS = frozenset({bool, int, float, complex, str, bytes, type(None)})
#: Bound methods, Python's and built-in ones, whose receiver the walk goes through.
_BOUND = (types.MethodType, types.BuiltinMethodType)
#: The most objects (containers, objects, tensors) the walk reaches from one module's attributes.
LIMIT = 4096


class Reached(NamedTuple):
    """One object reached inside attribute ``name``: ``where`` it is (``"log[0]"``,
    ``"ns.items"``) and the object: a mutable container, a held object's ``__dict__``, a tensor, a
    random generator object or an array (:func:`~.plain_values.writable_array`)."""

    name: str
    where: str
    value: Any


def copy_container(value: Any) -> Any:
    """A shallow copy, as a list, dict or set, of a mutable container (any ``MutableSequence``,
    ``MutableMapping`` or ``MutableSet``: a ``deque`` history, an ``OrderedDict``); None otherwise."""
    if type(value) in _CONTAINERS:
        return type(value)(value)
    if isinstance(value, MutableMapping):
        return dict(value)
    if isinstance(value, MutableSet):
        return set(value)
    return list(value) if isinstance(value, MutableSequence) else None


def put_back(value: Any, copied: Any) -> None:
    """Give the container ``value`` the items of its copy ``copied`` (see :func:`copy_container`), in
    place (a ``deque`` keeps its ``maxlen``), through the abstract methods of its ABC only (a
    registered ``array.array`` has no ``clear``)."""
    if isinstance(value, MutableMapping):
        for key in list(value):
            del value[key]
        for key, item in copied.items():
            value[key] = item
    elif isinstance(value, MutableSet):
        for item in list(value):
            value.discard(item)
        for item in copied:
            value.add(item)
    else:
        while len(value):
            value.pop()
        for item in copied:
            value.append(item)


def _same_item(a: Any, b: Any) -> bool:
    # (an ``array.array`` boxes a new number on each read: numbers compare by value)
    return a is b or (type(a) is type(b) and type(a) in (int, float, complex, bool) and a == b)


def same_container(value: Any, copied: Any) -> bool:
    """Whether the container ``value`` holds the same items as its copy ``copied`` (see
    :func:`copy_container`): the same objects (numbers equal), under the same keys, in order."""
    if len(value) != len(copied):
        return False
    if isinstance(value, Mapping):
        return value.keys() == copied.keys() and all(_same_item(value[k], copied[k]) for k in value)
    if isinstance(value, AbstractSet):
        return value == copied
    return all(_same_item(a, b) for a, b in zip(value, copied))


def _through(value: Any) -> bool:
    """A value the walk goes through without copying it: an immutable container (a tuple, a
    frozenset, a ``MappingProxyType``), a ``functools.partial`` (its bound arguments:
    ``functools.partial(list.append, log)``) or a bound method (its receiver: ``self.add = log.append``)."""
    return isinstance(value, (Mapping, Sequence, AbstractSet, functools.partial, *_BOUND)) \
        and not isinstance(value, (str, bytes, bytearray, memoryview, range))


def mutable(value: Any) -> bool:
    """Whether ``value`` is a mutable container :func:`copy_container` copies."""
    return isinstance(value, (list, dict, set, MutableSequence, MutableMapping, MutableSet))


def _items(value: Any) -> Iterator[tuple[str, Any]]:
    """``(suffix, item)`` of a container's items or an object's attributes, lazily (the walk takes
    no more than its limit: a module holding a long list pays for that many items only)."""
    if isinstance(value, (str, bytes, bytearray, memoryview)):
        return iter(())
    if isinstance(value, functools.partial):
        return itertools.chain(((f".args[{index}]", item) for index, item in enumerate(value.args)),
                               ((f".keywords[{key!r}]", item) for key, item in list(value.keywords.items())))
    if isinstance(value, _BOUND):
        return iter([(".__self__", value.__self__)])
    if isinstance(value, Mapping):
        return ((f"[{key!r}]", item) for key, item in value.items())
    if isinstance(value, (AbstractSet, Sequence, MutableSequence, MutableSet)):
        return ((f"[{index}]", item) for index, item in enumerate(value))
    own = getattr(value, "__dict__", None)
    return ((f".{key}", item) for key, item in own.items() if type(key) is str) if isinstance(own, dict) \
        else iter(())


def _object(value: Any, name: str = "") -> bool:
    """A config-like or held object whose ``__dict__`` is followed (``name``: the attribute holding
    it, for a module's own attributes: another library's bookkeeping, such as accelerate's hook, is
    no held object)."""
    return isinstance(getattr(value, "__dict__", None), dict) and (config_like(name, value)
                                                                   or held_object(name, value))


def reached(attributes: list[tuple[str, Any]], seen: set[int]) -> list[Reached]:
    """The containers, object ``__dict__``\\ s, tensors, random generator objects and arrays
    inside the values of ``attributes`` (``(name, value)`` pairs: a module's own attributes), not
    the values themselves, each once (ids in ``seen`` are skipped, and those reached are added). An
    array (:func:`~.plain_values.writable_array`) and a held object's ``__dict__`` are given for an attribute's
    value itself too; a config's ``__dict__`` is not (:class:`~.preservation.ModuleState` copies
    a config attribute's ``__dict__`` already)."""
    found: list[Reached] = []
    stack: list[tuple[str, str, Any]] = []
    for name, value in attributes:
        if type(value) in _ATOMS or isinstance(value, (torch.Tensor, torch.nn.Module)):
            continue
        if mutable(value) or _through(value):
            stack.append((name, name, value))
        elif writable_array(value) is not None and id(value) not in seen:
            seen.add(id(value))
            found.append(Reached(name, name, value))
        elif _object(value, name) and id(value) not in seen:
            seen.add(id(value))
            if not config_like(name, value) and held_object(name, value):
                found.append(Reached(name, f"{name}.__dict__", vars(value)))
            stack.append((name, name, value))
    budget = LIMIT
    while stack and budget > 0:
        name, where, value = stack.pop()
        try:  # (a mapping whose items cannot be listed, as its keys read back, is not walked)
            items = list(itertools.islice(_items(value), budget))
        except Exception:  # noqa: BLE001 - another library's container, whatever it raises
            continue
        for suffix, item in items:
            budget -= 1
            if type(item) in _ATOMS or id(item) in seen or isinstance(item, torch.nn.Module):
                continue
            inner = f"{where}{suffix}"
            if isinstance(item, torch.Tensor) or generator_state(item) is not None:
                seen.add(id(item))
                found.append(Reached(name, inner, item))
            elif mutable(item):
                seen.add(id(item))
                found.append(Reached(name, inner, item))
                stack.append((name, inner, item))
            elif _through(item):
                seen.add(id(item))
                stack.append((name, inner, item))
            elif _object(item):
                seen.add(id(item))
                found.append(Reached(name, f"{inner}.__dict__", vars(item)))
                stack.append((name, inner, item))
            elif writable_array(item) is not None:
                seen.add(id(item))
                found.append(Reached(name, inner, item))
    return found
