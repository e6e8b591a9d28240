"""The code a model runs, as one digest: what the disk extraction cache keys on besides the source
files of the module classes (:func:`~.programs.model_fingerprint`).

A module class's source file does not show code replaced at run time, the usual way researchers
change a model without editing transformers:

- a method assigned to a class (``GPT2MLP.forward = scaled_forward``);
- a helper replaced in its module (``modeling_gpt2.eager_attention_forward = my_attention``);
- an entry of a registry of functions replaced (``ALL_ATTENTION_FUNCTIONS["sdpa"] = f``);
- a function set on one instance (``model.transformer.h[0].mlp.forward = f``), or held by one as
  an attribute its forward calls (``self.act = torch.relu``, a ``functools.partial``: built-ins
  count by name, a partial also by its plain arguments).

A graph also bakes in the plain values (``SCALE = 2.0``, a flag, a string) and tensors its code
reads as module globals; a value assigned anew, or a global tensor written in place, changes what
eager code computes.

A graph exported before such a change and served after it computes what the old code computed, so
:func:`code_digest` covers them: starting from every module class of the tree (its own methods and
those it inherits, ``torch.nn.Module``'s left out) and every function-valued instance attribute,
it follows each function's closure cells, the decorated function under a wrapper
(``__wrapped__``), and every global name its code (nested functions included) reads that holds a
function, a class (its methods) or a dict/mapping of them, transitively, and every global it reads
that holds a plain value (by ``repr``) or a tensor (by dtype, shape and a hash of its values). Each
function counts by its qualified name, module and compiled code (bytecode, constants, names) and
its default argument values (plain ones by ``repr``, others by type), so a replacement with other
code changes the digest, and re-importing the same code does not. A function's own ``__code__``,
``__defaults__`` and ``__kwdefaults__`` assigned anew count as a replacement
(``Cls.forward.__defaults__ = (5.0,)``: a graph bakes in the default a call left out), and plain
defaults written in place (a list default, ``f.__kwdefaults__["k"] = 3``) as a global container of
plain values written in place does. A function whose code reads the environment (its names include
``environ`` or ``getenv``) counts the value of every environment variable it names as a constant
(an upper-case string such as ``"TRANSFORMERS_SDPA_FORCE_GQA"``, read by transformers' SDPA
attention), so setting one re-extracts and the disk cache keys on their values. A global the code
reads that holds an object of settings (a ``SimpleNamespace``, a dataclass, an instance of a
script's own class) counts with its plain attributes (``STATE.enabled``), a class the code names
(not torch's) with its plain class attributes (``Flags.ablate``), a ``contextvars.ContextVar``
with its value in the calling context.
:class:`CodeCheck` tells the same changes apart within a process (by identity, and for global
tensors by version), so a bridged model extracts again instead of running the old graph.

Not followed: the code of torch, the standard library and built-ins (their versions are part of
the cache key; torch functions replaced on a class or in a module global *are* seen, as any
function is), and a function reached only through an attribute chain
(``torch.nn.functional.softmax = f`` changes nothing here), and an environment variable whose name
the code does not spell as a constant (``os.environ[PREFIX + "X"]``, a name held in a global). Example::

    digest = code_digest(model)           # hex sha256
    modeling_gpt2.eager_attention_forward = my_attention
    assert code_digest(model) != digest
"""

from __future__ import annotations

import argparse
import contextvars
import functools
import hashlib
import operator
import os
import re
import sys
import sysconfig
import types
import weakref
from collections.abc import Iterator, Mapping, Set as AbstractSet
from typing import Any

import torch

from ..graph.module_tree import named_real_modules
from ..compat.accelerate import ACCELERATE_ATTRIBUTES
from ..compat.torch.capture import tensor_version
from ..compat.nnsight.source import NNSIGHT_STATE
from .plain_values import canonical_repr, config_like, plain_value, snapshot, tensor_digest

