"""The insertion verbs: ``insert_after``, ``insert_before``, ``replace_node``; ``edits`` and ``clear``.

Each verb validates the site and the module, checks the module on fake values, registers the
module as a child of the module whose graph holds the site (so it is in ``model.parameters()``,
``.to()``, ``.train()``, ``state_dict()`` and ``named_modules()``) and keeps the edit's recipe
there (:mod:`.recipes`): every extraction from then on has the edit, and a bridged model's
current graphs give way to new ones on its next call (a guard fails, as the tree changed).
Example::

    edit = surgery.insert_after(model, "model.layers_1.mlp.output", sae)
    model(ids)                      # the MLP's output goes through the SAE
    edit.remove()                   # as before
"""

from __future__ import annotations

import re
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from ..compat.torch.module_dicts import modules_of
from ..errors import PassCheckError, SurgeryError
from ..graph.module_tree import RESERVED_NAMES
from ..graph.metadata import node_name
from ..graph.recipes import Callers, add_recipe, all_recipes, remove_recipe
from .pass_targets import target_graphs
from .recipes import InsertedModule, Kind, ModuleInsertion
from .sites import resolve_site
from .targets import Target, target_of

if TYPE_CHECKING:
    from .passes import AppliedPasses
    from .pattern_modules import ModuleRewrite

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Edit:
    """One inserted module, live until :meth:`remove` (or the end of its ``with`` block).

    Attributes:
        node_path: the NodePath of the new node, which the site's users now read
            (``model.layers_1.mlp.sae``); its ops are below it (``model.layers_1.mlp.sae.relu``).
        module: the inserted module.
        site: the NodePath asked for.
    """

    def __init__(self, recipe: ModuleInsertion, target: Target, before: set[int]):
        self.recipe, self._target, self._before = recipe, target, before
        self.node_path = recipe.node_path
        self.module = recipe.module
        self.site = recipe.site_text
        self.removed = False

    def __repr__(self) -> str:
        state = "removed" if self.removed else "active"
        return f"Edit({self.recipe!r}, {state})"

    def remove(self) -> None:
        """Undo the edit: the module leaves its owner, extractions made with the edit are dropped
        (the next call is served by an unedited one, or extracts again). Removing twice does nothing."""
        if self.removed:
            return
        self.removed = True
        remove_recipe(self.recipe)
        if self._target.bridge is not None:
            self._target.bridge.release(self.module)
        self.recipe.withdraw()
        for dispatcher in self._target.dispatchers():
            dispatcher.discard(lambda extraction: id(extraction) in self._before)
        self._target.refresh()

    def __enter__(self) -> Edit:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.remove()


