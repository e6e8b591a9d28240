"""Held objects: the objects a module keeps as attributes that no other guard covers (an instance
of a plain class, a callable object, a numpy scalar, an object with ``__slots__``), and how the
code walk follows them.

A graph bakes in what the code read from such an object (``self.hp.scale``) as it was when
extracted. :func:`held_object` tells which attributes hold one; :func:`follow_held` follows them
through the attribute names the reached code reads (the names in its bytecode and its string
constants): each object counts by identity on its holder, its class's methods are walked like a
module class's (a callable object's ``__call__``), each attribute read is a binding (a plain value
by identity, in the digest by value; a tensor by identity and version, in the digest by its values:
export bakes it into the graph as a constant; a nested object followed in turn), and each name read that
the object lacks is guarded absent (a class attribute it could shadow, a ``getattr`` default).

The same walk by names reads a module attribute holding a container of other values
(``self.tables = {"a": np.ones(4)}``, a ``deque`` of arrays: item by item, as a global container,
:meth:`~.code_walk.CodeWalk.read_value`), the tensors, arrays and such containers of a config-like
attribute (``self.ns.table``; its plain values are module state), and the globals of a module of
the user's code that code reads through it (``settings.SCALE``,
:func:`~.code_objects.own_module`), as a function's globals.

*State* here means a held object's attributes: the entries of its ``__dict__`` and its
``__slots__`` values, read when walked and compared by identity afterwards
(:class:`~.code_check.CodeCheck`). Module attributes holding plain values, configs' plain values
and tensors are *module state* (:mod:`.module_state`), not held objects.
"""

from __future__ import annotations

import contextvars
import types
from typing import Any

import torch

from ..compat.accelerate import ACCELERATE_ATTRIBUTES
from ..compat.nnsight.source import NNSIGHT_STATE
from .bindings import MISSING, Attributes
from .code_objects import (
    BUILTINS,
    CODE_HOLDERS,
    CONTAINERS,
    PLAIN_READ,
    PLAIN_READ_TYPES,
    data_container,
    is_plumbing,
    own_module,
    versioned,
    wrapper_of,
)
from .code_walk import CodeWalk
from .plain_values import array_digest, canonical_repr, config_like, plain_value, writable_array
from .rng_objects import generator_state

#: Module attributes that are another library's or torch's bookkeeping, never followed as held objects.
_NOT_HELD = frozenset({NNSIGHT_STATE}) | ACCELERATE_ATTRIBUTES
#: The most attributes of one held object followed (a larger one counts by identity only).
_ATTRIBUTE_LIMIT = 256


def held_object(name: str, value: Any) -> bool:
    """Whether a module's attribute ``name`` holds an object whose attributes its code may read
    and that no other guard covers: an instance of any class (a plain class, a callable object, a
    numpy scalar) that is not a module, tensor, class, function, built-in, Python module, plain
    value or container of them (:class:`~.module_state.StateGuard` guards those by value), nor a
    config (guarded by value with its nested configs), nor a random generator object (module
    state, see :mod:`.preservation`), nor nnbridge's or nnsight's own plumbing."""
    if name in _NOT_HELD or (name.startswith("__") and name.endswith("__")):
        return False
    if isinstance(value, (type, types.ModuleType, torch.nn.Module, torch.Tensor, *CODE_HOLDERS, *BUILTINS,
                          *PLAIN_READ_TYPES, contextvars.ContextVar)):
        return False
    if isinstance(value, CONTAINERS) or is_plumbing(value) or is_plumbing(type(value)) or wrapper_of(value) is not None:
        return False  # (a wrapper object, such as a functools.lru_cache one, is followed as code)
    if generator_state(value) is not None:
        return False  # a random generator object: its state is module state (see .preservation)
    return not config_like(name, value)


def _attributes(value: Any) -> list[tuple[str, Any]]:
    """A held object's attributes: its ``__dict__``'s items and its ``__slots__``' values (dunder
    names left out), none when it has more than :data:`_ATTRIBUTE_LIMIT`."""
    found: list[tuple[str, Any]] = []
    own = getattr(value, "__dict__", None)
    if isinstance(own, dict):
        found.extend(own.items())
    for owner in type(value).__mro__:
        for slot in vars(owner).get("__slots__", ()) if isinstance(vars(owner).get("__slots__", ()), (tuple, list)) else ():
            if slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                found.append((slot, getattr(value, slot)))
    if len(found) > _ATTRIBUTE_LIMIT:
        return []
    return [(name, item) for name, item in found if type(name) is str and not (name.startswith("__") and name.endswith("__"))]


def _namespace(value: Any) -> Any:
    """Where a binding looks up a held object's attribute: its ``__dict__``, else the object itself
    (its slots, read by ``getattr``)."""
    own = getattr(value, "__dict__", None)
    return own if isinstance(own, dict) else Attributes(value)


def _held_text(value: Any) -> str:
    """A held object's part of the digest: a plain value by value, an object by its class (its
    attributes are entries of their own), an array by its bytes (:func:`~.plain_values.array_digest`),
    one without attributes by ``repr`` when its class defines one (a numpy scalar), else by identity
    (never the same in another process)."""
    if type(value) in PLAIN_READ or isinstance(value, torch.Tensor) or (
            isinstance(value, CONTAINERS) and plain_value(value, tensors=True)):
        return canonical_repr(value)
    if writable_array(value) is not None:  # (a numpy array: its ``repr`` elides the middle of a long one)
        return array_digest(value)
    kind = type(value)
    if isinstance(getattr(value, "__dict__", None), dict) or any("__slots__" in vars(c) for c in kind.__mro__[:-1]):
        return f"{kind.__module__}.{kind.__qualname__}"
    if kind.__repr__ is not object.__repr__:
        return f"{kind.__module__}.{kind.__qualname__} {value!r}"
    return f"{kind.__module__}.{kind.__qualname__} id {id(value)}"


