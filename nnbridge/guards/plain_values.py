"""Plain values: what a graph bakes in by value, so guards compare it and cache keys hold it.

A plain value is a scalar (number, bool, string, bytes, None, enum, dtype, device) or a tuple,
list, ``deque``, ``array``, ``bytearray``, set or dict (any depth) of them holding at most :data:`MAX_PLAIN_ITEMS` scalars:
``self.temperature``, ``self.window_sizes = [4, 8]``, ``config.layer_types``,
``config.rope_parameters``. A module attribute's container may also hold tensors
(``self.masks = [m0, m1]``), which export bakes in as constants. :func:`snapshot` copies
containers (so a write into one is seen; a tensor becomes a :class:`HeldTensor`) and
:func:`canonical_repr` is ``repr`` with set elements sorted and tensors by a hash of their values
(the same text in every process).

Example::

    plain_value([1, 2.0, "a"])                 # True
    plain_value([torch.zeros(1)])              # False
    plain_value([torch.zeros(1)], tensors=True)  # True
    canonical_repr({"b", "a"})                 # "set(['a', 'b'])" in every process

*State* is not kept here: these are the comparisons and copies the guards use for the plain
values in module state (:mod:`.module_state`), global state (:mod:`.global_state`) and held
objects (:mod:`.held_objects`).
"""

from __future__ import annotations

import argparse
import array
import collections
import collections.abc
import copy
import dataclasses
import enum
import hashlib
import types
from typing import Any

import torch

from ..compat.torch.capture import tensor_version

PLAIN_TYPES = (int, float, bool, str, bytes, type(None), enum.Enum, torch.dtype, torch.device)
#: the sequences a plain value may be (the standard library's: a ``deque`` or ``array`` of step
#: sizes is read by index as a list is)
_SEQUENCES = (tuple, list, collections.deque, array.array, bytearray)
#: the most scalars a container value may hold to be plain (a larger one is not compared on each call)
MAX_PLAIN_ITEMS = 1024


def plain_value(value: object, tensors: bool = False) -> bool:
    """Whether ``value`` is a plain value (see the module docstring); with ``tensors``, a
    container may also hold tensors (``self.masks = [m0, m1]``: export bakes them in as constants)."""
    if isinstance(value, PLAIN_TYPES):
        return True
    budget = [MAX_PLAIN_ITEMS]

    def walk(item: object, tensor_ok: bool) -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            return False
        if isinstance(item, PLAIN_TYPES) or (tensor_ok and isinstance(item, torch.Tensor)):
            return True
        if isinstance(item, _SEQUENCES):
            return all(walk(v, tensor_ok) for v in item)
        if isinstance(item, (set, frozenset)):  # (a set's tensors would count by identity only)
            return all(walk(v, False) for v in item)
        if isinstance(item, dict):
            return all(walk(k, False) and walk(v, tensor_ok) for k, v in item.items())
        return False
    return isinstance(value, (*_SEQUENCES, set, frozenset, dict)) and walk(value, tensors)


class HeldTensor:
    """A tensor inside a container value, as a guard keeps it: equal to the very same tensor with
    the same in-place version, dtype, device, shape and requires_grad (export baked its values in
    as a constant, a parameter's too, so a tensor assigned anew or written in place must extract
    again; one requiring grad makes its module run eagerly, see ``nnbridge.extract.capture_watch``)."""

    __slots__ = ("tensor", "version", "properties")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.version, self.properties = tensor, tensor_version(tensor), _properties(tensor)

    def __eq__(self, other: object) -> bool:
        return other is self.tensor and tensor_version(other) == self.version and _properties(other) == self.properties

    def __repr__(self) -> str:
        return f"tensor(shape={tuple(self.tensor.shape)}, dtype={self.tensor.dtype}, version={self.version})"


def _properties(tensor: torch.Tensor) -> tuple[object, ...]:
    return tensor.dtype, tensor.device, tensor.shape, tensor.requires_grad


def snapshot(value: object) -> object:
    """A plain ``value`` as a guard keeps it: a container is copied, so that writing into it
    (``m.sizes[1] = 3``, ``config.rope_parameters["factor"] = 2.0``) is seen as a change; a tensor
    in it becomes a :class:`HeldTensor`."""
    if isinstance(value, PLAIN_TYPES):
        return value
    if isinstance(value, torch.Tensor):
        return HeldTensor(value)
    if isinstance(value, dict):  # the same type (a subclass too), entries replaced
        copied_dict = copy.copy(value)
        for key, item in value.items():
            copied_dict[key] = snapshot(item)
        return copied_dict
    if isinstance(value, list):
        copied_list = copy.copy(value)
        copied_list[:] = [snapshot(item) for item in value]
        return copied_list
    if isinstance(value, collections.deque):
        return collections.deque(map(snapshot, value), value.maxlen)
    if isinstance(value, tuple):
        items = [snapshot(item) for item in value]
        kind: Any = type(value)
        return kind(*items) if hasattr(kind, "_fields") else kind(items)  # a NamedTuple takes its fields
    if isinstance(value, (set, frozenset, array.array, bytearray)):
        return copy.deepcopy(value)  # a set or an array of plain values, a bytearray
    # (anything else by identity: a symbolic number export's code appended, ``x.sum().item()``,
    # cannot be copied, and differs from every plain value it is compared with)
    return value


