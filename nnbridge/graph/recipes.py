"""Recipes: edits of a module's graphs, kept on the module and applied to each of its extractions.

A *recipe* changes the graphs of one module (its *owner*): it inserts a node, or rewrites some.
It is kept on the owner (:func:`add_recipe`), not on a graph, because a module's graphs are made
again whenever a guard fails (another call structure, ``.train()``, another sequence length):
each new extraction gets the owner's recipes applied to every graph of the owner
(:func:`apply_recipes`, called by the dispatcher before the extraction's code is generated or its
graphs linked to a bridged model). A recipe that inserts a module names it (:attr:`Recipe.child`):
extraction then leaves that child out of the unused submodules (the recipe calls it itself).

Example::

    add_recipe(model.model.layers[1].mlp, recipe)      # applied to every later extraction
    apply_recipes(model, extraction.root, options=options, reason="first call")
    remove_recipe(recipe)                              # later extractions are unedited
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.fx import Node

from .graph_module import CompiledGraphModule, GraphModuleBase
from .metadata import node_meta

#: key in an owner module's ``__dict__`` of its recipes, in the order they were added
RECIPES_KEY = "_nnbridge_recipes"


@dataclass
class Callers:
    """Where the graphs of one extraction get their inputs, for a recipe that needs the value of a
    graph's input (a placeholder, whose example value the graph does not record).

    Attributes:
        parents: ``{id(child graph): (the graph calling it, its call_module node)}``.
        inputs: ``{id(root graph): {placeholder name: value}}``: an extraction root's inputs on
            the call it was extracted for (the module's forward arguments by name).
    """

    parents: dict[int, tuple[CompiledGraphModule, Node]] = field(default_factory=dict)
    inputs: dict[int, dict[str, Any]] = field(default_factory=dict)


def bound_inputs(module: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``{forward argument name: value}`` of a call of ``module`` (the root graph's placeholders
    carry these names), bound to its class's ``forward`` (not to a wrapper set on the instance);
    empty when the arguments do not bind to the signature."""
    try:
        bound = inspect.signature(type(module).forward).bind_partial(module, *args, **kwargs).arguments
    except (TypeError, ValueError):
        return {}
    return {name: value for index, (name, value) in enumerate(bound.items()) if index > 0}


class Recipe(Protocol):
    """One edit of an owner module's graphs (see the module docstring).

    Attributes:
        node_path: the NodePath the edit was asked for (for messages).
        owner: the module whose graphs it edits.
        child: the name of the child module it registered on ``owner`` and calls from the graphs,
            or None (an edit that inserts no module).
    """

    node_path: str
    owner: torch.nn.Module
    child: str | None

    def apply(self, graph: CompiledGraphModule, *, options: Any, reason: str, callers: Callers | None = None
              ) -> None:
        """Edit ``graph`` (one graph of :attr:`owner`, not yet code-generated) in place.
        ``options``: the extraction's options; ``reason``: why it was extracted (``"first call"``,
        the guard that failed); ``callers``: where the extraction's graphs get their inputs.
        Applying a recipe twice to one graph must change nothing.

        Raises:
            SurgeryError: the edit does not apply to this extraction (naming its NodePath,
                the reason and the fix).
        """
        ...

    def withdraw(self) -> None:
        """Undo what the recipe did to the model itself (the child it registered)."""
        ...


def recipes_of(module: torch.nn.Module) -> list[Recipe]:
    """``module``'s recipes, oldest first (a copy)."""
    return list(module.__dict__.get(RECIPES_KEY, ()))


def add_recipe(recipe: Recipe) -> None:
    """Keep ``recipe`` on its owner: every later extraction of the owner applies it."""
    recipe.owner.__dict__.setdefault(RECIPES_KEY, []).append(recipe)


def remove_recipe(recipe: Recipe) -> None:
    """Forget ``recipe`` (no error when it is not kept)."""
    kept = recipe.owner.__dict__.get(RECIPES_KEY)
    if kept is None:
        return
    kept[:] = [r for r in kept if r is not recipe]
    if not kept:
        del recipe.owner.__dict__[RECIPES_KEY]


def inserted_children(module: torch.nn.Module) -> frozenset[str]:
    """The names of ``module``'s children its recipes call (not unused submodules)."""
    return frozenset(r.child for r in module.__dict__.get(RECIPES_KEY, ()) if r.child is not None)


def all_recipes(model: torch.nn.Module) -> list[Recipe]:
    """Every recipe kept on ``model`` or any of its submodules, in module order."""
    return [r for module in model.modules() for r in recipes_of(module)]


def withdraw_all(model: torch.nn.Module) -> None:
    """Forget every recipe of ``model``'s tree and undo what each did to the model."""
    for recipe in reversed(all_recipes(model)):
        remove_recipe(recipe)
        recipe.withdraw()


def apply_recipes(module: torch.nn.Module, root: GraphModuleBase, *, options: Any, reason: str,
                  inputs: Mapping[str, Any] | None = None) -> bool:
    """Apply the recipes of ``module``'s tree to the graphs of one new extraction of ``module``
    (``root``: its root graph), each graph once: the recipes of a module to every compiled graph
    of it (one per invocation). The children of opaque graphs are extracted by their own
    dispatchers, which apply theirs. Does nothing (one walk of the module tree) when no module
    has recipes. ``inputs``: the root graph's inputs by name (see :class:`Callers`). Returns
    whether any module of the tree has recipes.

    Raises:
        SurgeryError: a recipe does not apply (see :meth:`Recipe.apply`).
    """
    if not any(RECIPES_KEY in m.__dict__ for m in module.modules()):
        return False
    seen: set[int] = set()
    callers = Callers(inputs={id(root): dict(inputs or {})})

    def visit(graph: GraphModuleBase, owner: torch.nn.Module) -> None:
        if id(graph) in seen or not isinstance(graph, CompiledGraphModule):
            return
        seen.add(id(graph))
        calls = [(graph.child_graph(n), node_meta(n).module_path) for n in graph.graph.nodes if n.op == "call_module"]
        for node in graph.graph.nodes:
            if node.op == "call_module":
                callers.parents.setdefault(id(graph.child_graph(node)), (graph, node))
        for recipe in recipes_of(owner):
            recipe.apply(graph, options=options, reason=reason, callers=callers)
        for child, path in calls:
            if path is not None:
                visit(child, owner.get_submodule(path))
    visit(root, module)
    return True
