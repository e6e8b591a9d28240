"""The walk over code: from the classes and functions it is given, every function their code
reaches, each as a digest entry and each lookup that found it as a binding (:mod:`.bindings`).

A function leads on to the function under a wrapper (``__wrapped__``), every global name its code
(nested functions included) reads and its closure cells, read alike (:class:`~.bindings.ClosureCells`;
of nnbridge's and nnsight's own wrappers only the code they hold): one holding a function, a class
(its methods) or a mapping of them is followed; one holding a plain value, a tensor, an array, a
container of plain values, a ``contextvars.ContextVar`` or an object of settings is an entry by
value and a binding; a container of other values (:func:`~.code_objects.data_container`: a
``dict``, ``list``, ``tuple``, ``deque``, ``OrderedDict``, ...; one held as an attribute of an
object of settings or a class too) is read item by item (:meth:`CodeWalk.data_item`), and a
``functools.partial`` by the function it calls and the arguments it binds. A class's method is followed once some code reached reads its name, or at once when it
is an entry point (``forward``, ``__call__``). What the walk covers and leaves out, as the
disk-cache key sees it, is described in :mod:`.code_digest`; where it starts from a model, in
:mod:`.model_code`; the objects modules hold, in :mod:`.held_objects`.

*State* here is only the walk's own bookkeeping (what it has visited and what is left to visit),
made for one walk and dropped with it. The values it reads are recorded as they are at that
moment; nothing of the model is kept.
"""

from __future__ import annotations

import argparse
import contextvars
import functools
import types
from collections.abc import Mapping, Set as AbstractSet
from typing import Any

import torch

from .bindings import (
    ENVIRONMENT,
    FUNCTION_PARTS,
    MISSING,
    Attributes,
    Binding,
    ClosureCells,
    ContextValue,
    FunctionParts,
    SequenceItems,
)
from .code_objects import (
    CODE_HOLDERS,
    ENVIRONMENT_READS,
    PLAIN_READ,
    data_container,
    defaults_text,
    function_digest,
    global_names,
    holds_code,
    identity_text,
    plumbing_code,
    string_constants,
    variable_names,
    versioned,
    wrapper_of,
)
from .plain_values import array_digest, canonical_repr, plain_value, tensor_digest, writable_array
from .rng_objects import generator_state

#: Mappings and sequences with more entries than this are not read (a registry of functions is small).
MAPPING_LIMIT = 512
#: Methods visited whether or not code reached names them: what calling a module runs.
_ENTRY_POINTS = ("forward", "__call__")
#: What the walk queues: ``(where, value, the bindings that found it)``.
_Todo = tuple[str, Any, tuple[Binding, ...]]


def settings_object(value: Any) -> bool:
    """An instance holding settings in its ``__dict__`` (a ``SimpleNamespace``, an
    ``argparse.Namespace``, a dataclass, a config, an instance of a script's own class), not a
    module, tensor, module object, function or class, nor an object of torch or the standard library."""
    if isinstance(value, (type, types.ModuleType, torch.nn.Module, torch.Tensor, *CODE_HOLDERS)):
        return False
    if not isinstance(getattr(value, "__dict__", None), dict):
        return False
    kind = type(value)
    return kind in (types.SimpleNamespace, argparse.Namespace) or not versioned(kind.__module__)