def canonical_repr(value: object) -> str:
    """``repr(value)`` of a plain value with set elements sorted: a set of strings repr's in an
    order that differs between processes (string hashes are salted), and keys made of it must not;
    a tensor in it by :func:`tensor_digest`."""
    if isinstance(value, torch.Tensor):
        return tensor_digest(value)
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({sorted(map(canonical_repr, value))})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{canonical_repr(k)}: {canonical_repr(v)}" for k, v in value.items()) + "}"
    if isinstance(value, _SEQUENCES):
        return f"{type(value).__name__}([{', '.join(map(canonical_repr, value))}])"
    return repr(value)


def tensor_digest(tensor: torch.Tensor) -> str:
    """dtype, shape and sha256 of a tensor's values; one too large to hash (over
    :data:`HASH_LIMIT` bytes) or without readable values counts by its identity (never the same
    in another process: a disk cache misses)."""
    head = f"tensor {tensor.dtype} {tuple(tensor.shape)}"
    try:
        if tensor.numel() * tensor.element_size() > HASH_LIMIT:
            raise ValueError("too large")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    except Exception:  # noqa: BLE001 - a tensor whose values cannot be read here
        return f"{head} id {id(tensor)}"
    return f"{head} {hashlib.sha256(data).hexdigest()}"


#: Tensors larger than this (bytes) are not hashed (see :func:`tensor_digest`).
HASH_LIMIT = 1 << 24


def class_values(cls: type) -> dict[str, object]:
    """The plain class attributes a module of class ``cls`` finds (``cls.gain``, a base class's
    ``offsets = [0.0, 1.0]``), as resolved through its MRO up to ``torch.nn.Module`` (whose own,
    and dunder names, are left out): ``{name: value}``, the values themselves (not copies)."""
    names: set[str] = set()
    for owner in cls.__mro__:
        if owner in (torch.nn.Module, object):
            break
        names.update(name for name, value in vars(owner).items()
                     if not (name.startswith("__") and name.endswith("__")) and plain_value(value, tensors=True))
    found = {name: getattr(cls, name) for name in sorted(names)}
    # (a plain value a subclass overrides with a method or property is not one)
    return {name: value for name, value in found.items() if plain_value(value, tensors=True)}


def config_like(name: str, value: object) -> bool:
    """A transformers ``PretrainedConfig`` or a look-alike: an object with ``to_dict``, a
    ``SimpleNamespace``, an ``argparse.Namespace`` (``self.args = args``), a dataclass instance
    (``self.settings = Settings(scale=2.0)``), or any plain object held as ``config``."""
    if isinstance(value, (type, torch.nn.Module, torch.Tensor)) or not hasattr(value, "__dict__") or callable(value):
        return False
    return (hasattr(value, "to_dict") or isinstance(value, (types.SimpleNamespace, argparse.Namespace))
            or dataclasses.is_dataclass(value) or name == "config")


#: The most bytes of one array (:func:`writable_array`) a snapshot copies.
ARRAY_LIMIT = 1 << 24
#: Mutable containers (``array.array``, ``bytearray``, a ``deque``), copied item by item, never as arrays.
_MUTABLE = (collections.abc.MutableSequence, collections.abc.MutableMapping, collections.abc.MutableSet)


def writable_array(value: Any) -> memoryview | None:
    """A writable, C-contiguous view of the bytes of an object other than a container that exposes
    the buffer protocol (a numpy array, a ``ctypes`` array) of at most :data:`ARRAY_LIMIT` bytes;
    None for anything else (a tensor, ``bytes``, a read-only or strided buffer, a larger one, an
    array of Python objects)."""
    if isinstance(value, (torch.Tensor, str, bytes, bytearray, memoryview, list, dict, set, int, float, complex,
                          type(None), *_MUTABLE)):
        return None
    try:
        view = memoryview(value)
    except (TypeError, ValueError, BufferError):
        return None
    # (an array of Python objects holds pointers: writing its bytes back would skip their reference counts)
    if view.readonly or not view.c_contiguous or view.nbytes > ARRAY_LIMIT or "O" in view.format:
        return None
    return view.cast("B")


def array_bytes(value: Any) -> bytes | None:
    """The bytes of an array (:func:`writable_array`), None for anything else."""
    view = writable_array(value)
    return None if view is None else view.tobytes()


def put_back_array(value: Any, saved: bytes) -> None:
    """Write ``saved`` (:func:`array_bytes` of ``value`` earlier) back into the array ``value``
    when its bytes differ (one grown or made read-only since is left as it is)."""
    view = writable_array(value)
    if view is not None and view.nbytes == len(saved) and view != saved:
        view[:] = saved


def array_digest(value: Any) -> str:
    """The type, byte count and sha256 of the bytes of an array (:func:`writable_array`); one too
    large counts by its identity (never the same in another process: a disk cache misses)."""
    view = writable_array(value)
    head = f"array {type(value).__module__}.{type(value).__qualname__} {getattr(value, 'dtype', '')}" \
        f" {tuple(getattr(value, 'shape', ()))}"
    if view is None:
        return f"{head} id {id(value)}"
    return f"{head} {hashlib.sha256(view).hexdigest()}"
