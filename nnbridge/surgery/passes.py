"""Graph passes over the extracted hierarchy: ``apply_passes(target, passes, scope=...)``.

torch's ATen-IR passes (plain functions editing ``graph_module.graph``, ``fx.Transformer``
subclasses, ``PassBase`` instances, ``PassManager``; see :mod:`.pass_kinds`) run on every compiled
graph of a :class:`~nnbridge.PatchableGraph` or a bridged model whose NodePath is in ``scope``.
Each pass runs on a copy of the graph (:mod:`.pass_graphs`); after each pass nnbridge names the
new nodes by its own rules (:mod:`.pass_naming`: ``relu``, ``relu_1``, never ``relu_default``;
a retargeted node keeps its name and metadata, through ``fx.Transformer`` too) and runs the checks
(:mod:`.pass_checks`: lint, signature, shapes by fake propagation). Only when every pass and check
succeeded on every graph in scope do the edited graphs replace the live ones, regenerating their
code: new nodes get op points (patchable with ``pg.patch`` by NodePath, hookable on a bridged
model), nodes a pass removed lose theirs. A failure raises :class:`~nnbridge.errors.PassCheckError`
naming the pass, the graph and the check, and changes nothing.

Example::

    def replace_add_with_mul(gm):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target == torch.ops.aten.add.Tensor:
                node.target = torch.ops.aten.mul.Tensor

    apply_passes(pg, [replace_add_with_mul], scope="model.layers_*")

:class:`PassEdit` is the same work as one reusable edit: ``edit.apply(graph_module)`` runs it on
one graph (a fresh extraction's, for instance) when the graph is in scope.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule

from ..errors import PassCheckError, PatternError
from ..graph.graph_module import CompiledGraphModule
from ..graph.locking import CALL_LOCK
from ..graph.metadata import node_meta, node_name
from ..graph.op_point import OpPoint
from ..graph.recipes import Callers, add_recipe, remove_recipe
from ..inplace.bridging import Bridge
from .pass_checks import DEFAULT_CHECKS, resolve_checks
from .pass_graphs import WorkingCopy, install, module_call_problem, working_copy
from .pass_inputs import Parents, recorded_inputs
from .pass_kinds import Pass, PassRunner, pass_runner
from .pass_recipes import PassRecipe
from .pass_naming import carry_metadata, name_nodes_after_pass
from .pass_targets import Graphs, graph_path, scope_pattern, target_graphs
from .targets import Target, target_of

Check = str | Callable[[GraphModule], Any]


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"


@dataclass
class PreparedPasses:
    """The passes' result on one graph, not yet in place (see :meth:`PassEdit.prepare`).

    Attributes:
        work: the live graph and its working copy.
        result: the module holding the edited graph.
        where: the graph's NodePath.
    """

    work: WorkingCopy
    result: GraphModule
    where: str
    changed: bool = True

    def removed_listened(self) -> list[str]:
        """Nodes the passes removed whose op point has a patch, torch hook or listener."""
        names = {node_name(node) for node in self.result.graph.nodes}
        return [name for name, point in self.work.live.named_op_points_made().items()
                if name not in names and point.listened]

    def install(self) -> Callable[[], None]:
        """Put the edited graph in place (its code regenerated); returns the undo."""
        return install(self.work, self.result, where=self.where)


class PassEdit:
    """Passes over the graphs in a scope, as one edit that can be applied to any graph again.

    Interface (what a store of edits re-applies to every new extraction):

    - ``matches(node_path) -> bool``: whether a graph's NodePath is in :attr:`scope`;
    - ``apply(graph_module) -> None``: run the passes and checks on one
      :class:`~nnbridge.graph.graph_module.CompiledGraphModule` in scope and put the result in
      place (nothing for a graph out of scope); on failure raises :class:`PassCheckError` with the
      graph unchanged.

    Args:
        passes: a pass or a sequence of passes (:mod:`.pass_kinds`), run in order.
        scope: a glob over graph NodePaths (:mod:`.pass_targets`), ``"**"`` for every graph.
        checks: built-in check names (``"lint"``, ``"signature"``, ``"shapes"``) and functions
            ``check(graph_module)`` that raise to fail, run after each pass.

    Raises:
        PassCheckError: (check ``argument``) no pass, something that is not a pass, a bad scope,
            an unknown check.
    """

    def __init__(self, passes: Pass | Sequence[Pass], *, scope: str = "**", checks: Sequence[Check] = DEFAULT_CHECKS):
        items = list(passes) if isinstance(passes, (list, tuple)) else [passes]
        if not items:
            raise PassCheckError("apply_passes: no passes given; pass a pass or a list of passes.", check="argument")
        self.runners: list[PassRunner] = [pass_runner(item) for item in items]
        self.scope = scope
        self._pattern = scope_pattern(scope)
        self.checks: tuple[Check, ...] = (checks,) if isinstance(checks, str) else tuple(checks)
        resolve_checks(self.checks)  # refused now, before any graph is touched

    def __repr__(self) -> str:
        return f"PassEdit([{', '.join(r.name for r in self.runners)}], scope={self.scope!r})"

    def bind_owner(self, owner: torch.nn.Module) -> None:
        """Called before :meth:`prepare` with the module the graph is a graph of (passes need none;
        a pattern rewrite reads the matched modules off it)."""

    def matches(self, node_path: str) -> bool:
        """Whether the graph at ``node_path`` is in scope."""
        return self._pattern.fullmatch(node_path) is not None

    def apply(self, graph_module: CompiledGraphModule, callers: Callers | None = None) -> None:
        """Run the passes on ``graph_module`` when its NodePath is in scope (see the class docstring;
        ``callers``: where its extraction's graphs get their inputs, for the checks' values).

        Raises:
            PassCheckError: a pass raised or a check failed; ``graph_module`` is unchanged.
        """
        where = graph_path(graph_module)
        if not self.matches(where):
            return
        with CALL_LOCK:
            prepared = self.prepare(graph_module, where, parents=callers.parents if callers else None,
                                    root=callers.inputs if callers else None)
            if not prepared.changed:
                return
            _refuse_removed_listened([prepared])
            prepared.install()

    def prepare(self, graph_module: CompiledGraphModule, where: str, *, parents: Parents | None = None,
                root: dict[int, dict[str, Any]] | None = None,
                recorded: dict[str, Any] | None = None) -> PreparedPasses:
        """Run every pass and check on a copy of ``graph_module`` (at NodePath ``where``);
        ``parents``: the callers of the graphs of its hierarchy and ``root``: its extraction roots'
        inputs (:mod:`.pass_inputs`), where the shape check finds what the graph's inputs were on
        the example call (``recorded``: those inputs when the caller already looked them up).

        Raises:
            PassCheckError: a pass raised or a check failed (``graph_module`` is untouched).
        """
        shown = where or "<root>"
        work = working_copy(graph_module)
        if recorded is None:
            recorded = recorded_inputs(graph_module, parents or {}, root)
        checks = resolve_checks(self.checks, recorded=recorded)
        references = [check.reference(work.module) for check in checks]
        module = work.module
        for runner in self.runners:
            before = set(module.graph.nodes)
            try:
                outcome = runner.run(module)
            except (PassCheckError, PatternError):
                raise
            except Exception as error:
                raise PassCheckError(
                    f"apply_passes: the pass {runner.name} raised on the graph {shown}: {_first_line(error)}. Nothing"
                    " was changed.", pass_name=runner.name, graph=where, check="run") from error
            module = outcome.graph_module
            carry_metadata(outcome.origins)
            kept = {node: node.name for node in module.graph.nodes if node in before}
            kept.update((new, old.name) for new, old in outcome.origins.items())
            name_nodes_after_pass(module.graph, kept)
            failed = self._failure(work, module, checks=checks, references=references)
            if failed is not None:
                check, reason = failed
                raise PassCheckError(
                    f"apply_passes: after the pass {runner.name}, the check {check!r} failed on the graph {shown}:"
                    f" {reason}. Nothing was changed: every graph is as before this apply_passes call.",
                    pass_name=runner.name, graph=where, check=check)
        return PreparedPasses(work, module, where)

    @staticmethod
    def _failure(work: WorkingCopy, module: GraphModule, *, checks: list[Any], references: list[Any]
                 ) -> tuple[str, str] | None:
        for check, reference in zip(checks, references):
            if check.name == "lint":
                reason = check.failure(reference, module)
                if reason is not None:
                    return check.name, reason
        try:
            module.recompile()
        except Exception as error:  # noqa: BLE001 - fx's code generation refuses a malformed graph
            return "lint", f"code generation failed: {_first_line(error)}"
        problem = module_call_problem(work, module)
        if problem is not None:
            return "call_module", problem
        for check, reference in zip(checks, references):
            if check.name != "lint":
                reason = check.failure(reference, module)
                if reason is not None:
                    return check.name, reason
        return None


def _refuse_removed_listened(prepared: list[PreparedPasses]) -> None:
    for item in prepared:
        listened = item.removed_listened()
        if listened:
            raise PassCheckError(
                f"apply_passes: the passes remove the nodes {listened} of the graph {item.where or '<root>'}, on which"
                " a patch, torch hook or trace listens; remove those first. Nothing was changed.",
                graph=item.where, check="listened")


@dataclass
class AppliedPasses:
    """What :func:`apply_passes` did: an edit, kept as recipes (:mod:`.pass_recipes`) that every
    later extraction of the edited modules applies, until :meth:`remove`. A context manager: the
    block's end removes it.

    Attributes:
        edit: the :class:`PassEdit` (re-applicable to a fresh extraction's graphs).
        graphs: the NodePaths of the graphs edited, in hierarchy order (a NodePath appears once
            per extraction holding it).
        recipes: one per edited module.
        target: what the passes were applied to (its :class:`~nnbridge.surgery.targets.Target`).
    """

    edit: PassEdit
    graphs: list[str] = field(default_factory=list)
    recipes: list[PassRecipe] = field(default_factory=list)
    target: Target | None = None
    removed: bool = False

    @property
    def node_path(self) -> str:
        """The scope the passes were applied to (a glob over graph NodePaths)."""
        return self.edit.scope

    def remove(self) -> None:
        """Undo the passes: the recipes are forgotten and every extraction holding the edited
        graphs is dropped (the next call extracts again, unedited; a PatchableGraph re-extracts its
        example call now). Removing twice does nothing."""
        if self.removed:
            return
        self.removed = True
        for recipe in self.recipes:
            remove_recipe(recipe)
        if self.target is not None:
            for dispatcher in self.target.dispatchers():
                dispatcher.discard(lambda extraction: False)
            self.target.refresh()

    def __enter__(self) -> AppliedPasses:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.remove()


def apply_passes(target: object, passes: Pass | Sequence[Pass], *, scope: str = "**",
                 checks: Sequence[Check] = DEFAULT_CHECKS) -> AppliedPasses:
    """Run ``passes`` on every compiled graph of ``target`` whose NodePath is in ``scope``, in every
    extraction (call structure) it holds; see the module docstring.

    Args:
        target: a :class:`~nnbridge.PatchableGraph` or a bridged model (``nnbridge.bridge``).
        passes: a pass or a sequence of passes (functions ``fn(graph_module)``, ``fx.Transformer``
            subclasses, ``PassBase`` instances, ``PassManager``), run in order on each graph.
        scope: a glob over graph NodePaths: ``*`` within a segment, ``**`` across segments
            (``"model.layers_*"``: each decoder layer's own graph).
        checks: run after each pass: ``"lint"``, ``"signature"`` (placeholders and output
            structure), ``"shapes"`` (fake propagation: the output and every child call's
            arguments keep their sizes, dtypes and devices), and functions ``check(graph_module)``
            that raise to fail.

    Returns:
        :class:`AppliedPasses`: the :class:`PassEdit` and the NodePaths edited.

    Raises:
        PassCheckError: a bad argument, a scope that matches no compiled graph, a pass that raised,
            a failed check, a removed node something listens to (``.pass_name``, ``.graph``,
            ``.check`` say which); every graph is then as before the call.
    """
    edit = PassEdit(passes, scope=scope, checks=checks)
    applied = AppliedPasses(edit)
    return apply_edit(target, edit, applied, make_recipe=lambda owner: PassRecipe(edit, owner))


def apply_edit(target: object, edit: PassEdit, applied: AppliedPasses, *,
               make_recipe: Callable[[torch.nn.Module], PassRecipe], verb: str = "apply_passes") -> AppliedPasses:
    """Apply ``edit`` to every compiled graph of ``target`` in its scope (see :func:`apply_passes`)
    and keep it as recipes (``make_recipe(owner)``, one per module whose graphs are in scope) on
    ``applied``, which is returned. Graphs the edit leaves unchanged (``PreparedPasses.changed``
    false) are not put in place again.

    Raises:
        PassCheckError: as :func:`apply_passes`; every graph is then as before the call.
    """
    with CALL_LOCK:
        found = target_graphs(target)
        chosen = [(path, graph) for path, graph in found.graphs if edit.matches(path)]
        if not chosen:
            paths = sorted({path or "<root>" for path, _ in found.graphs})
            raise PassCheckError(
                f"{verb}: the scope {edit.scope!r} matches no compiled graph; graphs: {paths[:12]}"
                f"{' ...' if len(paths) > 12 else ''} ('*' matches within one segment, '**' across segments).",
                check="scope")
        kept = target_of(target, verb)
        modules = graph_owners(kept)
        prepared = []
        for path, graph in chosen:
            edit.bind_owner(modules[id(graph)])
            prepared.append(edit.prepare(graph, path, parents=found.parents, root=found.inputs))
        prepared = [item for item in prepared if item.changed]
        _refuse_removed_listened(prepared)
        links = _links(found, prepared)
        undo: list[Callable[[], None]] = []
        try:
            for item in prepared:
                undo.append(item.install())
        except BaseException:
            for step in reversed(undo):
                step()
            raise
        if found.bridge is not None:
            _update_bridge(found.bridge, links)
        owners: dict[int, torch.nn.Module] = {}
        for _, graph in chosen:
            module = modules[id(graph)]
            owners.setdefault(id(module), module)
        applied.graphs = [item.where for item in prepared]
        applied.recipes = [make_recipe(o) for o in owners.values()]
        applied.target = kept
        for recipe in applied.recipes:
            recipe.applied = applied
            add_recipe(recipe)
    return applied


def graph_owners(target: Target) -> dict[int, torch.nn.Module]:
    """``{id(graph): the module it is a graph of}`` for every compiled graph of ``target``'s
    extractions (the module whose recipes a later extraction of that graph gets)."""
    owners: dict[int, torch.nn.Module] = {}

    def visit(graph: Any, owner: torch.nn.Module) -> None:
        if id(graph) in owners or not isinstance(graph, CompiledGraphModule):
            return
        owners[id(graph)] = owner
        for node in graph.graph.nodes:
            path = node_meta(node).module_path if node.op == "call_module" else None
            if path is not None:
                visit(graph.child_graph(node), owner.get_submodule(path))
    for dispatcher in target.dispatchers():
        for extraction in dispatcher.all_extractions():
            visit(extraction.root, dispatcher.module)
    return owners


_Link = tuple[CompiledGraphModule, Any, int, dict[str, OpPoint]]


def _links(found: Graphs, prepared: list[PreparedPasses]) -> list[_Link]:
    """For a bridged model: per graph, the user's module and call it serves, and its op points
    before the edit."""
    bridge = found.bridge
    if bridge is None:
        return []
    links = []
    for item in prepared:
        live = item.work.live
        link = bridge.link_of(live)
        if link is not None:
            links.append((live, link[0], link[1], live.named_op_points_made()))
    return links


def _update_bridge(bridge: Bridge, links: list[_Link]) -> None:
    """Register the op points of new nodes on the user's modules; unregister those of removed nodes
    no graph of the same call still has."""
    for live, module, invocation, before in links:
        bridge.add_points(live, module, invocation)
        for name, point in before.items():
            if name in live.point_names:
                continue
            if not any(name in owner.point_names for owner in point.owners()):
                bridge.remove_point(module, invocation, name)
