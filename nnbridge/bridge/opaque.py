"""The opaque fallback: run a module's own code, and extract each child it calls.

An :class:`~.graph_module.OpaqueGraphModule` keeps the module's inputs, output, parameters and
buffers patchable; each child its code calls is extracted from its first call and called through
a dispatcher (:attr:`ExtractionContext.child_dispatcher`) that extracts it per call structure.
Example::

    graph = opaque_module(ctx, "transformer.h.0", block, args, kwargs, "skipped")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .assembly import attach, renamed_template
from .context import ChildDispatcher, ExtractionContext
from .graph_module import OpaqueGraphModule
from .kinds import HookKind
from .module_tree import direct_callees, safe_name
from .recording import copy_inputs, observed_run
from .unused import unused_module
from ..compat.module_dicts import modules_of


def opaque_module(ctx: ExtractionContext, fqn: str, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            reason: str) -> OpaqueGraphModule:
    """Opaque fallback: run the original code, extract each called child from its first call."""
    callees = list(direct_callees(module))
    captured: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def grabber(name: str) -> Callable[..., None]:
        return lambda m, a, k: captured.setdefault(name, (copy_inputs(a), copy_inputs(k))) and None
    observed_run(module, args, kwargs, [(child, HookKind.PRE, grabber(name)) for name, child in callees])
    shown = torch.nn.Module()
    swapped = torch.nn.Module()
    dispatchers: dict[str, ChildDispatcher] = {}
    template = renamed_template(module)
    for name, child in callees:
        child_path = ctx.full(f"{fqn}.{name}" if fqn else name)
        first, *rest = name.split(".")
        safe = ".".join([safe_name(first), *rest])
        original_name = ".".join([ctx.renamed.get(id(module), {}).get(first, first), *rest])
        if name not in captured:
            attach(shown, safe, unused_module(ctx, f"{fqn}.{name}" if fqn else name, child), template)
            attach(swapped, original_name, child, module)
            continue
        a, k = captured[name]
        dispatcher = ctx.child_dispatcher(child, child_path)
        # a GraphDispatcher (see ChildDispatcher): the original code calls it in the child's place
        assert isinstance(dispatcher, torch.nn.Module), type(dispatcher)
        first_extraction = dispatcher.add_extraction(a, k)
        ctx.opaque.update(first_extraction.opaque)
        attach(shown, safe, first_extraction.root, template)
        attach(swapped, original_name, dispatcher, module)
        dispatchers[safe.replace(".", "_")] = dispatcher
    opaque = OpaqueGraphModule(module, reason, dict(modules_of(shown)), dict(modules_of(swapped)))
    opaque.graph_meta.child_dispatchers = dispatchers
    return opaque
