"""Module-aware pattern rewriting: :func:`match` and :func:`replace_pattern`.

A pattern is a plain function whose arguments are tensors (match any value) and modules annotated
with their class (match a call of a child of that class; nnbridge's per-module graphs keep each
child call as one ``call_module`` node, so a pattern can span modules, as ``l1(l0(x))``). It is
traced by torch.fx once (:mod:`.pattern_graphs`; with ``example_inputs=``, from values), which finds
candidates in every compiled graph in ``scope`` (:mod:`.pattern_match`); each candidate stands only
if the pattern extracted by nnbridge's exporter from the candidate's own values
(:mod:`.pattern_export`, :mod:`.pattern_spec`) matches it in ATen form; and each match is replaced by the replacement traced with the matched
modules themselves (:mod:`.pattern_rewrite`): no weight is copied, parameter names with ``.`` are
no problem. The rewrite is an edit like :func:`~nnbridge.surgery.apply_passes`' (it runs as a pass,
with the same checks, and is undone on any failure), kept as recipes re-applied to every later
extraction (another call structure, dtype, ``.train()``) until ``.remove()``. Example::

    def pattern(x, l0: CustomLinear, l1: CustomLinear):
        return l1(l0(x))

    def fused(x, l0, l1):
        return torch.nn.functional.linear(x, l1.weight @ l0.weight)

    rewrite = replace_pattern(model, pattern, fused, scope="blocks_*")
    print(rewrite.log)             # MATCHED / REJECTED / SKIPPED per candidate, by NodePath
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import PassCheckError, PatternError
from ..graph.graph_module import CompiledGraphModule, OpaqueGraphModule
from ..graph.locking import CALL_LOCK
from ..graph.recipes import Callers
from .pass_checks import DEFAULT_CHECKS
from .pass_inputs import Parents, recorded_inputs
from .pass_recipes import PassRecipe
from .pass_targets import graph_path, graphs_below, target_graphs
from .passes import AppliedPasses, PassEdit, PreparedPasses, apply_edit, graph_owners
from .pattern_graphs import PatternGraph, name_of
from .pattern_log import LogEntry, MatchLog
from .pattern_match import Match, match_graph
from .pattern_modules import Factory, ModuleRewrite, insert_modules
from .pattern_rewrite import PatternPass
from .pattern_spec import Specialiser
from .targets import target_of


class PatternEdit(PassEdit):
    """The rewrite as a :class:`~nnbridge.surgery.passes.PassEdit`: its one pass is a
    :class:`~.pattern_rewrite.PatternPass`; a graph without a match is left as it is, and a graph
    rewritten once (one several extractions share) is not rewritten again."""

    def __init__(self, rewriter: PatternPass, *, scope: str):
        super().__init__([rewriter], scope=scope, checks=DEFAULT_CHECKS)
        self.rewriter = rewriter
        self._owner: torch.nn.Module | None = None
        self._done: weakref.WeakSet[CompiledGraphModule] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"PatternEdit({self.rewriter.__name__}, scope={self.scope!r})"

    def bind_owner(self, owner: torch.nn.Module) -> None:
        self._owner = owner

    def prepare(self, graph_module: CompiledGraphModule, where: str, *, parents: Parents | None = None,
                root: dict[int, dict[str, Any]] | None = None,
                recorded: dict[str, Any] | None = None) -> PreparedPasses:
        if self._owner is None:
            raise PatternError(f"{self!r}: the module of the graph {where or '<root>'} is unknown")
        if recorded is None:
            recorded = recorded_inputs(graph_module, parents or {}, root)
        self.rewriter.bind(owner=self._owner, where=where, recorded=recorded)
        prepared = super().prepare(graph_module, where, parents=parents, root=root, recorded=recorded)
        prepared.changed = bool(self.rewriter.matches)
        self._done.add(graph_module)
        return prepared

    def apply(self, graph_module: CompiledGraphModule, callers: Callers | None = None) -> None:
        if graph_module not in self._done:
            super().apply(graph_module, callers)


class PatternRecipe(PassRecipe):
    """A rewrite kept on one module: every later extraction of it gets the rewrite (the matches
    of the new graphs are logged to the same log)."""

    edit: PatternEdit

    def apply(self, graph: CompiledGraphModule, *, options: Any, reason: str, callers: Callers | None = None
              ) -> None:
        """Rewrite ``graph``'s matches (when it is in scope).

        Raises:
            PatternError: the replacement or a check fails on this extraction; the graph is unchanged.
        """
        try:
            self.edit.bind_owner(self.owner)
            self.edit.apply(graph, callers)
        except (PassCheckError, PatternError) as error:
            raise PatternError(
                f"{self.edit!r} no longer applies to a new extraction of {type(self.owner).__name__} (extracted for:"
                f" {reason}): {error} Remove the rewrite (its .remove(), or surgery.clear(target)) or make the"
                " replacement fit this extraction.") from error


@dataclass
class MatchResult:
    """What :func:`match` found.

    Attributes:
        matches: each :class:`~.pattern_match.Match` (graph, anchor NodePath, nodes, bound modules).
        log: the :class:`~.pattern_log.MatchLog`: every candidate and its verdict.
        dropped: the pattern inputs left unused after binding ``constants`` (dropped).
    """

    matches: list[Match] = field(default_factory=list)
    log: MatchLog = field(default_factory=MatchLog)
    dropped: list[str] = field(default_factory=list)


@dataclass
class Rewrite(AppliedPasses):
    """What :func:`replace_pattern` did: an edit (see :class:`~nnbridge.surgery.passes.AppliedPasses`:
    ``.remove()``, a context manager, listed by ``surgery.edits``).

    Attributes:
        matches: the NodePaths of the anchors replaced, per graph edited.
        log: the match log (also of later extractions the rewrite is applied to).
    """

    matches: list[str] = field(default_factory=list)
    log: MatchLog = field(default_factory=MatchLog)

    def __repr__(self) -> str:
        state = "removed" if self.removed else "active"
        return f"Rewrite({self.edit!r}, matches={self.matches}, {state})"


def _traced(pattern: Any, constants: Mapping[str, Any] | None, *, example_inputs: Any, log: MatchLog) -> PatternGraph:
    if constants is not None and not isinstance(constants, Mapping):
        raise PatternError(f"constants= must be a dict {{argument: value}}; got {type(constants).__name__}.")
    specialiser = Specialiser(pattern, constants=dict(constants or {}), name=name_of(pattern), example=example_inputs)
    traced = specialiser.generic()
    if not traced.slots and not any(n.op in ("call_function", "call_method") for n in traced.graph.nodes):
        raise PatternError(f"the pattern {traced.name} has no op and no module call to match.")
    for dropped in traced.dropped:
        log.add(LogEntry(traced.name, "-", dropped, "DROPPED", "input unused after binding constants="))
    return traced


def match(target: Any, pattern: Any, *, scope: str = "**", constants: Mapping[str, Any] | None = None,
          example_inputs: Any = None) -> MatchResult:
    """Find ``pattern`` in the compiled graphs of ``target`` in ``scope``; changes nothing.

    Args:
        target: a bridged model, a :class:`~nnbridge.PatchableGraph` or an nnbridge NNsight model.
        pattern: a function (or module: its forward); arguments annotated with an ``nn.Module``
            subclass match calls of modules of that class, others match any tensor.
        scope: a glob over graph NodePaths (``"blocks_*"``; ``"**"``: every graph).
        constants: ``{argument: value}`` bound before tracing (a config steering control flow).
        example_inputs: a tensor per tensor argument (a tuple in order, or a dict by name): the
            pattern is then traced with values (``x.dtype`` and ``x.shape`` read them), and its
            candidates found by their ATen op names, see :mod:`.pattern_spec`. None: a symbolic trace
            finds candidates (it must not read tensor metadata). Either way each candidate is
            matched by the pattern extracted from its own values.

    Returns:
        :class:`MatchResult` (``.matches``, ``.log``).

    Raises:
        PatternError: a bad pattern or argument, ``example_inputs`` not one tensor per tensor
            argument or a pattern that cannot be traced with them, or a scope that matches no graph.
    """
    log = MatchLog()
    traced = _traced(pattern, constants, example_inputs=example_inputs, log=log)
    resolved = target_of(target, "match")
    result = MatchResult(log=log, dropped=list(traced.dropped))
    with CALL_LOCK:
        try:
            found = target_graphs(resolved.pg if resolved.pg is not None else resolved.model)
        except PassCheckError as error:
            raise PatternError(str(error).replace("apply_passes", "match")) from error
        edit = PassEdit(lambda gm: None, scope=scope)
        chosen = [(path, graph) for path, graph in found.graphs if edit.matches(path)]
        if not chosen:
            raise PatternError(f"match: the scope {scope!r} matches no compiled graph; graphs:"
                               f" {sorted({p or '<root>' for p, _ in found.graphs})[:12]}.")
        for path, graph in chosen:
            result.matches.extend(match_graph(traced, graph, where=path, log=log,
                                              recorded=recorded_inputs(graph, found.parents, found.inputs)))
        _log_opaque(resolved, edit, traced, log=log)
    return result


def _log_opaque(resolved: Any, edit: PassEdit, traced: PatternGraph, *, log: MatchLog) -> None:
    """A SKIPPED entry for each opaque (eager) graph in scope, and a NO-CANDIDATE entry when no
    graph in scope had a candidate."""
    _log_no_candidate(traced, edit.scope, log=log)
    seen: set[int] = set()
    for dispatcher in resolved.dispatchers():
        for extraction in dispatcher.all_extractions():
            for graph in graphs_below(extraction.root, seen, {}):
                if isinstance(graph, OpaqueGraphModule) and edit.matches(graph_path(graph)):
                    where = graph_path(graph) or "<root>"
                    log.add(LogEntry(traced.name, where, where, "SKIPPED",
                                     f"opaque: {graph.original_type.__name__} runs eagerly, with no graph to match"
                                     " (nnbridge.explain(model) says why)"))


def _log_no_candidate(traced: PatternGraph, scope: str, *, log: MatchLog) -> None:
    """One NO-CANDIDATE entry when no candidate was tried in any graph in ``scope``: the pattern's
    last op (its anchor) is of a kind no node has, with the rule and the fix."""
    if any(e.verdict in ("MATCHED", "REJECTED") for e in log):
        return
    anchor = traced.output
    if anchor.op == "call_module":
        what = "a module call"
        fix = "check the scope; a module called by an opaque (eager) graph is no node of any graph"
    elif traced.exported is not None:
        what = f"the op {anchor.target}"
        fix = "read the graphs' code (print(graph.code)) for the ATen op this model uses instead"
    else:
        what = f"an op named {anchor.target if anchor.op == 'call_method' else getattr(anchor.target, '__name__', anchor.target)}"
        fix = ("without example_inputs= an op is found by the name torch.fx gives it, which may not be its ATen"
               " name (operator.truediv is aten.div): give example_inputs= to find it by its ATen name, or call"
               " the torch function of the graphs' op (torch.div)")
    log.add(LogEntry(traced.name, scope, "-", "NO-CANDIDATE",
                     f"no node in the graphs in scope {scope!r} is {what} (the pattern's last op); {fix}"))


def replace_pattern(target: Any, pattern: Any, replacement: Any = None, *, replacement_module: Factory | None = None,
                    scope: str = "**", constants: Mapping[str, Any] | None = None,
                    example_inputs: Any = None) -> Rewrite | ModuleRewrite:
    """Replace every match of ``pattern`` in ``target``'s compiled graphs in ``scope`` by
    ``replacement`` (see the module docstring), now and in every later extraction; or, with
    ``replacement_module=``, by a call of a new module per match (:mod:`.pattern_modules`).

    Args:
        target: as :func:`match`.
        pattern: as :func:`match`. It returns one value, or a tuple of values (``return a, b``),
            each of whose users outside the match then read the replacement's value at the
            same position.
        replacement: a function taking (a subset of) the pattern's arguments by name: tensors, the
            matched module objects, the constants; it returns one tensor of the anchor's shape,
            dtype and device (a tuple of as many as the pattern returns). It may read the matched
            modules' parameters and call each matched module once.
        replacement_module: instead of ``replacement``: ``factory(match)`` (``match``: a
            :class:`~.pattern_modules.PatternMatch`: ``.modules`` by slot name, ``.inputs``,
            ``.shapes``, ``.anchor``) returning a new ``nn.Module`` whose forward takes the
            pattern's tensor inputs in order and returns what ``replacement`` would (peft's
            ``inject_adapter_in_model`` inserts one adapter per layer likewise).
        scope: as :func:`match`.
        constants: as :func:`match`; passed to the replacement too when it takes them.
        example_inputs: as :func:`match`.

    Returns:
        :class:`Rewrite` (``.matches``: anchor NodePaths, ``.log``, ``.remove()``); with
        ``replacement_module``, a :class:`~.pattern_modules.ModuleRewrite` (also ``.modules``:
        ``{NodePath of the new node: module}``).

    Raises:
        PatternError: a bad pattern or replacement (or both or neither of ``replacement`` and
            ``replacement_module``), a scope that matches no graph, a replacement that fails to
            trace, returns another number of values than the pattern, or changes a value's shape,
            dtype or device (the check names the graph); a factory that raises or returns no new
            module; a module input whose value is unknown. Every graph is then as before.
    """
    if (replacement is None) == (replacement_module is None):
        given = "both" if replacement is not None else "neither"
        raise PatternError(f"replace_pattern takes exactly one of replacement (a function) and replacement_module (a"
                           f" factory making a module per match); got {given}. Pass replacement=fn or"
                           " replacement_module=factory.")
    log = MatchLog()
    traced = _traced(pattern, constants, example_inputs=example_inputs, log=log)
    if replacement_module is not None:
        return _replace_by_modules(target, traced, replacement_module, scope=scope, log=log)
    if not callable(replacement):
        raise PatternError(f"the replacement must be a function or an nn.Module; got {type(replacement).__name__}.")
    rewriter = PatternPass(traced, replacement, constants=dict(constants or {}), log=log)
    try:
        edit = PatternEdit(rewriter, scope=scope)
    except PassCheckError as error:
        raise PatternError(str(error).replace("apply_passes", "replace_pattern")) from error
    rewrite = Rewrite(edit, log=log)
    resolved = target_of(target, "replace_pattern")
    try:
        apply_edit(resolved.pg if resolved.pg is not None else resolved.model, edit, rewrite,
                   make_recipe=lambda owner: PatternRecipe(edit, owner), verb="replace_pattern")
    except PatternError:
        raise
    except PassCheckError as error:
        message = str(error).removeprefix("apply_passes: ").replace("apply_passes", "replace_pattern")
        raise PatternError(f"replace_pattern {traced.name} -> {name_of(replacement)}: {message}") from error
    _log_opaque(resolved, edit, traced, log=log)
    rewrite.matches = [entry.anchor for entry in log.verdicts("MATCHED")]
    return rewrite


def _replace_by_modules(target: Any, traced: PatternGraph, factory: Any, *, scope: str, log: MatchLog
                        ) -> ModuleRewrite:
    """The module form of :func:`replace_pattern` (:mod:`.pattern_modules`)."""
    if not callable(factory) or isinstance(factory, torch.nn.Module):
        raise PatternError(f"replacement_module must be a function making a new nn.Module per match (factory(match));"
                           f" got {type(factory).__name__}. Write replacement_module=lambda match: MyModule(...).")
    resolved = target_of(target, "replace_pattern")
    try:
        scoped = PassEdit(lambda gm: None, scope=scope)
    except PassCheckError as error:
        raise PatternError(str(error).replace("apply_passes", "replace_pattern")) from error
    with CALL_LOCK:
        try:
            found = target_graphs(resolved.pg if resolved.pg is not None else resolved.model)
        except PassCheckError as error:
            raise PatternError(str(error).replace("apply_passes", "replace_pattern")) from error
        chosen = [(path, graph) for path, graph in found.graphs if scoped.matches(path)]
        if not chosen:
            raise PatternError(f"replace_pattern: the scope {scope!r} matches no compiled graph; graphs:"
                               f" {sorted({p or '<root>' for p, _ in found.graphs})[:12]}.")
        owners = graph_owners(resolved)
        rewrite = insert_modules(resolved, traced, factory, found=[(p, g, owners[id(g)]) for p, g in chosen],
                                 parents=found.parents, inputs=found.inputs, scope=scope,
                                 in_scope=scoped.matches, log=log)
    _log_opaque(resolved, scoped, traced, log=log)
    return rewrite