def default_name(module: torch.nn.Module) -> str:
    """``SparseAutoencoder`` -> ``sparse_autoencoder``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", type(module).__name__).lower()


def _callers(resolved: Target) -> Callers | None:
    """Where the target's graphs get their inputs (for a site that is a graph input), or None
    when its graphs cannot be listed."""
    try:
        found = target_graphs(resolved.pg if resolved.pg is not None else resolved.model)
    except PassCheckError:
        return None
    return Callers(found.parents, {id(e.root): dict(e.inputs) for e in resolved.extractions()})


def _insert(kind: Kind, target: Any, site: Any, *, module: Any, name: str | None, arg: int = 0) -> Edit:
    verb = {"after": "insert_after", "before": "insert_before", "replace": "replace_node"}[kind]
    if not isinstance(module, torch.nn.Module):
        raise SurgeryError(f"{verb}: the module must be a torch.nn.Module (it becomes a child of the edited module);"
                           f" got {type(module).__name__}. Wrap a function in an nn.Module.")
    resolved = target_of(target, verb)
    found = resolve_site(resolved, site, what=verb)
    chosen = default_name(module) if name is None else name
    taken = {node_name(n) for n in found.graph.graph.nodes}
    if not isinstance(chosen, str) or not _IDENTIFIER.fullmatch(chosen) or chosen in RESERVED_NAMES:
        raise SurgeryError(f"{verb}: name={chosen!r} cannot name a child module and a node; pass a Python identifier"
                           " that is no reserved graph attribute (e.g. name='sae').")
    if chosen in taken or hasattr(found.owner, chosen):
        raise SurgeryError(f"{verb}: '{found.prefix or '<root>'}' already has a node or attribute {chosen!r}; pass"
                           f" another name= (e.g. name='{chosen}_2').")
    if any(m is module for m in resolved.model.modules()):
        raise SurgeryError(f"{verb}: this {type(module).__name__} is already part of the model (inserted elsewhere, or"
                           " one of its modules); insert a new instance, or remove the other edit first.")
    if type(found.owner).forward is torch.nn.Sequential.forward:
        raise SurgeryError(
            f"{verb}: site {site!r} is in the graph of '{found.prefix or '<root>'}', a {type(found.owner).__name__},"
            " whose forward runs every child it holds: an inserted child would run there too. Edit one of its"
            " entries' graphs (an op inside '<entry>.'), or the Sequential's caller.")
    recipe = ModuleInsertion(kind, found, module, name=chosen, arg=arg, model=resolved.model)
    recipe.check(found.graph, callers=_callers(resolved))
    before = {id(e) for e in resolved.extractions()}
    modules_of(found.owner)[chosen] = module
    if resolved.bridge is not None:
        resolved.bridge.adopt(found.owner, chosen)  # an envoy for it, as for op points
    add_recipe(recipe)
    edit = Edit(recipe, resolved, before)
    recipe.edit = edit
    try:
        resolved.refresh()
    except BaseException:
        edit.remove()
        raise
    return edit


def insert_after(target: Any, site: str, module: torch.nn.Module, *, name: str | None = None) -> Edit:
    """Insert ``module`` after the node at ``site``: ``module(value)`` replaces the site's value
    for all of the site's users (the site's own NodePath still names the unchanged value).

    Args:
        target: a bridged model, a :class:`~nnbridge.PatchableGraph` or an nnbridge NNsight model.
        site: the node's NodePath (``model.layers_1.mlp.output``), nnsight spelling or alias; a
            module's NodePath inserts after its call.
        module: takes the value (a tensor) and returns a tensor of the same shape, dtype and device.
        name: the new node's name and the module's attribute on the site's module; default the
            module's class name in snake case (``SAE`` -> ``sae``).

    Returns:
        The :class:`Edit` (``edit.node_path``: ``model.layers_1.mlp.sae``).

    Raises:
        SurgeryError: the target is not bridged, the site is unknown (with the closest NodePaths),
            in an opaque module or no tensor, the name is taken, or the module fails or changes the
            value's shape, dtype or device on fake values. Nothing is edited then.
    """
    return _insert("after", target, site, module=module, name=name)


def insert_before(target: Any, site: str, module: torch.nn.Module, *, arg: int = 0,
                  name: str | None = None) -> Edit:
    """Insert ``module`` before the op or module call at ``site``: it transforms positional input
    ``arg`` of that node only (other users of the input still read it unchanged).

    Raises:
        SurgeryError: as :func:`insert_after`; also when input ``arg`` does not exist or is no tensor.
    """
    return _insert("before", target, site, module=module, name=name, arg=arg)


def replace_node(target: Any, site: str, module: torch.nn.Module, *, name: str | None = None) -> Edit:
    """Replace the module call at ``site`` (a module's NodePath, ``model.layers_1.mlp``) by
    ``module`` called with the same positional tensor arguments, as a transcoder replaces an MLP.
    The replaced module stays on the model, unused while the edit lives.

    Raises:
        SurgeryError: as :func:`insert_after`; also when ``site`` is an op, or the call passes
            keyword arguments, state or constants.
    """
    return _insert("replace", target, site, module=module, name=name)


def edits(target: Any) -> list[Edit | AppliedPasses | ModuleRewrite]:
    """The live edits of ``target``'s model, in module order: inserted modules (:class:`Edit`),
    passes and pattern rewrites (:class:`~nnbridge.surgery.passes.AppliedPasses`,
    :class:`~nnbridge.surgery.pattern_modules.ModuleRewrite`), each once.

    Raises:
        SurgeryError: ``target`` is not a bridged model, PatchableGraph or nnbridge NNsight model.
    """
    model = target_of(target, "edits").model
    found: list[Edit | AppliedPasses | ModuleRewrite] = []
    for recipe in all_recipes(model):
        handle = recipe.edit if isinstance(recipe, InsertedModule) else getattr(recipe, "applied", None)
        if handle is not None and not any(handle is seen for seen in found):
            found.append(handle)
    return found


def clear(target: Any) -> None:
    """Remove every edit of ``target``'s model, newest first.

    Raises:
        SurgeryError: as :func:`edits`.
    """
    for edit in reversed(edits(target)):
        edit.remove()
