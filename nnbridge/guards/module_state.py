"""Guards on module state: what an extraction bakes in besides the call's structure.

A graph is a snapshot of one eager run. Besides the call (see :mod:`.call_structure`) it bakes in
the state of the module tree it ran on, like Dynamo's guards on ``self``:

- every module's plain attribute values (numbers, bools, strings, enums, dtypes, devices, None):
  ``self.temperature``, ``self.training``, ``self.scale``; and those of its ``config`` object
  (``config.output_hidden_states``, ``config.use_cache``), nested configs included;
- the identity of every child module (a replaced or wrapped submodule, e.g. a LoRA wrapper), and
  the class of every module whose code the graphs hold (``module.__class__ = Sub``);
- the identity, dtype, device, shape and requires_grad of every parameter, buffer and plain tensor attribute
  (``.double()``, ``.to(...)``, a re-assigned weight or mask);
- what the code's lookups find (:class:`~.code_check.CodeCheck`): a method of a module class, a
  helper function of a modeling file or an attention-registry entry assigned anew
  (``modeling_gpt2.eager_attention_forward = f``) re-extracts, as Dynamo's guards on globals
  recompile.

:class:`StateGuard` snapshots all of it right after an extraction and :meth:`StateGuard.holds`
compares it on every call: plain values and children with dict item-view comparisons, tensors by
identity and properties, each kind in one C-level ``map`` over all modules. A module that runs
eagerly (opaque) reads its own state live, so only its children's identity is guarded, with the
ModuleList/ModuleDict containers it reaches them through (it runs with copies of those made at
extraction, holding its children's dispatchers), and nothing else below it (its children have
dispatchers of their own).

Example::

    guard = StateGuard(model, opaque=set())
    model.config.use_cache = False
    guard.holds()            # False
    guard.what_changed()     # "config of '<root>' (GPT2Config): use_cache changed True -> False"

*State* here means module state: everything listed above, as one :class:`StateGuard` snapshots
it. Not the module globals the code reads (:mod:`.global_state`), nor torch's global state (grad
mode, autocast: :mod:`.call_structure`), nor the snapshots that put a module back after an eager
run (:mod:`.preservation`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import operator
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..compat.torch.module_dicts import MODULE_SLOTS, modules_of
from ..compat.transformers.output_capturing import MODEL_STATE_ATTRIBUTES
from ..compat.torch.tensor_checks import fast_tensor_check
from ..graph.kinds import CONTAINERS
from .code_check import CodeCheck, code_bindings
from .code_objects import is_plumbing
from .plain_values import HeldTensor, canonical_repr, class_values, config_like, plain_value, snapshot as plain_snapshot

_config_like = config_like

#: ``module.__dict__`` keys that are torch's or another library's bookkeeping, never read by a
#: forward: ``nn.Module``'s own slots (hook dicts, ``_parameters``...; ``training`` is guarded),
#: guarded by kind below, never compared as values (a hook registered later must not re-extract).
_IGNORED = (frozenset({"_is_full_backward_hook", "_compiled_call_impl"}) | MODEL_STATE_ATTRIBUTES
            | (MODULE_SLOTS - {"training"}))
_CONTAINER_TYPES = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)
_TENSOR_PROPERTIES = operator.attrgetter("dtype", "device", "shape", "requires_grad")


#: config attributes whose value differs between processes for one config: transformers'
#: ``GenerationConfig._original_object_hash`` is ``hash()`` of the config's fields, which Python
#: salts per process for strings (a disk-cache key holding it never matched in a second process)
PER_PROCESS_VALUES = frozenset({"_original_object_hash"})


def config_values(config: Any) -> list[tuple[str, str]]:
    """Every plain value of a config-like object (see :func:`_config_like`) and of the config-like
    objects it holds, private ones included (``_attn_implementation_internal``), as sorted
    ``(dotted name, repr)`` pairs: what :class:`StateGuard` guards of a config, for keys that must
    tell two configs apart (the disk cache's, :func:`~.programs.model_fingerprint`)."""
    found: list[tuple[str, str]] = []
    seen: set[int] = set()

    def walk(prefix: str, value: Any) -> None:
        seen.add(id(value))
        for name, item in vars(value).items():
            if name in PER_PROCESS_VALUES:
                continue
            if plain_value(item):
                found.append((f"{prefix}{name}", canonical_repr(item)))
            elif _config_like(name, item) and id(item) not in seen:
                walk(f"{prefix}{name}.", item)
    walk("", config)
    return sorted(found)


class _PartialArguments:
    """A ``functools.partial`` instance attribute as guarded: equal to a partial of the same
    function with equal arguments, so writing into its ``keywords`` (or assigning a partial with
    other arguments) is a change. (The function itself is a binding of :class:`CodeCheck`.)"""

    __slots__ = ("func", "args", "keywords")
    __hash__ = None  # type: ignore[assignment]

    @staticmethod
    def applies(value: object) -> bool:
        return isinstance(value, functools.partial) and not is_plumbing(value)

    def __init__(self, value: functools.partial[Any]):
        self.func, self.args, self.keywords = value.func, value.args, dict(value.keywords)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (_PartialArguments, functools.partial)):
            return False
        return other.func is self.func and _same(other.args, self.args) and _same(other.keywords, self.keywords)

    def __repr__(self) -> str:
        return f"functools.partial({self.func!r}, *{self.args!r}, **{self.keywords!r})"


