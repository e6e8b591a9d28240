"""Assembling graph modules into a hierarchy shaped like the original module.

Child graphs are attached under the names the user's module gives them (:func:`attach`), inside
containers of the original container classes (``ModuleList``, ``ModuleDict``;
:func:`retype_containers`), with parameters and buffers resolved on the original module
(:func:`resolve_attr`, :func:`persistent`). Example::

    attach(shown, "h.0", child_graph, renamed_template(module))
"""

from __future__ import annotations

import copy

from typing import Any, cast

import torch

from .context import ExtractionContext
from ..graph.graph_module import MultiplyInvokedModule
from ..graph.kinds import CONTAINERS
from ..graph.module_tree import safe_name
from ..compat.torch.module_dicts import clear_modules, modules_of, non_persistent_buffers_of


# -> Any: a get_attr target is a parameter, buffer, child module or an exported constant (a TreeSpec)
def resolve_attr(owner: torch.nn.Module, target: str) -> Any:
    value: Any = owner
    for part in target.split("."):
        value = getattr(value, part)
    return value


def persistent(owner: torch.nn.Module, target: str) -> bool:
    *prefix, name = target.split(".")
    holder = owner.get_submodule(".".join(prefix)) if prefix else owner
    return name not in non_persistent_buffers_of(holder)


def attach(parent: torch.nn.Module, target: str, child: torch.nn.Module, *, template: torch.nn.Module,
           stand_in: bool = False) -> None:
    """Set ``parent.<target> = child``, creating containers of the same types as in ``template``;
    ``stand_in``: containers the module's own code will iterate in place of ``template``'s, so
    each is a copy of the original with its state (see :func:`container_like`)."""
    *prefix, name = target.split(".")
    holder: torch.nn.Module = parent
    original: torch.nn.Module | None = template  # None below a prefix the template lacks
    for part in prefix:
        original = modules_of(original).get(part) if original is not None else None
        existing = modules_of(holder).get(part)
        if existing is None:
            existing = container_like(original, copied=stand_in) if isinstance(original, CONTAINERS) \
                else torch.nn.Module()
            holder.add_module(part, existing)
        holder = existing
    holder.add_module(name, child)


def container_like(original: torch.nn.Module, *, copied: bool = False) -> torch.nn.Module:
    """An empty container of ``original``'s type. A type that takes constructor arguments
    (``ParametrizationList`` of ``torch.nn.utils.parametrize``: extracting a spectral-normed module
    in train mode raised its ``TypeError``), or any with ``copied``, is copied instead, with no
    children, its parameters, buffers and attributes the same objects in registries of its own:
    its own code (a parametrization's ``forward``, a ModuleList subclass's ``__iter__`` reading an
    attribute) still works, and the original is left as it was."""
    if not copied:
        try:
            return type(original)()
        except TypeError:
            pass
    container = copy.copy(original)
    for name, value in vars(original).items():
        if isinstance(value, (dict, set)):  # registries and hook dicts: the copy's own
            container.__dict__[name] = copy.copy(value)
    clear_modules(container)
    return container


def original_path(ctx: ExtractionContext, module: torch.nn.Module, target: str) -> str:
    holder, parts = module, []
    for part in target.split("."):
        parts.append(ctx.renamed.get(id(holder), {}).get(part, part))
        holder = cast(torch.nn.Module, modules_of(holder)[part])  # a path of real children
    return ".".join(parts)


def retype_containers(cgm: torch.nn.Module, targets: list[str], template: torch.nn.Module,
                       *, multi: set[str]) -> None:
    """fx creates plain ``nn.Module``s on the way to dotted targets; give them the original container
    types (``ModuleList``/``ModuleDict``), or MultiplyInvokedModule for per-invocation lists."""
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts)):
            path = ".".join(parts[:i])
            original: torch.nn.Module | None = template
            for part in parts[:i]:
                original = modules_of(original).get(part) if original is not None else None
            kind = MultiplyInvokedModule if path in multi else (
                type(original) if isinstance(original, CONTAINERS) else None)
            current = cgm.get_submodule(path)
            if kind is None or type(current) is kind:
                continue
            retyped = kind() if kind is MultiplyInvokedModule else container_like(cast(torch.nn.Module, original))
            modules_of(retyped).update(modules_of(current))
            *prefix, name = path.split(".")
            modules_of(cgm.get_submodule(".".join(prefix)) if prefix else cgm)[name] = retyped


def renamed_template(module: torch.nn.Module) -> torch.nn.Module:
    """A view of ``module``'s children keyed by their safe names (for container types)."""
    view = torch.nn.Module()
    for name, child in module.named_children():
        modules_of(view)[safe_name(name)] = child
    return view
