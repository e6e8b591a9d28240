"""Extraction by name for a module tree that holds one module object at several container entries.

A ModuleList/ModuleDict/Sequential entry that is also registered elsewhere
(``nn.ModuleDict({"foo": self.linear})``, ``nn.ModuleList([block, block])``) is called through each
of its names: iterating or indexing the container goes through its registrations. torch.export
(2.13, non-strict) then knows every call by the name the code reached the module through (its
attribute proxies), when every registration's call signature is preserved and no forward of the
tree is overridden on the instance (an override bound to the module object runs its body outside
the proxy, and the calls inside lose their path: ``KeyError`` in torch's ``CollectTracepointsPass``).
Extraction then keeps every name (``ExtractionContext.by_name``): each name is its own graph and NodePath
(``module_dict_foo``, ``linear_0``), as graphpatch made them.

nnbridge threads the state of stateful arguments (a transformers ``Cache``) through such
overrides (see :func:`~nnbridge.graph.state.states_returned`), so a call of the tree passing one
keeps the refusal (:func:`stateful_callers`): the module owning the container runs opaque. Example::

    if shared_container_entries(model) and not stateful_callers(model, (x,), {}):
        ...  # export with every registration's signature, no alias hidden
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..graph.kinds import HookKind
from ..graph.module_tree import named_real_modules, named_registrations, shared_container_entries
from ..graph.state import state_keys
from .recording import observed_run


def stateful_callers(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """Paths of the modules (``""``: ``module``) that one eager run of ``module(*args, **kwargs)``
    (on copies of the inputs, leaving no trace, see :func:`~.recording.observed_run`) calls with a
    stateful argument (:func:`~nnbridge.graph.state.state_keys`), in call order, each once."""
    found: dict[str, None] = {}

    def hook(fqn: str) -> Callable[..., None]:
        def check(mod: torch.nn.Module, a: tuple[Any, ...], k: dict[str, Any]) -> None:
            if state_keys(a, k):
                found.setdefault(fqn, None)
        return check
    hooks = [(sub, HookKind.PRE, hook(fqn)) for fqn, sub in named_real_modules(module)]
    observed_run(module, args, kwargs, hooks=hooks, reset=found.clear)
    return list(found)


def same_object_paths(module: torch.nn.Module) -> dict[str, list[str]]:
    """``{path: every path of the same module object}`` over every registration of ``module``'s
    tree (see :func:`~nnbridge.graph.module_tree.named_registrations`), for the objects registered
    under more than one name."""
    paths: dict[int, list[str]] = {}
    for fqn, sub in named_registrations(module):
        paths.setdefault(id(sub), []).append(fqn)
    return {fqn: names for names in paths.values() if len(names) > 1 for fqn in names}


def spread_to_aliases(module: torch.nn.Module, marked: dict[str, Any]) -> dict[str, Any]:
    """``marked`` (``{path: value}``: stubs, their errors) with every other name of each marked module
    object marked with the same value: a stub or a traced-through module replaces or runs the object,
    whichever name a call goes through, so each of its names must be shown as it is (opaque)."""
    spread = dict(marked)
    for fqn, names in same_object_paths(module).items():
        for other in names:
            if other in marked and fqn not in spread:
                spread[fqn] = marked[other]
    return spread