class StateGuard:
    """The module state an extraction depends on (see the module docstring).

    Args:
        root: the extracted module.
        opaque: ``id``s of modules that run eagerly; their attributes and subtrees are not guarded,
            only their children's identity.
        skip: ``fn(child) -> bool`` for children that are nnbridge's own (op points): not guarded.
        path: the root's path, for messages.
    """

    def __init__(self, root: torch.nn.Module, *, opaque: set[int],
                 skip: Callable[[torch.nn.Module], bool] | None = None, path: str = ""):
        self._plain: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
        self._child_slots: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
        self._tensors: list[tuple[str, dict[str, Any], str, torch.Tensor, torch.dtype, torch.device, torch.Size, bool]] = []
        # (where, live dict, its size): a parameter, buffer, child, attribute or config entry added
        # later (``register_buffer``, ``m.use_gate = True`` where forward uses ``hasattr``) changes it
        self._sizes: list[tuple[str, dict[str, Any], int]] = []
        # (where, holder's dict, name, object): each config-like object held, by identity (one
        # assigned anew, ``m.settings = Settings(...)``, is another object to guard)
        self._held: list[tuple[str, dict[str, Any], str, Any]] = []
        # (where, module, its class): the graphs hold the code of each module's class
        self._typed: list[tuple[str, torch.nn.Module, type]] = []
        self._skip = skip
        seen_configs: set[int] = set()
        classes: list[type] = []
        for where, module in self._walk(root, path, opaque, skip=skip):
            children = {name: child for name, child in modules_of(module).items()
                        if child is not None and not (skip is not None and skip(child))}
            self._child_slots.append((where, modules_of(module), children))
            self._sizes.append((where, modules_of(module), len(children)))
            if id(module) in opaque:
                continue
            classes.append(type(module))
            self._typed.append((where, module, type(module)))
            state = module.__dict__  # (its size is not guarded: nnsight and others add entries)
            guarded: dict[str, Any] = {}  # plain values (containers may hold tensors), partials' arguments
            for name, value in state.items():
                if name in _IGNORED:
                    continue
                if plain_value(value, tensors=True):
                    guarded[name] = plain_snapshot(value)
                elif _PartialArguments.applies(value):
                    guarded[name] = _PartialArguments(value)
            self._plain.append((where, state, guarded))
            for store_name in ("_parameters", "_buffers"):
                store = state.get(store_name)
                if store is None:
                    continue
                self._sizes.append((f"{store_name[1:-1]} of {where}", store, len(store)))
                for name, tensor in store.items():
                    if tensor is not None:
                        self._add_tensor(where, store, name, tensor=tensor)
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    self._add_tensor(where, state, name, tensor=value)
                elif _config_like(name, value):
                    self._held.append((f"{name} of {where}", state, name, value))
                    if id(value) not in seen_configs:
                        self._add_config(f"{name} of {where}", value, seen_configs)
        # plain class attributes (``Cls.gain = 3.0``, a base class's list written in place), as each
        # module class resolves them: ``(class, name, snapshot)``
        self._class_values = [(cls, name, plain_snapshot(value)) for cls in dict.fromkeys(classes)
                              for name, value in class_values(cls).items()]
        # an opaque module's code reads its globals live (one that writes them is opaque: .global_state)
        self._code_check = CodeCheck(code_bindings(root, skip=opaque))
        self._prepare()

    def _prepare(self) -> None:
        """Parallel lists of what :meth:`holds` compares, so that each kind of comparison is one
        C-level ``map`` over all modules instead of a Python loop (see :meth:`holds`)."""
        pairs = self._plain + self._child_slots
        self._snapshot_views = [snapshot.items() for _, _, snapshot in pairs]
        self._live_views = [live.items() for _, live, _ in pairs]
        self._sized = [live for _, live, _ in self._sizes]
        #: per entry of ``_sizes``, a length of its live dict known to hold the guarded entries
        #: (the guarded size, or a longer length counted once: see :meth:`_recount`)
        self._lengths = [size for _, _, size in self._sizes]
        self._stores = [store for _, store, *_ in self._tensors]
        self._names = [name for _, _, name, *_ in self._tensors]
        self._objects = [tensor for _, _, _, tensor, *_ in self._tensors]
        self._properties = [tuple(entry[4:]) for entry in self._tensors]
        self._fast_properties = fast_tensor_check(self._objects)  # accepts only: see _tensors_hold
        # every store is a dict in torch 2.13 (``_parameters``, ``_buffers``, ``__dict__``); any
        # other mapping is looked up with its own ``get`` in :meth:`_tensors_hold`
        self._dict_stores = all(isinstance(store, dict) for store in self._stores)
        self._held_stores = [store for _, store, _, _ in self._held]
        self._held_names = [name for _, _, name, _ in self._held]
        self._held_objects = [value for _, _, _, value in self._held]
        self._classes = [cls for cls, _, _ in self._class_values]
        self._class_names = [name for _, name, _ in self._class_values]
        self._class_snapshots = [value for _, _, value in self._class_values]
        self._typed_modules = [module for _, module, _ in self._typed]
        self._types = [cls for _, _, cls in self._typed]

    @staticmethod
    def _walk(module: torch.nn.Module, where: str, opaque: set[int], *, skip: Callable[[torch.nn.Module], bool] | None
              ) -> Iterator[tuple[str, torch.nn.Module]]:
        """``(path, module)`` of the tree, without the subtrees of opaque modules; then the
        ModuleList/ModuleDict containers an opaque module reaches its children through: the opaque
        module runs with them swapped for copies made when it was extracted, holding its children's
        dispatchers (:func:`~nnbridge.graph.module_tree.direct_callees`,
        :func:`~nnbridge.extract.assembly.container_like`), so their registries and state are guarded."""
        seen: set[int] = set()
        stack = [(where or "<root>", module, False)]  # (path, module, under an opaque module)
        inside: list[tuple[str, torch.nn.Module, bool]] = []  # walked once the tree is done
        while stack or inside:
            path, current, under = stack.pop() if stack else inside.pop()
            if id(current) in seen:
                continue
            seen.add(id(current))
            yield path, current
            hidden = under or id(current) in opaque
            for name, child in modules_of(current).items():
                if child is None or (skip is not None and skip(child)):
                    continue
                if hidden and not isinstance(child, CONTAINERS):  # (opaque: only its containers)
                    continue
                (inside if hidden else stack).append((f"{path}.{name}" if path != "<root>" else name, child, hidden))

    def _add_tensor(self, where: str, store: dict[str, Any], name: str, *, tensor: torch.Tensor) -> None:
        self._tensors.append((f"{where}.{name}" if where != "<root>" else name, store, name, tensor,
                              tensor.dtype, tensor.device, tensor.shape, tensor.requires_grad))

    def _add_config(self, where: str, config: Any, seen: set[int]) -> None:
        seen.add(id(config))
        state = vars(config)
        self._sizes.append((f"{where} ({type(config).__name__})", state, len(state)))
        self._plain.append((f"{where} ({type(config).__name__})", state,
                            {k: plain_snapshot(v) for k, v in state.items() if plain_value(v)}))
        for name, value in state.items():
            if _config_like(name, value):
                self._held.append((f"{name} of {where}", state, name, value))
                if id(value) not in seen:
                    self._add_config(f"{name} of {where}", value, seen)

    def _size(self, live: dict[str, Any]) -> int:
        """Entries of ``live`` that are guarded (children: nnbridge's own op points excluded)."""
        return sum(1 for v in live.values() if not (self._skip is not None and isinstance(v, torch.nn.Module)
                                                    and self._skip(v)))

    def holds(self) -> bool:
        """Whether the module state still equals the snapshot (asked in each bridged call's lookup)."""
        if torch.compiler.is_dynamo_compiling():
            # torch.compile traces through this check: the plain loops, which it traces, and not
            # the C-level lookups of code (code replaced after compiling is not seen there)
            return self._holds_traced()
        try:
            if not all(map(operator.le, self._snapshot_views, self._live_views)):
                return False
        except Exception:  # noqa: BLE001 - a value whose == raises has changed
            return False
        lengths = list(map(len, self._sized))
        if lengths != self._lengths and not self._recount(lengths):
            return False
        return (self._tensors_hold() and all(map(operator.is_, map(dict.get, self._held_stores, self._held_names),
                                                 self._held_objects))
                and all(map(operator.is_, map(type, self._typed_modules), self._types))
                and self._class_values_hold() and self._code_check.holds())

    def _class_values_hold(self) -> bool:
        try:
            return list(map(getattr, self._classes, self._class_names)) == self._class_snapshots
        except Exception:  # noqa: BLE001 - deleted, or a value whose == raises: changed
            return False

    def _recount(self, lengths: list[int]) -> bool:
        """Whether the dicts whose length moved still hold exactly the guarded entries: a module
        dict holding nnbridge's op points is longer than its guarded size, so its entries are
        counted again only when its length moves (then the new length is known to hold)."""
        for index, (length, known) in enumerate(zip(lengths, self._lengths)):
            if length != known:
                if self._size(self._sized[index]) != self._sizes[index][2]:
                    return False
                self._lengths[index] = length
        return True

    def _tensors_hold(self) -> bool:
        """Every guarded tensor is still the one in its store, with its dtype, device, shape and
        requires_grad (``module.to(...)`` changes a parameter in place)."""
        current: Iterable[Any]
        if self._dict_stores:
            current = map(dict.get, self._stores, self._names)
        else:
            current = (store.get(name) for store, name in zip(self._stores, self._names))
        if not all(map(operator.is_, current, self._objects)):
            return False
        # torch's C-level check (several times cheaper than the comparison below) is stricter
        # (strides, dispatch keys): when it fails the exact comparison decides
        if self._fast_properties is not None and self._fast_properties():
            return True
        return list(map(_TENSOR_PROPERTIES, self._objects)) == self._properties

    def _holds_traced(self) -> bool:
        """:meth:`holds` as plain loops, for Dynamo to trace (see :meth:`holds`)."""
        try:
            for _, live, snapshot in self._plain:
                for key, value in snapshot.items():
                    if key not in live or not _traced_equal(live[key], value):
                        return False
            for _, live, snapshot in self._child_slots:
                if not snapshot.items() <= live.items():
                    return False
        except Exception:  # noqa: BLE001 - a value whose == raises has changed
            return False
        for _, live, size in self._sizes:
            if len(live) != size and self._size(live) != size:
                return False
        for _, store, name, tensor, dtype, device, shape, requires_grad in self._tensors:
            current = store.get(name)
            if (current is not tensor or current.dtype != dtype or current.device != device or current.shape != shape
                    or current.requires_grad != requires_grad):
                return False
        for _, store, name, value in self._held:
            if store.get(name) is not value:
                return False
        for cls, name, value in self._class_values:
            if not _traced_equal(getattr(cls, name, None), value):
                return False
        for _, module, cls in self._typed:
            if type(module) is not cls:
                return False
        return True

    def what_changed(self) -> str | None:
        """The first difference from the snapshot, in words; None when :meth:`holds`."""
        missing = object()
        for where, live, snapshot in self._plain:
            for key, value in snapshot.items():
                now = live.get(key, missing)
                if now is missing:
                    return f"attribute {key!r} of {where} was deleted"
                if not _same(now, value):
                    return f"attribute {key!r} of {where} changed {value!r} -> {now!r}"
        for where, live, snapshot in self._child_slots:
            for key, child in snapshot.items():
                now = live.get(key, missing)
                if now is not child:
                    what = "removed" if now is missing else f"replaced by a {type(now).__name__}"
                    return f"child {key!r} of {where} ({type(child).__name__}) was {what}"
        for path, store, name, tensor, dtype, device, shape, requires_grad in self._tensors:
            current = store.get(name)
            if current is None:
                return f"tensor {path} was removed"
            if current is not tensor:
                return f"tensor {path} was re-assigned"
            if current.dtype != dtype or current.device != device:
                return f"tensor {path} moved from {dtype}/{device} to {current.dtype}/{current.device}"
            if current.shape != shape:
                return f"tensor {path} changed shape {tuple(shape)} -> {tuple(current.shape)}"
            if current.requires_grad != requires_grad:
                return f"tensor {path} changed requires_grad {requires_grad} -> {current.requires_grad}"
        for where, store, name, value in self._held:
            if store.get(name) is not value:
                return f"config-like object {where} ({type(value).__name__}) was replaced or removed"
        for where, module, cls in self._typed:
            if type(module) is not cls:
                return f"the class of {where} changed {cls.__qualname__} -> {type(module).__qualname__}"
        for cls, name, value in self._class_values:
            now = getattr(cls, name, missing)
            if now is missing or not _same(now, value):
                found = "(deleted)" if now is missing else repr(now)
                return f"class attribute {cls.__qualname__}.{name} changed {value!r} -> {found}"
        for where, live, size in self._sizes:
            if len(live) != size and self._size(live) != size:
                return f"entries of {where} were added or removed ({size} -> {len(live)})"
        code = self._code_check.what_changed()
        return None if code is None else f"code the modules run changed: {code}"

    def describe(self) -> list[str]:
        """What is guarded, one line per kind (for :func:`nnbridge.explain`)."""
        plain = sum(len(snapshot) for _, _, snapshot in self._plain)
        children = sum(len(snapshot) for _, _, snapshot in self._child_slots)
        return [f"{plain} plain attribute values (modules and configs)",
                f"{len(self._class_values)} plain class attribute values", f"identity of {children} child modules",
                f"class of {len(self._typed)} modules",
                f"identity, dtype, device, shape and requires_grad of {len(self._tensors)} tensors",
                f"what {len(self._code_check.bindings)} lookups of methods, helper functions, registry entries and"
                " attributes of objects held by modules (followed by the names the code reads) find",
                "by type, read or not: every plain attribute value of a module and of its config; not followed:"
                " an attribute read under a name built at run time (getattr(obj, prefix + name))"]


def _traced_equal(live: object, snapshot: object) -> bool:
    """``live == snapshot`` for a plain value, element by element: Dynamo cannot compare two dicts
    (or sets) it traces as wholes."""
    if isinstance(snapshot, dict):
        if not isinstance(live, dict) or len(live) != len(snapshot):
            return False
        for key, value in snapshot.items():
            if key not in live or not _traced_equal(live[key], value):
                return False
        return True
    if isinstance(snapshot, (list, tuple)):
        if type(live) is not type(snapshot) or len(live) != len(snapshot):
            return False
        for item, value in zip(live, snapshot):
            if not _traced_equal(item, value):
                return False
        return True
    if isinstance(snapshot, (set, frozenset)):
        if not isinstance(live, (set, frozenset)) or len(live) != len(snapshot):
            return False
        for value in snapshot:
            if value not in live:
                return False
        return True
    if isinstance(snapshot, _PartialArguments):
        return snapshot == live
    if isinstance(snapshot, HeldTensor):  # (its version is not traced)
        return live is snapshot.tensor
    return bool(live == snapshot)


def _same(a: object, b: object) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False