#: Types of the plain global values code reads that count by their value (``repr``).
_PLAIN_TYPES: tuple[type, ...] = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_PLAIN = frozenset(_PLAIN_TYPES)
#: Mappings with more entries than this are not read (a registry of functions is small).
_MAPPING_LIMIT = 512
#: Methods visited whether or not code reached names them: what calling a module runs.
_ENTRY_POINTS = ("forward", "__call__")
_CODE_HOLDERS = (types.FunctionType, types.MethodType, functools.partial)
#: Global containers followed by value when they hold plain values or tensors (``SCALES = [1.0, 2.0]``).
_CONTAINERS = (list, tuple, set, frozenset, dict)
_STDLIB = sysconfig.get_paths()["stdlib"]
#: A binding's value where the namespace must not hold the name.
MISSING: Any = object()
#: ``(where, namespace, name, value)``: ``namespace.get(name)`` was ``value`` when walked.
Binding = tuple[str, Any, Any, Any]
_FUNCTIONS: weakref.WeakKeyDictionary[types.FunctionType, tuple[types.CodeType, str]] = weakref.WeakKeyDictionary()
#: The attributes of a function that decide what calling it computes, besides its globals and closure.
_FUNCTION_PARTS = ("__code__", "__defaults__", "__kwdefaults__")


class FunctionParts:
    """A function's :data:`_FUNCTION_PARTS` as a binding's namespace (``get``, ``[]``, ``in``), so
    that ``f.__defaults__ = (5.0,)`` after bridging is a replacement like any other lookup."""

    __slots__ = ("function",)

    def __init__(self, function: types.FunctionType):
        self.function = function

    def __getitem__(self, name: str) -> Any:
        return getattr(self.function, name)

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self.function, name, default)

    def __contains__(self, name: str) -> bool:
        return name in _FUNCTION_PARTS


#: Names whose reading means the code reads environment variables (``os.environ``, ``os.getenv``).
_ENVIRONMENT_READS = frozenset({"environ", "environb", "getenv", "getenvb"})
#: The string constants of such code taken for environment variable names.
_VARIABLE_NAME = re.compile(r"[A-Z][A-Z0-9_]*\Z")


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


def _variable_names(code: types.CodeType) -> Iterator[str]:
    """The string constants of ``code`` (nested code included) that look like environment
    variable names (upper case, digits, underscores)."""
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _variable_names(constant)
        elif isinstance(constant, str) and _VARIABLE_NAME.match(constant):
            yield constant


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


def _settings_object(value: Any) -> bool:
    """An instance holding settings in its ``__dict__`` (a ``SimpleNamespace``, an
    ``argparse.Namespace``, a dataclass, a config, an instance of a script's own class), not a
    module, tensor, module object, function or class, nor an object of torch or the standard library."""
    if isinstance(value, (type, types.ModuleType, torch.nn.Module, torch.Tensor, *_CODE_HOLDERS)):
        return False
    if not isinstance(getattr(value, "__dict__", None), dict):
        return False
    kind = type(value)
    return kind in (types.SimpleNamespace, argparse.Namespace) or not _versioned(kind.__module__)


def _defaults_text(function: types.FunctionType) -> str:
    """A function's default argument values as text: their ``repr`` when all are plain values,
    else their types (a default object counts by its type only)."""
    defaults = (function.__defaults__, function.__kwdefaults__)
    if plain_value(defaults):
        return canonical_repr(defaults)
    return repr([type(v).__qualname__ for v in (*(function.__defaults__ or ()),
                                                 *(function.__kwdefaults__ or {}).values())])


@functools.lru_cache(maxsize=None)
def _versioned(module_name: str | None) -> bool:
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


def _names(code: types.CodeType) -> Iterator[str]:
    """Every name ``code`` (and code nested in it) may read as a global."""
    yield from code.co_names
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _names(constant)


def _string_constants(code: types.CodeType) -> Iterator[str]:
    """The string constants of ``code`` and of code nested in it."""
    for constant in code.co_consts:
        if isinstance(constant, str):
            yield constant
        elif isinstance(constant, types.CodeType):
            yield from _string_constants(constant)


def _function_digest(function: types.FunctionType) -> str:
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