def _config_data(name: str, value: Any) -> bool:
    """Whether a config's attribute ``name`` holds what module state does not guard by value: a
    tensor, an array, a container of other values, a nested config (followed in turn)."""
    return isinstance(value, torch.Tensor) or writable_array(value) is not None or config_like(name, value) or (
        data_container(value) and not plain_value(value, tensors=True))


def _standard_library(module: types.ModuleType) -> bool:
    return versioned(module.__name__) and module.__name__.split(".")[0] != "torch"


def _library_global(walk: CodeWalk, module: types.ModuleType, name: str) -> None:
    """A public callable or module of a library's module (torch's, an installed package's) the
    code reads through it, by identity: ``torch.nn.functional.silu`` read as ``F.silu`` and
    replaced after bridging (a wrapper that records or scales attention) is a change; a module
    read so (``torch.nn`` of ``torch.nn.functional``) is followed in turn. Private names are left
    out (nnbridge's own tracing patches some while it extracts), as are data (a library's
    constants and tables) and the standard library's modules (``os.path``, ``importlib``: read by
    transformers' checks of what is installed, not what a model computes with)."""
    value = vars(module)[name]
    if name.startswith("_") or not (isinstance(value, types.ModuleType) or callable(value)) \
            or _standard_library(module):
        return
    binding = (f"{module.__name__}.{name}", vars(module), name, value)
    walk.identity(binding)
    if isinstance(value, types.ModuleType):
        walk.modules.setdefault(id(value), value)


def follow_held(walk: CodeWalk) -> None:
    """Follow the objects modules hold (``walk.objects``, see :func:`held_object`) through the
    attribute names the code reached reads, to a fixed point: each object read is a binding by
    identity on its holder (an object assigned anew re-extracts), its class's methods are walked
    like a module class's (a callable object's ``__call__``), and each of its attributes whose
    name the code reads is a binding too: a plain value by identity (``m.hp.scale = 2.0``
    re-extracts) and in the digest by value, a tensor by identity and version
    (``m.steering.vector.mul_(2)`` re-extracts) and in the digest by its values, another object
    followed in turn. What was read is
    decided by name (the names of every code object reached), so an attribute read under another
    name (``getattr(self.hp, name)``) is not followed. Containers, configs and the user's modules
    are read as the module docstring says."""
    done: set[tuple[int, Any]] = set()
    followed: list[tuple[str, Any]] = []
    while True:
        ready = [item for item in walk.objects
                 if (id(item[1]), item[2]) not in done and (item[2] in walk.names or type(item[2]) is not str)]
        # the globals of the user's modules the code reads through them (``settings.SCALE``), read
        # as a function's globals are (:meth:`~.code_walk.CodeWalk.read_global`)
        globals_read = [(module, name) for module in list(walk.modules.values()) for name in list(vars(module))
                        if name in walk.names and (id(module), name) not in done]
        for module, name in globals_read:
            done.add((id(module), name))
            if own_module(module):
                reached: list[Any] = []
                walk.read_global(vars(module), name, module=module.__name__, found=reached)
                walk.todo.extend(reversed(reached))
            else:
                _library_global(walk, module, name)
        walk.run()
        if not ready and not globals_read:
            break
        for where, namespace, name, value in ready:
            done.add((id(namespace), name))
            if data_container(value) and not plain_value(value, tensors=True):
                # a container of other values (``self.tables = {"a": np.ones(4)}``): its items read
                # as a global container's are (:meth:`~.code_walk.CodeWalk.read_value`)
                found: list[Any] = []
                walk.read_value((where, namespace, name, value), found)
                walk.todo.extend(found)
                walk.run()
                continue
            if config_like(str(name), value):
                # a config (module state guards its plain values and nested configs): the tensors,
                # arrays and containers of other values it holds, followed by the names code reads
                if walk.first_visit(value):
                    attributes = _namespace(value)
                    walk.objects.extend((f"{where}.{attribute}", attributes, attribute, item)
                                        for attribute, item in _attributes(value)
                                        if _config_data(attribute, item))
                continue
            walk.entries.append((where, _held_text(value)))
            walk.bindings.append((where, namespace, name, value))
            if not held_object(str(name), value) or not walk.first_visit(value):
                continue  # a plain value, or an object already followed
            walk.cls(type(value))
            walk.run()
            followed.append((where, value))
            attributes = _namespace(value)
            for attribute, item in _attributes(value):
                # (a random generator object it holds: watched and put back as a global's is, see .global_state)
                if held_object(attribute, item) or type(item) in PLAIN_READ or isinstance(item, torch.Tensor) or (
                        isinstance(item, CONTAINERS) and plain_value(item, tensors=True)) \
                        or generator_state(item) is not None or data_container(item):
                    walk.objects.append((f"{where}.{attribute}", attributes, attribute, item))
    # a name the code reads that an object does not hold (a class attribute read through it,
    # ``self.hp.offset``; a ``getattr(obj, "bias", 0.0)`` default): the object must not get one
    # of its own later (``m.hp.offset = 1.5`` shadows the class's)
    read = sorted(name for name in walk.names if not (name.startswith("__") and name.endswith("__")))
    for where, value in followed:
        own = getattr(value, "__dict__", None)
        if isinstance(own, dict):
            walk.bindings.extend((f"{where}.{name}", own, name, MISSING) for name in read if name not in own)
