"""Functions as the code walk reads them: what one function's compiled code is (its digest), which
names and constants it reads, and whose code is followed at all.

A function counts by its qualified name, module and compiled code (bytecode, names and constants,
nested code objects included, :func:`function_digest`) and by its default argument values
(:func:`defaults_text`). Torch's, the standard library's and built-in code is not followed
(:func:`versioned`: their versions are part of the disk-cache key), nor nnbridge's and nnsight's
own functions set on modules (:func:`is_plumbing`). The value kinds the walk tells apart
(:data:`PLAIN_READ_TYPES`, :data:`CODE_HOLDERS`, :data:`CONTAINERS`, :func:`data_container`, :data:`BUILTINS`) are
defined here for :mod:`.code_walk`, :mod:`.held_objects` and :mod:`.model_code`.

*State* is not kept here beyond a memo of each function's digest (per function object and code
object); a function's code assigned anew gets a new digest.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import sys
import sysconfig
import types
import weakref
from collections.abc import Iterator, Mapping, MutableSequence, Sequence, Set as AbstractSet
from pathlib import Path
from typing import Any

import torch

from .plain_values import canonical_repr, plain_value

#: Types of the plain values code reads (globals, attributes) that count by their value (``repr``).
PLAIN_READ_TYPES: tuple[type, ...] = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
PLAIN_READ = frozenset(PLAIN_READ_TYPES)
#: Values that hold code the walk follows.
CODE_HOLDERS = (types.FunctionType, types.MethodType, functools.partial)


def wrapper_of(value: Any) -> Any | None:
    """The function under a callable wrapper object that is not itself a function: the
    ``__wrapped__`` that ``functools.update_wrapper`` gave a ``functools.lru_cache`` or
    ``functools.cache`` object (C objects), through a chain of such wrappers of at most
    :data:`_WRAPPER_DEPTH`. None for functions, methods, partials, classes and modules (the walk
    takes them as they are) and for anything whose ``__wrapped__`` chain holds no function within
    that depth (a mock makes up a new ``__wrapped__`` at each step)."""
    if isinstance(value, (*CODE_HOLDERS, type, types.ModuleType)) or not callable(value):
        return None
    for _ in range(_WRAPPER_DEPTH):
        try:
            value = getattr(value, "__wrapped__", None)
        except Exception:  # noqa: BLE001 - an object whose attribute lookup raises holds no code we can follow
            return None
        if isinstance(value, CODE_HOLDERS):
            return value
        if value is None or not callable(value):
            return None
    return None


def holds_code(value: Any, also: tuple[type, ...] = ()) -> bool:
    """Whether the walk follows ``value`` as code: a function, method or partial, an instance of
    one of ``also`` (classes, mappings, builtins, as the caller reads them), or a wrapper object
    over a function (:func:`wrapper_of`)."""
    return isinstance(value, (*CODE_HOLDERS, *also)) or wrapper_of(value) is not None


#: How many wrapper objects deep :func:`wrapper_of` looks for a function.
_WRAPPER_DEPTH = 8


#: Global containers followed by value when they hold plain values or tensors (``SCALES = [1.0, 2.0]``).
CONTAINERS = (list, tuple, set, frozenset, dict)


def data_container(value: Any) -> bool:
    """Whether the walk reads ``value`` as a container of data, whole when it holds plain values
    and item by item otherwise: a mapping, sequence or set whose items are read as a ``dict``'s,
    ``list``'s or ``set``'s are (a list, tuple, dict, set, ``OrderedDict``, ``defaultdict``,
    ``deque``, ``array.array``, ``bytearray``, a script's ``class Store(dict): pass``). Not a
    string, bytes, range, memoryview or module, nor a container with its own lookup (a class
    outside torch and the standard library defining ``get``, ``__getitem__``, ... : transformers'
    ``AttentionInterface``, a registry keyed on model classes), read for the code it holds."""
    if type(value) in _BUILT_IN_CONTAINERS:
        return True
    if not isinstance(value, (Mapping, Sequence, MutableSequence, AbstractSet)) \
            or isinstance(value, (str, bytes, memoryview, range, torch.nn.Module)):
        return False
    return _plain_lookup(type(value))


#: Containers read as data without a look at their type's methods.
_BUILT_IN_CONTAINERS = frozenset({dict, list, tuple, set, frozenset})
#: The methods by which a container's items are read: a class outside torch and the standard
#: library defining one gives the container a lookup of its own.
_LOOKUPS = ("__getitem__", "get", "__missing__", "__iter__", "__contains__", "keys", "items", "values")


_PLAIN_LOOKUP: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def _plain_lookup(kind: type) -> bool:
    known = _PLAIN_LOOKUP.get(kind)
    if known is None:
        known = _PLAIN_LOOKUP[kind] = all(versioned(owner.__module__) for owner in kind.__mro__
                                          if any(name in vars(owner) for name in _LOOKUPS))
    return known


#: A memory address in a ``repr`` (``<unlocked _thread.lock object at 0x7f...>``): not the same in
#: another process.
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def identity_text(value: Any) -> str:
    """The digest's text for a value read by identity only (:meth:`~.code_walk.CodeWalk.identity`):
    a module by its name; a named callable (``torch.tanh``, ``math.sqrt``) by its module and
    qualified name; an object whose class defines ``__repr__`` (a logger, a lock, a torch module)
    by the sha256 of its ``repr``, memory addresses left out; an object of torch or the standard
    library by its type (a context object a torch decorator keeps in a closure); anything
    else by its type and identity (never the same in another process: a disk cache misses). The
    extraction cache serves the graphs of an equal digest, so a value assigned anew must change
    the text, whichever check saw it first."""
    kind = type(value)
    try:
        if isinstance(value, types.ModuleType):
            return f"module {value.__name__}"
        name, module = getattr(value, "__qualname__", None), getattr(value, "__module__", None)
        if callable(value) and isinstance(name, str) and isinstance(module, str):
            return f"{kind.__qualname__} {module}.{name}"
        if kind.__repr__ is not object.__repr__:
            text = _ADDRESS.sub("0x", repr(value))
            return f"{kind.__module__}.{kind.__qualname__} {hashlib.sha256(text.encode()).hexdigest()}"
    except Exception:  # noqa: BLE001 - an object whose attributes or repr raise counts by identity
        pass
    head = f"{kind.__module__}.{kind.__qualname__}"
    return head if versioned(kind.__module__) else f"{head} id {id(value)}"


#: Built-in callables an instance attribute may hold (``self.act = torch.relu``): they count by name.
BUILTINS = (types.BuiltinFunctionType, types.BuiltinMethodType)
#: Names whose reading means the code reads environment variables (``os.environ``, ``os.getenv``).
ENVIRONMENT_READS = frozenset({"environ", "environb", "getenv", "getenvb"})
#: The string constants of such code taken for environment variable names.
_VARIABLE_NAME = re.compile(r"[A-Z][A-Z0-9_]*\Z")
_STDLIB = sysconfig.get_paths()["stdlib"]
_FUNCTIONS: weakref.WeakKeyDictionary[types.FunctionType, tuple[types.CodeType, str]] = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=None)
def versioned(module_name: str | None) -> bool:
    """Whether code of ``module_name`` is torch's, the standard library's or built in: versioned in
    the cache key, not followed."""
    if not module_name:
        return True
    top = module_name.split(".")[0]
    if top in ("torch", "builtins") or top in sys.builtin_module_names:
        return True
    module = sys.modules.get(top)
    path = getattr(module, "__file__", None) or ""
    return bool(path) and path.startswith(_STDLIB) and "site-packages" not in path


def own_module(value: Any) -> bool:
    """Whether ``value`` is a Python module of the user's own code (``import settings`` of a
    script's directory): neither torch's, the standard library's nor an installed package's (one
    under ``site-packages``), whose code is only reached through the globals it defines."""
    if not isinstance(value, types.ModuleType) or versioned(value.__name__):
        return False
    path = getattr(value, "__file__", None)
    return isinstance(path, str) and "site-packages" not in path and "dist-packages" not in path


#: ``torch.nn.Module`` methods that move a module between devices (see :func:`is_plumbing`).
DEVICE_METHODS = frozenset({"to", "cuda", "npu", "xpu", "mlu", "sdaa", "musa", "neuron", "cpu"})


def is_plumbing(value: Any) -> bool:
    """A function nnbridge or nnsight set on a module instance (the bridge's forward and call
    wrapper, nnsight's wrapping): their versions are part of the key, and a model's digest must not
    depend on whether it is bridged or traced at the moment. Also a wrapper of the instance's own
    device-moving method (its class's ``to``, ``cuda``, ...; accelerate's ``dispatch_model`` wraps
    them to warn), which no forward runs: a model unpickled without them (``pg.save``) has
    the same digest."""
    wrapped = getattr(value, "__wrapped__", None)
    if isinstance(wrapped, types.MethodType) and isinstance(wrapped.__self__, torch.nn.Module) \
            and wrapped.__name__ in DEVICE_METHODS \
            and wrapped.__func__ is getattr(type(wrapped.__self__), wrapped.__name__, None):
        return True
    while isinstance(value, (functools.partial, types.MethodType)):
        value = value.func if isinstance(value, functools.partial) else value.__func__
    module = getattr(value, "__module__", None) or ""
    return module.split(".")[0] in ("nnbridge", "nnsight")


def _package_folder(name: str) -> str:
    spec = importlib.util.find_spec(name)
    return str(Path(spec.origin).parent) + os.sep if spec is not None and spec.origin else "\0"


#: The folders of nnbridge's and nnsight's code (see :func:`plumbing_code`).
_PLUMBING_FOLDERS = (_package_folder("nnbridge"), _package_folder("nnsight"))


def plumbing_code(function: types.FunctionType) -> bool:
    """Whether ``function``'s code is nnbridge's or nnsight's, by the file it was defined in (a
    wrapper made with ``functools.wraps`` has the wrapped function's ``__module__``)."""
    return function.__code__.co_filename.startswith(_PLUMBING_FOLDERS)


def variable_names(code: types.CodeType) -> Iterator[str]:
    """The string constants of ``code`` (nested code included) that look like environment
    variable names (upper case, digits, underscores)."""
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from variable_names(constant)
        elif isinstance(constant, str) and _VARIABLE_NAME.match(constant):
            yield constant


def defaults_text(function: types.FunctionType) -> str:
    """A function's default argument values as text: their ``repr`` when all are plain values,
    else their types (a default object counts by its type only)."""
    defaults = (function.__defaults__, function.__kwdefaults__)
    if plain_value(defaults):
        return canonical_repr(defaults)
    return repr([type(v).__qualname__ for v in (*(function.__defaults__ or ()),
                                                 *(function.__kwdefaults__ or {}).values())])


def _code_text(code: types.CodeType) -> Iterator[bytes]:
    """What identifies compiled code: its qualified name, bytecode, names and constants (nested
    code objects recursively)."""
    yield code.co_qualname.encode()
    yield code.co_code
    yield repr(code.co_names).encode()
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _code_text(constant)
        else:
            yield repr(constant).encode()


def global_names(code: types.CodeType) -> Iterator[str]:
    """Every name ``code`` (and code nested in it) may read as a global."""
    yield from code.co_names
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from global_names(constant)


def string_constants(code: types.CodeType) -> Iterator[str]:
    """The string constants of ``code`` and of code nested in it."""
    for constant in code.co_consts:
        if isinstance(constant, str):
            yield constant
        elif isinstance(constant, types.CodeType):
            yield from string_constants(constant)


def function_digest(function: types.FunctionType) -> str:
    """sha256 of one function's own code (memoised per function object and code object)."""
    known = _FUNCTIONS.get(function)
    if known is not None and known[0] is function.__code__:
        return known[1]
    digest = hashlib.sha256()
    digest.update(f"{function.__module__}:{function.__qualname__}".encode())
    for part in _code_text(function.__code__):
        digest.update(part)
    value = digest.hexdigest()
    _FUNCTIONS[function] = (function.__code__, value)
    return value