class _Walk:
    """One traversal (a worklist, so deep call chains need no recursion): ``entries`` are
    ``(where, digest)`` in visiting order. A class's method is visited once some code reached
    reads its name (``self._update_causal_mask(...)`` reads ``_update_causal_mask``), or at once
    when it is an entry point (``forward``)."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, str]] = []
        #: ``(where, namespace, name, value)``: each lookup that found code, to check it again
        #: (:func:`code_bindings`); ``value`` is :data:`MISSING` where a class earlier in an MRO
        #: must not define the name
        self.bindings: list[Binding] = []
        self.seen: set[int] = set()
        self.keep: list[Any] = []  # keeps visited objects alive, so ids stay unique
        self.todo: list[tuple[str, Any, tuple[Binding, ...]]] = []
        self.names: set[str] = set(_ENTRY_POINTS)
        self.pending: dict[str, list[tuple[str, Any, tuple[Binding, ...]]]] = {}
        #: ``id`` of a class's ``vars()`` proxy (a binding's namespace) -> the class, to assign to it
        self.owners: dict[int, type] = {}
        #: ``(where, holder's namespace, name, object)``: objects held by modules (or by held
        #: objects) that code may read, to follow once the names code reads are known (:meth:`held`)
        self.objects: list[tuple[str, Any, Any, Any]] = []

    def first_visit(self, value: Any) -> bool:
        if id(value) in self.seen:
            return False
        self.seen.add(id(value))
        self.keep.append(value)
        return True

    def run(self) -> None:
        while self.todo:
            where, value, bindings = self.todo.pop()
            self.bindings.extend(bindings)
            self.value(where, value)

    def value(self, where: str, value: Any) -> None:
        """Note ``value`` (reached as ``where``) and queue what its code reaches."""
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, property):
            self.todo.extend((f"{where}.{part}", getattr(value, part), ()) for part in ("fdel", "fset", "fget")
                             if getattr(value, part) is not None)
            return
        elif isinstance(value, functools.partial):
            self.todo.append((f"{where}.func", value.func, ()))
            return
        elif isinstance(value, types.MethodType):
            value = value.__func__
        if isinstance(value, types.FunctionType):
            self.function(where, value)
        elif isinstance(value, type):
            self.cls(value)
        elif isinstance(value, Mapping) and not _versioned(type(value).__module__):
            self.mapping(where, value)

    def function(self, where: str, function: types.FunctionType) -> None:
        self.entries.append((where, _function_digest(function)))
        if _versioned(function.__module__) or not self.first_visit(function):
            return
        parts, own = FunctionParts(function), f"{function.__module__}.{function.__qualname__}"
        # defaults count only where there are some: a call of a function without them passed every
        # argument, so defaults assigned later change none of the calls a graph holds
        self.bindings.extend((f"{own}.{name}", parts, name, getattr(function, name)) for name in _FUNCTION_PARTS
                             if name == "__code__" or getattr(function, name) is not None)
        if function.__defaults__ or function.__kwdefaults__:
            self.entries.append((f"{own}.__defaults__", _defaults_text(function)))
        found: list[tuple[str, Any, tuple[Binding, ...]]] = []
        for cell in function.__closure__ or ():
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(content, _CODE_HOLDERS):
                found.append((f"{function.__qualname__}.<closure>", content, ()))
        wrapped = getattr(function, "__wrapped__", None)
        if wrapped is not None:
            found.append((f"{function.__qualname__}.__wrapped__", wrapped, ()))
        namespace = function.__globals__
        names = dict.fromkeys(_names(function.__code__))
        if not _ENVIRONMENT_READS.isdisjoint(names):
            for variable in dict.fromkeys(_variable_names(function.__code__)):
                where_found, value = f"os.environ[{variable!r}]", ENVIRONMENT[variable]
                self.entries.append((where_found, repr(value)))
                self.bindings.append((where_found, ENVIRONMENT, variable, value))
        for name in names:
            if name not in self.names:
                self.names.add(name)
                found.extend(self.pending.pop(name, ()))
            if (name in namespace and isinstance(namespace[name], _CONTAINERS)
                    and plain_value(namespace[name], tensors=True)):
                # a global container of plain values or tensors (``SCALES = [1.0, 2.0]``): by value in
                # the digest; assigned anew or written in place fails the check (see CodeCheck)
                where_found = f"{function.__module__}.{name}"
                self.entries.append((where_found, canonical_repr(namespace[name])))
                self.bindings.append((where_found, namespace, name, namespace[name]))
            elif name in namespace and isinstance(namespace[name], (*_CODE_HOLDERS, type, Mapping)):
                where_found = f"{function.__module__}.{name}"
                found.append((where_found, namespace[name], ((where_found, namespace, name, namespace[name]),)))
            elif name in namespace and type(namespace[name]) in _PLAIN:
                # a plain global (``SCALE = 2.0``, a flag) a graph bakes in: its value is part of
                # the digest, and assigning it anew fails the check (re-extraction)
                where_found = f"{function.__module__}.{name}"
                self.entries.append((where_found, repr(namespace[name])))
                self.bindings.append((where_found, namespace, name, namespace[name]))
            elif name in namespace and isinstance(namespace[name], torch.Tensor):
                # a global tensor a graph bakes in as a constant: its values are part of the digest,
                # and assigning it anew or writing it in place fails the check (see CodeCheck)
                where_found = f"{function.__module__}.{name}"
                self.entries.append((where_found, tensor_digest(namespace[name])))
                self.bindings.append((where_found, namespace, name, namespace[name]))
            elif name in namespace and isinstance(namespace[name], contextvars.ContextVar):
                # a context variable (``ABLATE.get()``): its value in the calling context
                where_found = f"{function.__module__}.{name}"
                held = ContextValue(namespace[name])
                self.bindings.append((where_found, namespace, name, namespace[name]))
                self.entries.append((f"{where_found}.get()", repr(held["value"])))
                self.bindings.append((f"{where_found}.get()", held, "value", held["value"]))
            elif name in namespace and _settings_object(namespace[name]):
                # a global object of settings (``STATE = SimpleNamespace(enabled=False)``, a
                # dataclass, an instance of the script's own class): its plain attributes
                where_found = f"{function.__module__}.{name}"
                self.entries.append((where_found, type(namespace[name]).__qualname__))
                self.bindings.append((where_found, namespace, name, namespace[name]))
                if self.first_visit(namespace[name]):
                    self.plain_attributes(where_found, vars(namespace[name]))
        # attribute names spelt as string constants (``getattr(self.hp, "scale")``) are read too
        for constant in _string_constants(function.__code__):
            if constant.isidentifier() and constant not in self.names:
                self.names.add(constant)
                found.extend(self.pending.pop(constant, ()))
        self.todo.extend(reversed(found))

    def plain_attributes(self, where: str, state: Mapping[str, Any], owner: type | None = None) -> None:
        """The plain values (and containers of them) in an object's or a class's (``owner``'s)
        ``state``: in the digest by value, each a binding (assigning one anew or writing into a
        container re-extracts)."""
        if owner is not None:
            self.owners[id(state)] = owner
        for name, value in list(state.items()):
            if name.startswith("__") and name.endswith("__"):
                continue
            if type(value) in _PLAIN or (isinstance(value, _CONTAINERS) and plain_value(value, tensors=True)):
                self.entries.append((f"{where}.{name}", canonical_repr(value)))
                self.bindings.append((f"{where}.{name}", state, name, value))

    def cls(self, cls: type, in_tree: bool = False) -> None:
        """A class's methods, inherited ones included (``torch.nn.Module``'s and ``object``'s left
        out); a torch or standard-library class only when it is a module class of the tree."""
        if (not in_tree and _versioned(cls.__module__)) or not self.first_visit(cls):
            return
        if not in_tree:  # a class the code names (``if Flags.ablate:``); module classes' own are StateGuard's
            for owner in cls.__mro__:
                if owner not in (object, torch.nn.Module) and not _versioned(owner.__module__):
                    self.plain_attributes(owner.__qualname__, vars(owner), owner)
        resolved: set[str] = set()
        for index, owner in enumerate(cls.__mro__):
            if owner in (object, torch.nn.Module):
                continue
            for name, attribute in list(vars(owner).items()):
                if isinstance(attribute, (*_CODE_HOLDERS, staticmethod, classmethod, property)):
                    where = f"{owner.__qualname__}.{name}"
                    bindings: tuple[Binding, ...] = ()
                    if name not in resolved:  # what ``cls.name`` finds: no class before ``owner`` may define it
                        resolved.add(name)
                        bindings = (*((where, vars(c), name, MISSING) for c in cls.__mro__[:index]),
                                    (where, vars(owner), name, attribute))
                    entry = (where, attribute, bindings)
                    if name in self.names:
                        self.todo.append(entry)
                    else:
                        self.pending.setdefault(name, []).append(entry)

    def held(self) -> None:
        """Follow the objects modules hold (see :func:`held_object`) through the attribute names
        the code reached reads, to a fixed point: each object read is a binding by identity on its
        holder (an object assigned anew re-extracts), its class's methods are walked like a module
        class's (a callable object's ``__call__``), and each of its attributes whose name the code
        reads is a binding too: a plain value by identity (``m.hp.scale = 2.0`` re-extracts) and
        in the digest by value, another object followed in turn. What was read is decided by name
        (the names of every code object reached), so an attribute read under another name
        (``getattr(self.hp, name)``) is not followed."""
        done: set[tuple[int, Any]] = set()
        followed: list[tuple[str, Any]] = []
        while True:
            ready = [item for item in self.objects
                     if (id(item[1]), item[2]) not in done and (item[2] in self.names or type(item[2]) is not str)]
            if not ready:
                break
            for where, namespace, name, value in ready:
                done.add((id(namespace), name))
                self.entries.append((where, _held_text(value)))
                self.bindings.append((where, namespace, name, value))
                if not held_object(str(name), value) or not self.first_visit(value):
                    continue  # a plain value, or an object already followed
                self.cls(type(value))
                self.run()
                followed.append((where, value))
                attributes = _namespace(value)
                for attribute, item in _attributes(value):
                    if held_object(attribute, item) or type(item) in _PLAIN or (
                            isinstance(item, _CONTAINERS) and plain_value(item, tensors=True)):
                        self.objects.append((f"{where}.{attribute}", attributes, attribute, item))
        # a name the code reads that an object does not hold (a class attribute read through it,
        # ``self.hp.offset``; a ``getattr(obj, "bias", 0.0)`` default): the object must not get one
        # of its own later (``m.hp.offset = 1.5`` shadows the class's)
        read = sorted(name for name in self.names if not (name.startswith("__") and name.endswith("__")))
        for where, value in followed:
            state = getattr(value, "__dict__", None)
            if isinstance(state, dict):
                self.bindings.extend((f"{where}.{name}", state, name, MISSING) for name in read if name not in state)

    def mapping(self, where: str, mapping: Mapping[Any, Any]) -> None:
        if not self.first_visit(mapping):
            return
        try:
            items = list(dict.items(mapping) if isinstance(mapping, dict) else mapping.items())
        except Exception:  # noqa: BLE001 - a mapping that cannot be listed counts by its type only
            self.entries.append((where, type(mapping).__qualname__))
            return
        if len(items) <= _MAPPING_LIMIT:
            self.todo.extend(reversed([(f"{where}[{key!r}]", value, ((f"{where}[{key!r}]", mapping, key, value),))
                                       for key, value in items if isinstance(value, (*_CODE_HOLDERS, type))]))


#: Module attributes that are another library's or torch's bookkeeping, never followed as held objects.
_NOT_HELD = frozenset({NNSIGHT_STATE}) | ACCELERATE_ATTRIBUTES
#: The most attributes of one held object followed (a larger one counts by identity only).
_ATTRIBUTE_LIMIT = 256


def held_object(name: str, value: Any) -> bool:
    """Whether a module's attribute ``name`` holds an object whose state its code may read and
    that no other guard covers: an instance of any class (a plain class, a callable object, a
    numpy scalar) that is not a module, tensor, class, function, built-in, Python module, plain
    value or container of them (:class:`~.guards.StateGuard` guards those by value), nor a config
    (guarded by value with its nested configs), nor nnbridge's or nnsight's own plumbing."""
    if name in _NOT_HELD or (name.startswith("__") and name.endswith("__")):
        return False
    if isinstance(value, (type, types.ModuleType, torch.nn.Module, torch.Tensor, *_CODE_HOLDERS, *_BUILTINS,
                          *_PLAIN_TYPES, contextvars.ContextVar)):
        return False
    if isinstance(value, _CONTAINERS) or is_plumbing(value) or is_plumbing(type(value)):
        return False
    return not config_like(name, value)


def _attributes(value: Any) -> list[tuple[str, Any]]:
    """A held object's attributes: its ``__dict__``'s items and its ``__slots__``' values (dunder
    names left out), none when it has more than :data:`_ATTRIBUTE_LIMIT`."""
    found: list[tuple[str, Any]] = []
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict):
        found.extend(state.items())
    for owner in type(value).__mro__:
        for slot in vars(owner).get("__slots__", ()) if isinstance(vars(owner).get("__slots__", ()), (tuple, list)) else ():
            if slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                found.append((slot, getattr(value, slot)))
    if len(found) > _ATTRIBUTE_LIMIT:
        return []
    return [(name, item) for name, item in found if type(name) is str and not (name.startswith("__") and name.endswith("__"))]


class _Slots:
    """An object's ``__slots__`` as a binding's namespace (``get``, ``[]``, ``in``)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __getitem__(self, name: str) -> Any:
        return getattr(self.value, name)

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self.value, name, default)

    def __contains__(self, name: str) -> bool:
        return hasattr(self.value, name)


