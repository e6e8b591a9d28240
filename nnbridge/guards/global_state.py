"""Module globals a model's code reads: watched for writes while extracting, and put back after
extraction's own runs.

A graph replays tensor operations only. Code that writes a module global in a forward
(``global CALLS; CALLS += 1``, ``STORE.append(x.detach())``, ``TOTALS["n"] += 1``) does so while
it is extracted, never when the graph runs: eager code would write it on every call. Dynamo
replays such writes as side effects after its graph; nnbridge makes the module that wrote the
global run its own code (opaque), as it does for a module writing its own attributes
(:mod:`nnbridge.extract.capture_watch`).

The globals watched are those the code walk (:mod:`.code_walk`, from :mod:`.model_code`) finds
the modules' code reading (a name of a function's code, transitively through helpers) that hold a
plain value, a tensor, or a list, tuple, set or dict of them, and such values held as attributes
of a global object of settings (``STATE.calls += 1``) or of a class the code names
(``Flags.calls += 1``), or in a closure cell of a function the code reaches (``n[0] += 1``);
and random generator objects read these ways or held by an object a module holds (their state,
through :mod:`.rng_objects`: a draw is a write).
The items of a global container holding other values (:func:`~.code_objects.data_container`: a
``dict``, ``list``, ``deque``, ``OrderedDict``, ...) are watched as globals are (``STORE["table"] += 1``
of an array there; :meth:`~.code_walk.CodeWalk.data_item`), and the container itself by the
identity of its items (``STORE["last"] = ...``, ``QUEUE.append(...)``).
Not watched: a global the code creates (absent when bridged), one holding another kind of object
(``LOG = Recorder()`` with a list inside), a write reached only through an attribute chain.

:class:`GlobalValues` is both the watch (:meth:`~GlobalValues.changed`, per module call while
exporting) and the undo (:meth:`~GlobalValues.restore`, after extraction's own eager runs and
exports: a global list does not keep the fake tensors export appended to it).

*State* here means the values of those globals and attributes (an object, a tensor's version, a
copy of a container's contents), as :meth:`GlobalValues.state` reads them: not torch's global
state (grad mode, autocast, the default dtype: part of a call's structure, :mod:`.call_structure`)
and not module state (:mod:`.module_state`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..compat.torch.capture import tensor_version
from .bindings import MISSING, Attributes, Binding, ClosureCells, SequenceItems
from .code_objects import data_container
from .model_code import walked
from .plain_values import PLAIN_TYPES, array_bytes, plain_value, put_back_array, snapshot, writable_array
from .reached_state import copy_container, mutable, put_back, reached, same_container
from .rng_objects import generator_state, same_generator_state, set_generator_state



class _Items:
    """A shallow copy of a container whose items are read one by one (:func:`copy_container`):
    compared by the identity of its items (:func:`same_container`), so a key added or an item
    replaced in a forward is a write."""

    __slots__ = ("copied",)

    def __init__(self, value: Any):
        self.copied = copy_container(value)


def value_bindings(model: torch.nn.Module) -> list[tuple[Binding, type | None]]:
    """The bindings of :func:`~.code_check.code_bindings` whose namespace is a module's globals,
    a function's closure cells, a global dict or list (an item of ``STORE = {"table": np.ones(4)}``),
    an object's ``__dict__`` or a class's attributes (``(binding, the
    class)`` for those; None else): what :class:`GlobalValues` watches and restores."""
    walk = walked(model)
    unique: dict[tuple[int, Any], tuple[Binding, type | None]] = {}
    for binding in walk.bindings:
        namespace = binding[1]
        if isinstance(namespace, (dict, ClosureCells, SequenceItems, Attributes)) or id(namespace) in walk.owners:
            unique.setdefault((id(namespace), binding[2]), (binding, walk.owners.get(id(namespace))))
    return list(unique.values())


def _watched(value: Any) -> bool:
    return (isinstance(value, (*PLAIN_TYPES, torch.Tensor))
            or (data_container(value) and (mutable(value) or plain_value(value, tensors=True)))
            or generator_state(value) is not None or writable_array(value) is not None)


class GlobalValues:
    """The plain module globals the code of ``model``'s modules reads, as they are now.

    Args:
        model: the module whose tree's code is walked (:func:`value_bindings`).
    """

    def __init__(self, model: torch.nn.Module):
        found = [((where, namespace, name), owner) for (where, namespace, name, value), owner in value_bindings(model)
                 if _watched(value)]
        self.entries = [entry for entry, _ in found]
        #: per entry the class whose attribute it is (assigned with setattr), or None
        self.owners = [owner for _, owner in found]
        self.saved = self.state(keep=True)
        # the containers and tensors nested inside watched containers (``LOG[0].append(x)``,
        # :mod:`.reached_state`): put back too
        inside = reached([(where, value) for (where, _, _), (value, _, _) in zip(self.entries, self.saved)
                          if data_container(value)], set())
        self.nested: list[tuple[Any, Any]] = [
            (r.value, r.value.detach().clone() if isinstance(r.value, torch.Tensor) else copy_container(r.value))
            for r in inside if isinstance(r.value, torch.Tensor) or copy_container(r.value) is not None]

    def state(self, keep: bool = False) -> list[tuple[Any, Any, Any]]:
        """Per global ``(value, snapshot for comparison, copy for restoring)``; a tensor's copy of
        its values (what :meth:`restore` writes back after an in-place write) only with ``keep``."""
        result: list[tuple[Any, Any, Any]] = []
        for _, namespace, name in self.entries:
            value = namespace.get(name, MISSING)
            if isinstance(value, torch.Tensor):
                kept = value.detach().clone() if keep and not value.is_meta else None
                result.append((value, tensor_version(value), kept))
            elif mutable(value):  # (a list, dict, set, deque, array.array: its contents)
                compared = snapshot(value) if plain_value(value, tensors=True) else _Items(value)
                result.append((value, compared, copy_container(value)))
            elif (state := generator_state(value)) is not None:
                result.append((value, state, state))
            elif (contents := array_bytes(value)) is not None:  # (an array: by its bytes)
                result.append((value, contents, contents))
            else:
                result.append((value, value, None))
        return result

    def changed(self, before: list[tuple[Any, Any, Any]]) -> str | None:
        """The first global (``module.NAME``) that differs from ``before`` (a :meth:`state`), or
        None; for a random generator object drawn from, ``"the state of module.NAME (Random)"``."""
        for (where, namespace, name), (value, compared, _) in zip(self.entries, before):
            now = namespace.get(name, MISSING)
            if isinstance(value, torch.Tensor):
                if now is not value or tensor_version(now) != compared:
                    return where
            elif now is not value and not (type(now) is type(value) and type(now) in PLAIN_TYPES and now == value):
                return where
            elif isinstance(compared, _Items) and not same_container(value, compared.copied):
                return where
            elif mutable(value) and not isinstance(compared, _Items) and not value == compared:
                return where
            elif (state := generator_state(value)) is not None and not same_generator_state(state, compared):
                return f"the state of {where} ({type(value).__name__})"
            elif isinstance(compared, bytes) and writable_array(value) is not None and array_bytes(value) != compared:
                return where
        return None

    def restore(self) -> None:
        """Put every global back as it was when this object was made: the same object under each
        name, a tensor's values and a container's contents as they were, and those of the
        containers and tensors nested inside it (in place, so code holding them sees them)."""
        for (_, namespace, name), owner, (value, _, contents) in zip(self.entries, self.owners, self.saved):
            if value is MISSING:
                if owner is not None:
                    if name in namespace:
                        delattr(owner, name)
                else:
                    namespace.pop(name, None)
                continue
            if namespace.get(name, MISSING) is not value:
                if owner is not None:
                    setattr(owner, name, value)
                else:
                    namespace[name] = value
            if isinstance(value, torch.Tensor):
                if contents is not None and not torch.equal(value, contents):
                    with torch.no_grad():
                        value.copy_(contents)
            elif generator_state(value) is not None:
                if not same_generator_state(generator_state(value), contents):
                    set_generator_state(value, contents)
            elif isinstance(contents, bytes) and writable_array(value) is not None:
                put_back_array(value, contents)
            elif mutable(value) and not same_container(value, contents):
                put_back(value, contents)
        for value, contents in self.nested:
            if isinstance(value, torch.Tensor):
                if not torch.equal(value, contents):
                    with torch.no_grad():
                        value.copy_(contents)
            elif not same_container(value, contents):
                put_back(value, contents)
