"""Submodules the example call never ran: kept as opaque modules, in registration order.

As graphpatch's ``allow_unused_submodules`` (default True unless strict): an uncalled child stays
in the hierarchy as an :class:`~.graph_module.OpaqueGraphModule` (reason :data:`UNUSED_REASON`),
so ``named_parameters()`` and ``state_dict()`` list what the original lists, in its order; with
the option off, :class:`NeverCalledError` names it. Example::

    keep_unused(ctx, "transformer", graph, model.transformer)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .context import ExtractionContext
from ..graph.graph_module import OpaqueGraphModule
from ..graph.kinds import CONTAINERS
from ..graph.module_tree import reorder
from ..graph.node_path import ModulePath
from ..graph.op_point import OpPoint, OpPointContainer
from ..graph.recipes import inserted_children
from ..compat.torch.module_dicts import buffers_of, modules_of, parameters_of
from ..errors import ExtractionError, warn


#: Reason recorded for a submodule the extracted call never ran.
UNUSED_REASON = "not invoked during extraction"
UNUSED_FIX = ("Call it in the example inputs, or set allow_unused_submodules=True (the default unless"
               " error_on_compilation_failure is set) to keep it as an opaque module.")


class NeverCalledError(ExtractionError):
    """A submodule was never called by the example inputs (graphpatch's ``NoRecordedInvocations``)."""


def user_children(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``module``'s children in registration order, without op points (names as in ``_modules``)."""
    for name, child in modules_of(module).items():
        if child is not None and not isinstance(child, (OpPoint, OpPointContainer)):
            yield name, child


def unused_module(ctx: ExtractionContext, fqn: ModulePath, module: torch.nn.Module, *,
                  top: bool = True) -> torch.nn.Module:
    """A submodule the extracted call never ran, as graphpatch keeps it: an :class:`OpaqueGraphModule`
    (its own code, parameters and buffers) with its children likewise; containers keep their type.
    With ``allow_unused_submodules`` off it is a compilation failure (see :class:`ExtractionOptions`).

    Raises:
        ExtractionError: ``allow_unused_submodules`` is off and ``error_on_compilation_failure`` on.
    """
    if isinstance(module, CONTAINERS):
        container = type(module)()
        for name, child in user_children(module):
            modules_of(container)[name] = unused_module(ctx, ModulePath(f"{fqn}.{name}"), child, top=top)
        return container
    if not top:  # inside an unused module: reported with it
        pass
    elif not ctx.options.allow_unused_submodules:
        ctx.fail(fqn, "it was never called by the example inputs", NeverCalledError(
            f"'{ctx.full(fqn)}' was never called when running the example inputs"), fix=UNUSED_FIX)
    elif ctx.options.warn_on_compilation_failure:  # as graphpatch: told, though allowed
        # graphpatch's sentence first (its users' scripts match on it)
        warn(f"Unable to compile {ctx.full(fqn)}; it was never called by the example inputs, so it is kept as an"
             " opaque module")
    children = {name: unused_module(ctx, ModulePath(f"{fqn}.{name}"), child, top=False)
                for name, child in user_children(module)}
    return OpaqueGraphModule(module, UNUSED_REASON, children, callees={})


def keep_unused(ctx: ExtractionContext, fqn: ModulePath, cgm: torch.nn.Module, *, module: torch.nn.Module) -> None:
    """Give ``cgm`` every child of ``module`` the graph never calls (see :func:`unused_module`), also
    inside ModuleList/ModuleDict containers, so its parameters and buffers are the module's; not a
    child a recipe inserted (:func:`~nnbridge.graph.recipes.inserted_children`), which the recipe calls."""
    # a child registered under several names (``self.alias = self.linear``) was called if any name was
    called = {id(child) for name, child in user_children(module) if name in modules_of(cgm)}

    def fill(holder: torch.nn.Module, original: torch.nn.Module, prefix: str) -> None:
        inserted = inserted_children(original)  # called by a recipe applied after building (see .recipes)
        for name, child in user_children(original):
            if name in inserted:
                continue
            path = ModulePath(f"{prefix}.{name}" if prefix else name)
            existing = modules_of(holder).get(name)
            if existing is None and id(child) not in called:
                modules_of(holder)[name] = unused_module(ctx, path, child)
            elif isinstance(child, CONTAINERS) and type(existing) is type(child):
                fill(existing, child, path)
    fill(cgm, module, fqn)


def registration_order(cgm: torch.nn.Module, module: torch.nn.Module) -> None:
    """Order ``cgm``'s children, parameters and buffers (and those of its ModuleList/ModuleDict
    children) as ``module`` registered them, not as the graph calls them: ``named_parameters()``
    and ``state_dict()`` then list them in the module's order (graphpatch restores it too)."""
    reorder(parameters_of(cgm), list(parameters_of(module)))
    reorder(buffers_of(cgm), list(buffers_of(module)))
    reorder(modules_of(cgm), list(modules_of(module)))
    for name, child in modules_of(cgm).items():
        original = modules_of(module).get(name)
        if isinstance(child, CONTAINERS) and original is not None and type(child) is type(original):
            registration_order(child, original)