def _namespace(value: Any) -> Any:
    """Where a binding looks up a held object's attribute: its ``__dict__``, else its slots."""
    state = getattr(value, "__dict__", None)
    return state if isinstance(state, dict) else _Slots(value)


def _held_text(value: Any) -> str:
    """A held object's part of the digest: a plain value by value, an object by its class (its
    attributes are entries of their own), one without attributes by ``repr`` when its class
    defines one (a numpy scalar), else by identity (never the same in another process)."""
    if type(value) in _PLAIN or (isinstance(value, _CONTAINERS) and plain_value(value, tensors=True)):
        return canonical_repr(value)
    kind = type(value)
    if isinstance(getattr(value, "__dict__", None), dict) or any("__slots__" in vars(c) for c in kind.__mro__[:-1]):
        return f"{kind.__module__}.{kind.__qualname__}"
    if kind.__repr__ is not object.__repr__:
        return f"{kind.__module__}.{kind.__qualname__} {value!r}"
    return f"{kind.__module__}.{kind.__qualname__} id {id(value)}"


def is_plumbing(value: Any) -> bool:
    """A function nnbridge or nnsight set on a module instance (the bridge's forward and call
    wrapper, nnsight's wrapping): their versions are part of the key, and a model's digest must not
    depend on whether it is bridged or traced at the moment."""
    while isinstance(value, (functools.partial, types.MethodType)):
        value = value.func if isinstance(value, functools.partial) else value.__func__
    module = getattr(value, "__module__", None) or ""
    return module.split(".")[0] in ("nnbridge", "nnsight")


