"""Where the code walk starts from a model: every module class of its tree and every
function-valued instance attribute of its modules, then the objects, configs and containers of
other values its modules hold.

An instance attribute holding a function, method, ``functools.partial`` (with its plain
arguments) or built-in (``self.act = torch.relu``) is a binding as well as a start: assigning
another one re-extracts (else the graphs would keep calling the old one, without an error); the
object a bound built-in method is bound to (``self.get = table.get``) is read as data.
nnbridge's and nnsight's own functions set on modules are left out
(:func:`~.code_objects.is_plumbing`), so a model's code is the same bridged or not. One
:func:`walked` serves the disk-cache key (:mod:`.code_digest`), the code guard
(:mod:`.code_check`) and the watched globals (:mod:`.global_state`).

*State* is not kept here: each call walks the model as it is then.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from ..compat.torch.module_dicts import MODULE_SLOTS
from ..graph.module_tree import named_real_modules
from .bindings import Attributes
from .code_objects import BUILTINS, PLAIN_READ, data_container, holds_code, is_plumbing
from .code_walk import CodeWalk
from .held_objects import follow_held, held_object
from .plain_values import canonical_repr, config_like, plain_value

#: Instance attributes whose function other checks follow, so they are no binding (only part of
#: the digest): a module's call and its body (:func:`~nnbridge.compat.instance_forward`,
#: ``.locking``); accelerate's wrapped forward.
_CALL_SLOTS = frozenset({"forward", "_call_impl", "_old_forward"})


def _builtin_name(value: Any) -> str:
    return f"{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', None) or value!r}"


def _partial_arguments(value: functools.partial) -> str:
    """The arguments a ``functools.partial`` binds, as text: their ``repr`` when all are plain
    values, else their types (a partial binding objects counts by its function only)."""
    bound = (value.args, value.keywords)
    return canonical_repr(bound) if plain_value(bound) else repr([type(v).__qualname__ for v in
                                                                  (*value.args, *value.keywords.values())])


def walked(model: torch.nn.Module, skip: AbstractSet[int] = frozenset()) -> CodeWalk:
    """One walk from every module class of ``model``'s tree and every function-valued instance
    attribute (the bridge's and nnsight's own left out, see :func:`~.code_objects.is_plumbing`),
    then through the objects modules hold (:func:`~.held_objects.follow_held`). Modules whose
    ``id`` is in ``skip`` are left out with their subtrees."""
    walk = CodeWalk()
    skipped: list[str] = []
    for path, module in named_real_modules(model):
        if id(module) in skip or any(path.startswith(f"{p}.") or not p for p in skipped):
            skipped.append(path)
            continue
        walk.cls(type(module), in_tree=True)
        attributes = vars(module)
        for name, value in list(attributes.items()):
            if type(value) in PLAIN_READ:  # (module state)
                continue
            if held_object(name, value) or (name not in MODULE_SLOTS and (config_like(name, value) or (
                    data_container(value) and not plain_value(value, tensors=True)))):
                # (a container of other values, ``self.tables = {"a": np.ones(4)}``, a ``deque`` of
                # arrays: read as a global's is once code reads its name; plain ones are module
                # state; a config: the tensors, arrays and containers in it)
                walk.objects.append((f"{path or '<root>'}.{name}", attributes, name, value))
                continue
            if not holds_code(value, BUILTINS) or is_plumbing(value):
                continue
            where = f"{path or '<root>'}.{name}"
            if name in _CALL_SLOTS:  # in the digest; a change is found by other checks
                walk.todo.append((where, value, ()))
                continue
            binding = (where, attributes, name, value)
            if isinstance(value, BUILTINS):
                walk.entries.append((where, _builtin_name(value)))
                walk.bindings.append(binding)
                receiver = getattr(value, "__self__", None)
                if receiver is not None and not isinstance(receiver, (types.ModuleType, torch.nn.Module)):
                    # a bound built-in method (``self.get = table.get``): the object it is bound to, as data
                    found: list[Any] = []
                    walk.read_value((f"{where}.__self__", Attributes(value), "__self__", receiver), found)
                    walk.todo.extend(found)
                continue
            if isinstance(value, functools.partial):
                walk.entries.append((f"{where}.arguments", _partial_arguments(value)))
                if isinstance(value.func, BUILTINS):
                    walk.entries.append((f"{where}.func", _builtin_name(value.func)))
            walk.todo.append((where, value, (binding,)))
        walk.run()
    follow_held(walk)
    return walk