class CodeWalk:
    """One traversal (a worklist, so deep call chains need no recursion): ``entries`` are
    ``(where, digest)`` in visiting order. A class's method is visited once some code reached
    reads its name (``self._update_causal_mask(...)`` reads ``_update_causal_mask``), or at once
    when it is an entry point (``forward``)."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, str]] = []
        #: ``(where, namespace, name, value)``: each lookup that found code, to check it again
        #: (:func:`~.code_check.code_bindings`); ``value`` is :data:`~.bindings.MISSING` where a
        #: class earlier in an MRO must not define the name
        self.bindings: list[Binding] = []
        self.seen: set[int] = set()
        #: ``id``s of the functions whose own parts are bindings already (:meth:`function_parts`)
        self.parted: set[int] = set()
        self.keep: list[Any] = []  # keeps visited objects alive, so ids stay unique
        self.todo: list[_Todo] = []
        self.names: set[str] = set(_ENTRY_POINTS)
        self.pending: dict[str, list[_Todo]] = {}
        #: ``id`` of a class's ``vars()`` proxy (a binding's namespace) -> the class, to assign to it
        self.owners: dict[int, type] = {}
        #: ``(where, holder's namespace, name, object)``: objects held by modules (or by held
        #: objects) that code may read, to follow once the names code reads are known
        #: (:func:`~.held_objects.follow_held`)
        self.objects: list[tuple[str, Any, Any, Any]] = []
        #: modules the code reads (``settings`` of ``settings.SCALE``, ``F`` of ``F.silu``), by
        #: ``id``: their globals are read once code reads their names
        #: (:func:`~.held_objects.follow_held`)
        self.modules: dict[int, types.ModuleType] = {}

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
            # the function it calls, followed, and the arguments it binds, read as data
            # (``functools.partial(scale, k=2.0)``, its ``keywords["k"] = 5.0`` after bridging)
            found: list[_Todo] = [(f"{where}.func", value.func, ())]
            if self.first_visit(value):
                parts = Attributes(value)
                for name in ("args", "keywords"):
                    self.read_value((f"{where}.{name}", parts, name, getattr(value, name)), found)
            self.todo.extend(reversed(found))
            return
        elif isinstance(value, types.MethodType):
            # a bound method: its function, and the object it is bound to read as data (``SCALE =
            # S.scale`` reads ``S.k``); a module's state is its own guard's
            if not isinstance(value.__self__, torch.nn.Module):
                found = []
                self.read_value((f"{where}.__self__", Attributes(value), "__self__", value.__self__), found)
                self.todo.extend(reversed(found))
            value = value.__func__
        elif (wrapped := wrapper_of(value)) is not None:  # a functools.lru_cache object: the function it caches
            self.entries.append((where, type(value).__qualname__))
            self.todo.append((f"{where}.__wrapped__", wrapped, ()))
            return
        if isinstance(value, types.FunctionType):
            self.function(where, value)
        elif isinstance(value, type):
            self.cls(value)
        elif isinstance(value, Mapping) and (data_container(value) or not versioned(type(value).__module__)):
            self.mapping(where, value)
        elif data_container(value):
            self.sequence(where, value)

    def function(self, where: str, function: types.FunctionType) -> None:
        self.entries.append((where, function_digest(function)))
        if versioned(function.__module__) or not self.first_visit(function):
            return
        own = self.function_parts(function)
        found: list[_Todo] = []
        cells, wrapper = ClosureCells(function), plumbing_code(function)
        for name in cells.cells:
            if name == "__class__":  # the class a method using ``super()`` is defined in: walked with it
                continue
            if wrapper:  # nnbridge's and nnsight's own wrappers: the code they wrap, not their bookkeeping
                if holds_code(content := cells.get(name, MISSING)):
                    found.append((f"{own}.<closure>.{name}", content, ()))
            else:
                # a closure's cells are read as globals are (``n = [0]`` counted up by ``n[0] += 1``,
                # a ``scale`` a setter assigns with ``nonlocal``): a plain value or tensor by value
                self.read_global(cells, name, module=f"{own}.<closure>", found=found)
        wrapped = getattr(function, "__wrapped__", None)
        if wrapped is not None:
            found.append((f"{function.__qualname__}.__wrapped__", wrapped, ()))
        namespace = function.__globals__
        names = dict.fromkeys(global_names(function.__code__))
        if not ENVIRONMENT_READS.isdisjoint(names):
            for variable in dict.fromkeys(variable_names(function.__code__)):
                where_found, value = f"os.environ[{variable!r}]", ENVIRONMENT[variable]
                self.entries.append((where_found, repr(value)))
                self.bindings.append((where_found, ENVIRONMENT, variable, value))
        for name in names:
            if name not in self.names:
                self.names.add(name)
                found.extend(self.pending.pop(name, ()))
            self.read_global(namespace, name, module=function.__module__, found=found)
        # attribute names spelt as string constants (``getattr(self.hp, "scale")``) are read too
        for constant in string_constants(function.__code__):
            if constant.isidentifier() and constant not in self.names:
                self.names.add(constant)
                found.extend(self.pending.pop(constant, ()))
        self.todo.extend(reversed(found))

    def function_parts(self, function: types.FunctionType) -> str:
        """``function``'s own parts (:data:`~.bindings.FUNCTION_PARTS`), each a binding, and its
        defaults an entry; returns its qualified name. Defaults count only where there are some: a
        call of a function without them passed every argument, so defaults assigned later change
        none of the calls a graph holds."""
        parts, own = FunctionParts(function), f"{function.__module__}.{function.__qualname__}"
        if id(function) in self.parted:
            return own
        self.parted.add(id(function))
        self.keep.append(function)
        self.bindings.extend((f"{own}.{name}", parts, name, getattr(function, name)) for name in FUNCTION_PARTS
                             if name == "__code__" or getattr(function, name) is not None)
        if function.__defaults__ or function.__kwdefaults__:
            self.entries.append((f"{own}.__defaults__", defaults_text(function)))
            # a default holding data that can be written in place (``table=TABLES``, a dict of
            # arrays): read as a global is; plain ones and code are in the text above (the tuple
            # and dict of defaults are bindings: their items assigned anew are a change)
            positional, keywords = function.__defaults__ or (), function.__kwdefaults__ or {}
            defaults: list[Binding] = [(f"{own}.__defaults__[{index}]", SequenceItems(positional), index, value)
                                       for index, value in enumerate(positional)]
            defaults += [(f"{own}.__kwdefaults__[{name!r}]", keywords, name, value) for name, value in keywords.items()]
            found: list[_Todo] = []
            for binding in defaults:
                value = binding[3]
                if not (type(value) in PLAIN_READ or holds_code(value, (type,))
                        or (isinstance(value, (tuple, frozenset)) and plain_value(value))):
                    self.read_value(binding, found)
            self.todo.extend(reversed(found))
        return own

    def read_global(self, namespace: Mapping[str, Any] | ClosureCells, name: str, *, module: str,
                    found: list[_Todo]) -> None:
        """What the global ``name`` of ``module`` (its ``namespace``), read by a function's code,
        holds: code to follow (appended to ``found``), or a value that is an entry and a binding
        (:meth:`read_value`)."""
        if name in namespace:
            binding = (f"{module}.{name}", namespace, name, namespace[name])
            if not self.read_value(binding, found):
                self.identity(binding)
                if isinstance(binding[3], types.ModuleType):
                    # a module (``import settings``; ``settings.SCALE``; ``F.silu``): the globals
                    # of it the code reads, once the names it reads are known
                    self.modules.setdefault(id(binding[3]), binding[3])

    def identity(self, binding: Binding) -> None:
        """``binding``'s value by identity (a logger, a lock, a module, a built-in function such as
        ``torch.tanh``: assigned anew is a change), in the digest by
        :func:`~.code_objects.identity_text`."""
        self.entries.append((binding[0], identity_text(binding[3])))
        self.bindings.append(binding)

    def read_value(self, binding: Binding, found: list[_Todo]) -> bool:
        """The ``value`` of ``binding``, ``(where_found, namespace, name, value)``, found as
        ``namespace[name]`` (a global, a closure cell, an item of a global container): code or a
        container to follow (appended to ``found``), or a value that is an entry and a binding.
        False for a value of another kind (not read: an object that is neither code, data nor
        settings; :meth:`identity` binds it)."""
        where_found, namespace, name, value = binding
        if data_container(value) and plain_value(value, tensors=True):
            # a global container of plain values or tensors (``SCALES = [1.0, 2.0]``, a ``deque``,
            # an ``array.array``): by value in the digest; assigned anew or written in place fails
            # the check (see CodeCheck)
            self.entries.append((where_found, canonical_repr(value)))
            self.bindings.append((where_found, namespace, name, value))
        elif holds_code(value, (type, Mapping)) or data_container(value):
            # code, a mapping (a registry of functions, a dict of settings) or another container
            # of data (``HOOKS = [f, g]``, ``STORE = [np.zeros(4)]``, a ``deque`` of arrays):
            # followed item by item
            found.append((where_found, value, ((where_found, namespace, name, value),)))
        elif type(value) in PLAIN_READ:
            # a plain global (``SCALE = 2.0``, a flag) a graph bakes in: its value is part of
            # the digest, and assigning it anew fails the check (re-extraction)
            self.entries.append((where_found, repr(value)))
            self.bindings.append((where_found, namespace, name, value))
        elif isinstance(value, torch.Tensor):
            # a global tensor a graph bakes in as a constant: its values are part of the digest,
            # and assigning it anew or writing it in place fails the check (see CodeCheck)
            self.entries.append((where_found, tensor_digest(value)))
            self.bindings.append((where_found, namespace, name, value))
        elif writable_array(value) is not None:
            # a global array (``SCALES = np.array([2.0])``) a graph bakes in what it read of: its
            # bytes are part of the digest, and assigning it anew or writing it in place fails the
            # check (see CodeCheck)
            self.entries.append((where_found, array_digest(value)))
            self.bindings.append((where_found, namespace, name, value))
        elif isinstance(value, contextvars.ContextVar):
            # a context variable (``ABLATE.get()``): its value in the calling context
            held = ContextValue(value)
            self.bindings.append((where_found, namespace, name, value))
            self.entries.append((f"{where_found}.get()", repr(held["value"])))
            self.bindings.append((f"{where_found}.get()", held, "value", held["value"]))
        elif isinstance(value, types.BuiltinMethodType) and value.__self__ is not None \
                and not isinstance(value.__self__, (types.ModuleType, torch.nn.Module)):
            # a bound built-in method (``GET = TABLE.get``, ``ADD = LOG.append``): by identity, and
            # the object it is bound to read as data
            self.entries.append((where_found, f"{type(value.__self__).__qualname__}.{value.__name__}"))
            self.bindings.append(binding)
            self.read_value((f"{where_found}.__self__", Attributes(value), "__self__", value.__self__), found)
        elif generator_state(value) is not None:
            # a random generator object (``RNG = random.Random(0)``): by identity; a forward drawing
            # from it runs its own code, and extraction's runs put its state back (see global_state)
            self.entries.append((where_found, type(value).__qualname__))
            self.bindings.append((where_found, namespace, name, value))
        elif settings_object(value):
            # a global object of settings (``STATE = SimpleNamespace(enabled=False)``, a
            # dataclass, an instance of the script's own class): its plain attributes
            self.entries.append((where_found, type(value).__qualname__))
            self.bindings.append((where_found, namespace, name, value))
            if self.first_visit(value):
                self.plain_attributes(where_found, vars(value), found=found)
                # the objects of settings it holds, followed as a module's held objects are: through
                # the names code reads (``CFG.sub.scale``; see :func:`~.held_objects.follow_held`)
                attributes = vars(value)
                self.objects.extend((f"{where_found}.{attribute}", attributes, attribute, item)
                                    for attribute, item in list(attributes.items())
                                    if not (attribute.startswith("__") and attribute.endswith("__"))
                                    and settings_object(item))
            # and its class's code: ``__call__`` when the object is called like a function, any
            # other method once code reads its name (a torch or standard-library class is left out)
            self.cls(type(value))
        else:
            return False
        return True

    def plain_attributes(self, where: str, attributes: Mapping[str, Any], *, found: list[_Todo],
                         owner: type | None = None) -> None:
        """The plain values (and containers of them), tensors and arrays in an object's or a class's
        (``owner``'s) ``attributes``: in the digest by value, each a binding (assigning one anew or
        writing into a container, a tensor or an array re-extracts); a container of other data
        (``CFG.tables = {"a": np.ones(4)}``) as a global's (:meth:`read_value`, appended to ``found``)."""
        if owner is not None:
            self.owners[id(attributes)] = owner
        for name, value in list(attributes.items()):
            if name.startswith("__") and name.endswith("__"):
                continue
            if type(value) in PLAIN_READ or (data_container(value) and plain_value(value, tensors=True)):
                self.entries.append((f"{where}.{name}", canonical_repr(value)))
                self.bindings.append((f"{where}.{name}", attributes, name, value))
            elif isinstance(value, torch.Tensor) or writable_array(value) is not None:
                # a tensor or an array (``CFG.table = np.ones(4)``): by its values, as a global's
                self.entries.append((f"{where}.{name}", canonical_repr(value) if isinstance(value, torch.Tensor)
                                     else array_digest(value)))
                self.bindings.append((f"{where}.{name}", attributes, name, value))
            elif data_container(value):
                self.read_value((f"{where}.{name}", attributes, name, value), found)

    def cls(self, cls: type, in_tree: bool = False) -> None:
        """A class's methods, inherited ones included (``torch.nn.Module``'s and ``object``'s left
        out); a torch or standard-library class only when it is a module class of the tree."""
        if (not in_tree and versioned(cls.__module__)) or not self.first_visit(cls):
            return
        found: list[_Todo] = []
        for owner in cls.__mro__:
            if owner in (object, torch.nn.Module) or versioned(owner.__module__):
                continue
            if not in_tree:  # a class the code names (``if Flags.ablate:``)
                self.plain_attributes(owner.__qualname__, vars(owner), owner=owner, found=found)
            else:  # a module class: its plain values are module state (StateGuard's), the other data here
                self.class_data(owner, found)
        self.todo.extend(reversed(found))
        resolved: set[str] = set()
        for index, owner in enumerate(cls.__mro__):
            if owner in (object, torch.nn.Module):
                continue
            for name, attribute in list(vars(owner).items()):
                if isinstance(attribute, (*CODE_HOLDERS, staticmethod, classmethod, property)):
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

    def class_data(self, owner: type, found: list[_Todo]) -> None:
        """The tensors, arrays and containers of other values among a module class's own
        attributes (``TABLE = {"a": np.ones(4)}``, ``ARR = np.ones(4)`` read as ``self.TABLE``):
        each read as a global is (:meth:`read_value`), a binding on the class."""
        attributes = vars(owner)
        for name, value in list(attributes.items()):
            if (name.startswith("__") and name.endswith("__")) or type(value) in PLAIN_READ:
                continue
            if isinstance(value, torch.Tensor) or writable_array(value) is not None or (
                    data_container(value) and not plain_value(value, tensors=True)):
                self.owners[id(attributes)] = owner
                self.read_value((f"{owner.__qualname__}.{name}", attributes, name, value), found)

    def mapping(self, where: str, mapping: Mapping[Any, Any]) -> None:
        """A mapping's items: in a ``dict`` or a mapping of the standard library (an
        ``OrderedDict``, a ``defaultdict``), each item (:meth:`data_item`: ``STORE = {"table":
        np.ones(4)}``); in another mapping type, which has its own lookup (transformers'
        ``AttentionInterface`` looks in a local mapping first), the code it holds, followed."""
        if not self.first_visit(mapping):
            return
        try:
            items = list(dict.items(mapping) if isinstance(mapping, dict) else mapping.items())
        except Exception:  # noqa: BLE001 - a mapping that cannot be listed counts by its type only
            self.entries.append((where, type(mapping).__qualname__))
            return
        if len(items) > MAPPING_LIMIT:
            return
        data = data_container(mapping)
        found: list[_Todo] = []
        for key, value in items:
            item = f"{where}[{key!r}]"
            if data:
                self.data_item((item, mapping, key, value), found)
            elif holds_code(value, (type,)):
                found.append((item, value, ((item, mapping, key, value),)))
        self.todo.extend(reversed(found))

    def sequence(self, where: str, sequence: Any) -> None:
        """A sequence's items, when not all plain (``TABLES = [np.ones(4)]``, ``HOOKS = [f, g]``, a
        ``deque`` of arrays): each by index (:meth:`data_item`, :class:`~.bindings.SequenceItems`);
        its length is an entry. A set's items have no index: its members count as the check's copy
        of it (:class:`~.code_check.CodeCheck`), its length as an entry."""
        if not self.first_visit(sequence) or len(sequence) > MAPPING_LIMIT:
            return
        self.entries.append((where, f"{type(sequence).__name__} of {len(sequence)}"))
        if isinstance(sequence, AbstractSet):
            return
        items = SequenceItems(sequence)
        found: list[_Todo] = []
        for index, value in enumerate(sequence):
            self.data_item((f"{where}[{index}]", items, index, value), found)
        self.todo.extend(reversed(found))

    def data_item(self, binding: Binding, found: list[_Todo]) -> None:
        """An item of a dict, list or tuple, ``binding`` ``(where, container or its
        :class:`~.bindings.SequenceItems`, key, value)``: a value read as a global is (:meth:`read_value`: a
        plain value, tensor, array, object of settings, or a container followed in turn); code (a
        function, class or method: ``ACTS["gelu"]``, a dict of loss functions) by identity, its
        own code in the digest and a function's own parts bindings (its ``__code__`` or defaults
        assigned anew is a change), the code it reaches not followed (a registry of functions
        reaches far more code than one forward runs); anything else (a logger, a lock) by identity,
        its type in the digest."""
        where, _, _, value = binding
        if holds_code(value, (type,)):
            self.entries.append((where, function_digest(value) if isinstance(value, types.FunctionType)
                                 else f"{type(value).__qualname__} {getattr(value, '__qualname__', '')}"))
            self.bindings.append(binding)
            if isinstance(value, types.FunctionType) and not versioned(value.__module__):
                self.function_parts(value)  # (its code or defaults assigned anew is a change)
        elif not self.read_value(binding, found):
            self.identity(binding)