#: Built-in callables an instance attribute may hold (``self.act = torch.relu``): they count by name.
_BUILTINS = (types.BuiltinFunctionType, types.BuiltinMethodType)
#: Instance attributes whose function other checks follow, so they are no binding (only part of
#: the digest): a module's call and its body (:func:`~nnbridge.compat.instance_forward`,
#: ``.locking``); accelerate's wrapped forward.
_CALL_SLOTS = frozenset({"forward", "_call_impl", "_old_forward"})


def _builtin_name(value: Any) -> str:
    return f"{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', None) or value!r}"


def _walked(model: torch.nn.Module, skip: AbstractSet[int] = frozenset()) -> _Walk:
    """One walk from every module class of ``model``'s tree and every function-valued instance
    attribute (the bridge's and nnsight's own left out, see :func:`is_plumbing`). An instance
    attribute holding a function, method, ``functools.partial`` (with its plain arguments) or
    built-in (``self.act = torch.relu``) is a binding too: assigning another one re-extracts
    (else the graphs would keep calling the old one, without an error). Modules whose ``id`` is
    in ``skip`` are left out with their subtrees."""
    walk = _Walk()
    skipped: list[str] = []
    for path, module in named_real_modules(model):
        if id(module) in skip or any(path.startswith(f"{p}.") or not p for p in skipped):
            skipped.append(path)
            continue
        walk.cls(type(module), in_tree=True)
        state = vars(module)
        for name, value in list(state.items()):
            if held_object(name, value):
                walk.objects.append((f"{path or '<root>'}.{name}", state, name, value))
                continue
            if not isinstance(value, (*_CODE_HOLDERS, *_BUILTINS)) or is_plumbing(value):
                continue
            where = f"{path or '<root>'}.{name}"
            if name in _CALL_SLOTS:  # in the digest; a change is found by other checks
                walk.todo.append((where, value, ()))
                continue
            binding = (where, state, name, value)
            if isinstance(value, _BUILTINS):
                walk.entries.append((where, _builtin_name(value)))
                walk.bindings.append(binding)
                continue
            if isinstance(value, functools.partial):
                walk.entries.append((f"{where}.arguments", _partial_arguments(value)))
                if isinstance(value.func, _BUILTINS):
                    walk.entries.append((f"{where}.func", _builtin_name(value.func)))
            walk.todo.append((where, value, (binding,)))
        walk.run()
    walk.held()
    return walk


