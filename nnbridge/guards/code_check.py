"""The code guard: whether the lookups a model's code made when it was extracted still find the
same objects, so code replaced after bridging extracts again instead of running the old graph.

:func:`code_bindings` lists the lookups of the code walk (:mod:`.code_walk`, started by
:mod:`.model_code`) that found code or a value a graph bakes in: a module global, a class
attribute (a method assigned to a class, or defined on a subclass later), a registry entry, a
function's own ``__code__``/``__defaults__``/``__kwdefaults__``, an environment variable, a
context variable, the attributes of a held object (:mod:`.held_objects`). :class:`CodeCheck`
compares them on every call by identity, global tensors by version, global containers of
plain values by a copy, arrays by their bytes, and the keys, members or length of containers
whose items are bindings; :meth:`CodeCheck.what_changed` names the first that changed
(``"transformers.models.gpt2.modeling_gpt2.eager_attention_forward was replaced"``).

*State* here means what those lookups found when the check was made (objects, tensor versions,
copies of containers), held by one :class:`CodeCheck`; it is part of the module state
:class:`~.module_state.StateGuard` guards.
"""

from __future__ import annotations

import operator
import types
from collections.abc import Mapping, Set as AbstractSet
from typing import Any

import torch

from ..compat.torch.capture import tensor_version
from .bindings import ENVIRONMENT, FUNCTION_PARTS, MISSING, Binding, ClosureCells, FunctionParts
from .code_objects import data_container
from .code_walk import MAPPING_LIMIT
from .model_code import walked
from .plain_values import array_bytes, plain_value, snapshot, writable_array


def _shape(container: Any) -> set[Any] | int:
    """A mapping's keys, a set's members or a sequence's length: what tells an item added to a
    container whose items are bindings."""
    return set(container) if isinstance(container, (Mapping, AbstractSet)) else len(container)


#: What a closure cell holds now (raises ``ValueError`` for an empty cell).
_CONTENTS = operator.attrgetter("cell_contents")


def code_bindings(model: torch.nn.Module, skip: AbstractSet[int] = frozenset()) -> list[Binding]:
    """The lookups :func:`~.code_digest.code_digest` walks that found code, as ``(where,
    namespace, name, value)``: a module global, a class attribute (with
    :data:`~.bindings.MISSING` for the classes earlier in its MRO), a registry entry; each
    namespace and name once. :class:`CodeCheck` tells whether one has changed since (a method or
    helper assigned anew). ``skip``: ``id``s of modules left out with their subtrees (modules that
    run their own code: what their code reads is read live)."""
    unique: dict[tuple[int, Any], Binding] = {}
    for binding in walked(model, skip).bindings:
        unique.setdefault((id(binding[1]), binding[2]), binding)
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
        parts: dict[str, tuple[list[types.FunctionType], list[Any]]] = {name: ([], []) for name in FUNCTION_PARTS}
        self._cells: list[types.CellType] = []
        self._cell_values: list[Any] = []
        for _, namespace, name, value in bindings:
            if type(namespace) is FunctionParts:
                parts[name][0].append(namespace.function)
                parts[name][1].append(value)
                continue
            if type(namespace) is ClosureCells:  # the cells themselves, read in one C-level ``map``
                self._cells.append(namespace.cells[name])
                self._cell_values.append(value)
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
                            if data_container(value) and plain_value(value, tensors=True)]
        self._copies = [snapshot(value) for value in self._containers]
        # arrays (a global or held numpy array): their bytes (a write into one changes what a graph baked in)
        self._arrays = [value for _, _, _, value in bindings if writable_array(value) is not None]
        self._bytes = [array_bytes(value) for value in self._arrays]
        # global containers whose items the walk read one by one (``STORE = {"table": np.ones(4)}``,
        # ``HOOKS = [f, g]``, a ``deque`` of arrays; each item is a binding of its own): their keys,
        # members or length (an item added)
        self._read = [value for _, _, _, value in bindings if data_container(value)
                      and not isinstance(value, (tuple, frozenset))
                      and len(value) <= MAPPING_LIMIT and not plain_value(value, tensors=True)]
        self._shapes = list(map(_shape, self._read))

    def holds(self) -> bool:
        if self._tensors and list(map(tensor_version, self._tensors)) != self._versions:
            return False
        try:
            if self._containers and self._containers != self._copies:
                return False
            if self._arrays and list(map(array_bytes, self._arrays)) != self._bytes:
                return False
            if self._read and list(map(_shape, self._read)) != self._shapes:
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
            if not all(map(operator.is_, map(_CONTENTS, self._cells), self._cell_values)):
                return False  # (an emptied cell raises: changed too)
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
        for array, saved in zip(self._arrays, self._bytes):
            if array_bytes(array) != saved:
                where = next(w for w, _, _, value in self.bindings if value is array)
                return f"{where} was written in place"
        for container, shape in zip(self._read, self._shapes):
            if _shape(container) != shape:
                where = next(w for w, _, _, value in self.bindings if value is container)
                return f"{where} was written in place"
        return replaced(self.bindings)
