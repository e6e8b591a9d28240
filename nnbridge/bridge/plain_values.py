"""Plain values: what a graph bakes in by value, so guards compare it and cache keys hold it.

A plain value is a scalar (number, bool, string, bytes, None, enum, dtype, device) or a tuple,
list, set or dict (any depth) of them holding at most :data:`MAX_PLAIN_ITEMS` scalars:
``self.temperature``, ``self.window_sizes = [4, 8]``, ``config.layer_types``,
``config.rope_parameters``. :func:`snapshot` copies containers (so a write into one is seen) and
:func:`canonical_repr` is ``repr`` with set elements sorted (the same text in every process).

Example::

    plain_value([1, 2.0, "a"])                 # True
    plain_value([torch.zeros(1)])              # False
    canonical_repr({"b", "a"})                 # "set(['a', 'b'])" in every process
"""

from __future__ import annotations

import copy
import enum

import torch

PLAIN_TYPES = (int, float, bool, str, bytes, type(None), enum.Enum, torch.dtype, torch.device)
#: the most scalars a container value may hold to be plain (a larger one is not compared on each call)
MAX_PLAIN_ITEMS = 1024


def plain_value(value: object) -> bool:
    """Whether ``value`` is a plain value (see the module docstring)."""
    if isinstance(value, PLAIN_TYPES):
        return True
    budget = [MAX_PLAIN_ITEMS]

    def walk(item: object) -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            return False
        if isinstance(item, PLAIN_TYPES):
            return True
        if isinstance(item, (tuple, list, set, frozenset)):
            return all(map(walk, item))
        if isinstance(item, dict):
            return all(walk(k) and walk(v) for k, v in item.items())
        return False
    return walk(value)


def snapshot(value: object) -> object:
    """A plain ``value`` as a guard keeps it: a container is copied, so that writing into it
    (``m.sizes[1] = 3``, ``config.rope_parameters["factor"] = 2.0``) is seen as a change."""
    return value if isinstance(value, PLAIN_TYPES) else copy.deepcopy(value)


def canonical_repr(value: object) -> str:
    """``repr(value)`` of a plain value with set elements sorted: a set of strings repr's in an
    order that differs between processes (string hashes are salted), and keys made of it must not."""
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({sorted(map(canonical_repr, value))})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{canonical_repr(k)}: {canonical_repr(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}([{', '.join(map(canonical_repr, value))}])"
    return repr(value)