def _partial_arguments(value: functools.partial) -> str:
    """The arguments a ``functools.partial`` binds, as text: their ``repr`` when all are plain
    values, else their types (a partial binding objects counts by its function only)."""
    bound = (value.args, value.keywords)
    return canonical_repr(bound) if plain_value(bound) else repr([type(v).__qualname__ for v in
                                                                  (*value.args, *value.keywords.values())])


def code_digest(model: torch.nn.Module) -> str:
    """sha256 (hex) of the code ``model``'s modules reach (see the module docstring): module
    classes with their inherited methods, function-valued instance attributes, and the functions,
    classes and function registries their code reads as globals, transitively. The classes, not
    the depth, set the cost. Nothing is kept across calls but each function's own digest, so a
    replacement made since the last call is seen."""
    digest = hashlib.sha256()
    for where, part in _walked(model).entries:
        digest.update(f"{where}={part};".encode())
    return digest.hexdigest()


def code_bindings(model: torch.nn.Module, skip: AbstractSet[int] = frozenset()) -> list[Binding]:
    """The lookups :func:`code_digest` walks that found code, as ``(where, namespace, name,
    value)``: a module global, a class attribute (with :data:`MISSING` for the classes earlier in
    its MRO), a registry entry; each namespace and name once. :class:`CodeCheck` tells whether one
    has changed since (a method or helper assigned anew). ``skip``: ``id``s of modules left out
    with their subtrees (modules that run their own code: what their code reads is read live)."""
    unique: dict[tuple[int, Any], Binding] = {}
    for binding in _walked(model, skip).bindings:
        unique.setdefault((id(binding[1]), binding[2]), binding)
    return list(unique.values())


def value_bindings(model: torch.nn.Module) -> list[tuple[Binding, type | None]]:
    """The bindings of :func:`code_bindings` whose namespace is a module's globals, an object's
    ``__dict__`` or a class's attributes (``(binding, the class)`` for those; None else): what
    :mod:`.global_state` watches and restores."""
    walk = _walked(model)
    unique: dict[tuple[int, Any], tuple[Binding, type | None]] = {}
    for binding in walk.bindings:
        namespace = binding[1]
        if type(namespace) is dict or id(namespace) in walk.owners:
            unique.setdefault((id(namespace), binding[2]), (binding, walk.owners.get(id(namespace))))
    return list(unique.values())


def replaced(bindings: list[Binding]) -> str | None:
    """The first binding of :func:`code_bindings` whose namespace holds another value now, in
    words (``"transformers.models.gpt2.modeling_gpt2.eager_attention_forward was replaced"``), or None."""
    for where, namespace, name, value in bindings:
        try:
            current = namespace.get(name, MISSING)
        except Exception:  # noqa: BLE001 - a registry that cannot be read has changed
            current = None
        if current is not value:
            change = "changed" if namespace is ENVIRONMENT else "replaced"
            return f"{where} was {'defined on a subclass' if value is MISSING else change}"
    return None


class CodeCheck:
    """Whether the code lookups of :func:`code_bindings` still find what they found: grouped per
    namespace, so a check is a few C-level calls per module file and class (GPT-2: 302 lookups in
    202 namespaces)."""

    def __init__(self, bindings: list[Binding]):
        self.bindings = bindings
        groups: dict[int, tuple[Any, list[Any], list[Any], list[Any]]] = {}
        # a function's own parts, one C-level ``map`` per part name (GPT-2: 137 functions)
        parts: dict[str, tuple[list[types.FunctionType], list[Any]]] = {name: ([], []) for name in _FUNCTION_PARTS}
        for _, namespace, name, value in bindings:
            if type(namespace) is FunctionParts:
                parts[name][0].append(namespace.function)
                parts[name][1].append(value)
                continue
            group = groups.setdefault(id(namespace), (namespace, [], [], []))
            if value is MISSING:
                group[3].append(name)
            else:
                group[1].append(name)
                group[2].append(value)
        # one-name namespaces (most of them) are looked up together in one C-level ``map``
        singles = [(namespace, names[0], values[0]) for namespace, names, values, _ in groups.values()
                   if len(names) == 1]
        self._single_namespaces = [namespace for namespace, _, _ in singles]
        self._single_names = [name for _, name, _ in singles]
        self._single_values = [value for _, _, value in singles]
        self._groups = [(namespace, operator.itemgetter(*names), tuple(values))
                        for namespace, names, values, _ in groups.values() if len(names) > 1]
        self._absent = [(namespace, tuple(absent)) for namespace, _, _, absent in groups.values() if absent]
        self._parts = [(operator.attrgetter(name), functions, values) for name, (functions, values) in parts.items()
                       if functions]
        # global tensors: their version now (an in-place write changes what a graph baked in)
        self._tensors = [value for _, _, _, value in bindings if isinstance(value, torch.Tensor)]
        self._versions = [tensor_version(t) for t in self._tensors]
        # global containers of plain values: a copy (a write into one changes what a graph baked in)
        self._containers = [value for _, _, _, value in bindings
                            if isinstance(value, _CONTAINERS) and plain_value(value, tensors=True)]
        self._copies = [snapshot(value) for value in self._containers]

    def holds(self) -> bool:
        if self._tensors and list(map(tensor_version, self._tensors)) != self._versions:
            return False
        try:
            if self._containers and self._containers != self._copies:
                return False
            if not all(map(operator.is_, map(operator.getitem, self._single_namespaces, self._single_names),
                           self._single_values)):
                return False
            for namespace, getter, values in self._groups:
                if not all(map(operator.is_, getter(namespace), values)):
                    return False
            for namespace, absent in self._absent:
                if any(map(namespace.__contains__, absent)):
                    return False
            for part, functions, held in self._parts:
                if not all(map(operator.is_, map(part, functions), held)):
                    return False
        except Exception:  # noqa: BLE001 - a name gone, or a registry that cannot be read: changed
            return False
        return True

    def what_changed(self) -> str | None:
        """The first lookup that finds something else now, in words; None when :meth:`holds`."""
        for tensor, version in zip(self._tensors, self._versions):
            if tensor_version(tensor) != version:
                where = next(w for w, _, _, value in self.bindings if value is tensor)
                return f"{where} was written in place"
        for container, copied in zip(self._containers, self._copies):
            if not container == copied:
                where = next(w for w, _, _, value in self.bindings if value is container)
                return f"{where} was written in place"
        return replaced(self.bindings)
