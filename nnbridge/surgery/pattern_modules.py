"""The module form of :func:`~nnbridge.surgery.replace_pattern`: one new module per match, as
peft's ``inject_adapter_in_model`` puts one adapter on each targeted layer.

For each match, ``replacement_module(match)`` (``match``: a :class:`PatternMatch`) returns a new
``nn.Module`` whose forward takes the pattern's tensor inputs, in the pattern's argument order,
and returns the replacement value (a tuple of as many values, for a pattern returning a tuple).
It is inserted as :func:`~nnbridge.surgery.insert_after` inserts a module (:mod:`.recipes`):
registered on the module whose graph holds the match (named after its class in snake case,
numbered when taken: ``lo_ra``, ``lo_ra_1``), so it is in ``model.parameters()``,
``state_dict()``, ``.to()``, ``.train()`` and the envoy tree; extracted itself (its ops have
NodePaths below the new node); kept as a recipe (:class:`PatternInsertion`) that every later
extraction of that module applies, replacing the match by one ``call_module`` node of it.

The module may hold matched modules as children (a LoRA adapter wrapping the matched linear,
``base(x) + B(A(x))``): they are shared, not copied, so ``state_dict()`` lists their tensors under
both names, as with tied weights. Example::

    def pattern(x, base: torch.nn.Linear):
        return base(x)

    rewrite = replace_pattern(model, pattern, replacement_module=lambda m: LoRA(m.modules["base"]))
    rewrite.modules          # {'blocks_0.lo_ra': LoRA(...), ...}
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch.fx import Node

from ..compat.torch.fake_tensors import fake_call
from ..compat.torch.hooks import cleared_module_state
from ..compat.torch.module_dicts import modules_of
from ..dispatch.dispatcher import GraphDispatcher
from ..errors import PatternError, SurgeryError
from ..graph.graph_module import CompiledGraphModule
from ..graph.metadata import node_meta, node_name, update_node_meta
from ..graph.recipes import Callers, add_recipe, remove_recipe
from .fake_values import UNKNOWN
from .pass_inputs import Parents, recorded_inputs, recorded_spec, recorded_value
from .pass_targets import graph_path
from .pattern_graphs import PatternGraph, name_of
from .pattern_log import MatchLog
from .pattern_match import Match, match_graph
from .pattern_rewrite import insertion_point
from .insertion import default_name
from .recipes import INSERTED_KEY, InsertedModule, Spec
from .sites import tensor_spec, value_of
from .targets import Target

#: ``replacement_module``: ``factory(match) -> nn.Module``
Factory = Callable[["PatternMatch"], torch.nn.Module]


@dataclass(frozen=True)
class PatternMatch:
    """What a ``replacement_module`` factory gets for one match.

    Attributes:
        graph: the NodePath of the graph holding the match (``""``: the root graph).
        anchor: the NodePath of the node the pattern's (first) output matched.
        modules: ``{module slot: the matched module}`` (the model's own objects).
        inputs: the pattern's tensor inputs, in the order the new module's forward takes them.
        shapes: ``{tensor input: its size on the example call}``.
    """

    graph: str
    anchor: str
    modules: dict[str, torch.nn.Module]
    inputs: tuple[str, ...]
    shapes: dict[str, torch.Size]


def _describe(specs: list[Spec]) -> str:
    return ", ".join(f"{tuple(size)} {str(dtype).removeprefix('torch.')} on {device}" for size, dtype, device in specs)


def input_specs(pattern: PatternGraph, graph: CompiledGraphModule, match: Match, *, parents: Parents,
                root: dict[int, dict[str, Any]], where: str) -> list[Spec]:
    """``(sizes, dtype, device)`` of each tensor input of ``match``, in :attr:`PatternMatch.inputs`
    order, from the values recorded for the graph's nodes, its callers' and (``root``) the
    extraction's own inputs.

    Raises:
        PatternError: an input whose value is unknown or no tensor.
    """
    specs = []
    for name in pattern.tensors:
        node = match.tensors[name]
        value = recorded_value(node, graph, parents, root=root)
        spec = recorded_spec(value)
        if spec is not None:
            specs.append(spec)
            continue
        what = "unknown" if value is UNKNOWN else f"a {type(value).__name__}"
        raise PatternError(
            f"replace_pattern: the pattern's input {name} is {match.graph or '<root>'}.{node_name(node)} at {where},"
            f" whose value is {what}; a replacement_module takes tensors of known size (it is checked and extracted"
            " for them). Start the pattern at a tensor, or pass a replacement function.")
    return specs


def output_specs(graph: CompiledGraphModule, match: Match, *, where: str) -> list[Spec]:
    """``(sizes, dtype, device)`` of each output of ``match``.

    Raises:
        PatternError: an output is no tensor of known size.
    """
    try:
        return [tensor_spec(graph, node, where=f"replace_pattern: the output {node_name(node)} at {where}")
                for node in match.outputs]
    except PatternError:
        raise
    except SurgeryError as error:
        raise PatternError(str(error)) from error


def check_module(module: torch.nn.Module, specs: list[Spec], expected: list[Spec], *, several: bool,
                 where: str) -> None:
    """Run ``module`` once on fake tensors of ``specs``; it must return ``expected`` (a tuple of
    them when ``several``).

    Raises:
        PatternError: it raises, or returns another number of values, shape, dtype or device.
    """
    name = type(module).__name__
    try:
        with cleared_module_state(module):  # the check runs no user hook, nor a bridged body
            out = fake_call(module, specs)
    except Exception as error:  # noqa: BLE001 - reported with the match and the module
        raise PatternError(f"replace_pattern: the replacement module {name} fails at {where} on the pattern's inputs"
                           f" ({_describe(specs)}): {type(error).__name__}: {error}. Nothing was edited.") from error
    values = list(out) if several and isinstance(out, (tuple, list)) else [out]
    if several and (not isinstance(out, (tuple, list)) or len(values) != len(expected)):
        arity = (f"a tuple of {len(values)}" if isinstance(out, (tuple, list))
                 else "one tensor" if isinstance(out, torch.Tensor) else type(out).__name__)
        raise PatternError(f"replace_pattern: the replacement module {name} returns {arity} at {where}, but the pattern"
                           f" returns a tuple of {len(expected)} values; return one tensor per pattern output, in"
                           " order. Nothing was edited.")
    if not all(isinstance(v, torch.Tensor) for v in values):
        raise PatternError(f"replace_pattern: the replacement module {name} returns {type(out).__name__} at {where},"
                           " not tensors; return what the pattern returns. Nothing was edited.")
    got = [(v.shape, v.dtype, v.device) for v in values]
    if got != expected:
        raise PatternError(
            f"replace_pattern: the replacement module {name} at {where} returns {_describe(got)} where the graph"
            f" expects {_describe(expected)}; it must keep each value's shape, dtype and device (the ops after it were"
            " extracted for them). Nothing was edited.")


class PatternInsertion(InsertedModule):
    """The recipe of one match of the module form (see the module docstring): in each graph of
    ``owner``, the match whose anchor is the node ``anchor`` is replaced by one call of the module.

    Args:
        pattern: the traced pattern.
        module: the new module (registered on ``owner`` as ``name`` by the caller).
        owner: the module whose graphs hold the match; ``owner_path`` its torch path.
        prefix: the NodePath of its graph; ``anchor``: the anchor node's name there; ``modules``:
            the match's module slots (a graph where the anchor's match binds others raises).
    """

    def __init__(self, pattern: PatternGraph, module: torch.nn.Module, *, owner: torch.nn.Module, owner_path: str,
                 prefix: str, anchor: str, modules: dict[str, str], name: str):
        self.pattern, self.module, self.anchor, self.modules = pattern, module, anchor, modules
        self.owner, self.owner_path, self.prefix = owner, owner_path, prefix
        self.child: str | None = name
        self.node_path = f"{prefix}.{name}" if prefix else name
        self._dispatcher: GraphDispatcher | None = None
        self.edit: Any = None

    def __repr__(self) -> str:
        where = f"{self.prefix}.{self.anchor}" if self.prefix else self.anchor
        return f"replace_pattern({self.pattern.name} at {where!r}, {type(self.module).__name__}) -> {self.node_path!r}"

    def _match(self, graph: CompiledGraphModule, reason: str, callers: Callers | None) -> Match | None:
        """The match at :attr:`anchor` in ``graph`` (``callers``: its callers and inputs, for the
        candidates' values); None when ``graph`` has no node of that name (a call structure that
        does not reach the match, as eager would not call its module)."""
        if not any(node_name(n) == self.anchor for n in graph.graph.nodes):
            return None
        log = MatchLog()
        where = graph_path(graph)
        known = callers or Callers()
        for match in match_graph(self.pattern, graph, where=where, log=log,
                                 recorded=recorded_inputs(graph, known.parents, known.inputs)):
            if node_name(match.anchor_node) == self.anchor:
                if match.modules != self.modules:
                    why = f"it binds the modules {match.modules}, the module was made for {self.modules}"
                    break
                return match
        else:
            found = [e.reason for e in log if e.anchor.rsplit(".", 1)[-1] == self.anchor and e.reason]
            why = found[0] if found else "the pattern does not match there"
        raise PatternError(
            f"{self!r} no longer applies: the graph of '{self.prefix or '<root>'}' extracted now ({reason}) has no"
            f" match of {self.pattern.name} at {self.anchor!r}: {why}. Remove the rewrite (its .remove(), or"
            " nnbridge.surgery.clear(model)) or undo the change; nothing was run.")

    def apply(self, graph: CompiledGraphModule, *, options: Any, reason: str, callers: Callers | None = None
              ) -> None:
        """Replace the match in ``graph`` (see :class:`~nnbridge.graph.recipes.Recipe`).

        A graph with no node named :attr:`anchor` (a call structure not reaching the match) is
        left as is.

        Raises:
            PatternError: the anchor's node is no match now, or binds other modules, or the module
                does not fit it on this extraction.
        """
        name = str(self.child)
        if self._applied(graph, name, PatternError):
            return
        match = self._match(graph, reason, callers)
        if match is None:
            return
        where = match.anchor
        known = callers or Callers()
        specs = input_specs(self.pattern, graph, match, parents=known.parents, root=known.inputs, where=where)
        expected = output_specs(graph, match, where=where)
        check_module(self.module, specs, expected, several=self.pattern.returns_tuple, where=where)
        child = self._extracted(specs, options)
        graph.add_submodule(name, child)
        fx = graph.graph
        inputs = tuple(match.tensors[t] for t in self.pattern.tensors)
        with fx.inserting_after(insertion_point(graph, match)):
            new = fx.call_module(name, inputs)
        new.meta[INSERTED_KEY] = id(self)
        made = {new}
        if self.pattern.returns_tuple:
            new.meta["val"] = tuple(value_of(graph, n) for n in match.outputs)
            update_node_meta(new, name=name, module_path=name)
            taken = {node_name(n) for n in fx.nodes}
            values: list[Node] = []
            last = new
            for index, output in enumerate(match.outputs):
                with fx.inserting_after(last):
                    item = fx.call_function(operator.getitem, (new, index))
                item.meta["val"] = value_of(graph, output)
                item_name = _free(f"{name}_{index}", taken)
                taken.add(item_name)
                update_node_meta(item, name=item_name, example=node_meta(output).example)
                values.append(item)
                made.add(item)
                last = item
        else:
            new.meta["val"] = value_of(graph, match.outputs[0])
            update_node_meta(new, name=name, module_path=name, example=node_meta(match.outputs[0]).example)
            values = [new]
        for output, value in zip(match.outputs, values):
            output.replace_all_uses_with(value, delete_user_cb=lambda user: user not in made)
        pending = list(match.nodes.values())
        while pending:  # users first: the matched nodes have no user outside the match now
            node = next(n for n in pending if not n.users)
            fx.erase_node(node)
            pending.remove(node)
        graph.recompile()


class PatternWatch:
    """The module form's check of later extractions, kept on each module whose graphs were in
    scope (after that module's :class:`PatternInsertion` recipes): a match that a new extraction
    has and no insertion replaced (another call structure of the module reaching the pattern
    elsewhere) raises, since the factory ran once, for the matches ``replace_pattern`` saw.

    Attributes:
        node_path: the scope asked for; ``owner``: the module; ``applied``: the
            :class:`ModuleRewrite` (listed by ``surgery.edits``).
    """

    child: str | None = None

    def __init__(self, pattern: PatternGraph, *, owner: torch.nn.Module, owner_path: str, scope: str,
                 in_scope: Callable[[str], bool], applied: ModuleRewrite):
        self.pattern, self.owner, self.owner_path = pattern, owner, owner_path
        self.node_path, self.in_scope, self.applied = scope, in_scope, applied

    def __repr__(self) -> str:
        return f"PatternWatch({self.pattern.name} in {self.node_path!r}, owner={self.owner_path or '<root>'!r})"

    def apply(self, graph: CompiledGraphModule, *, options: Any, reason: str, callers: Callers | None = None
              ) -> None:
        """Check ``graph`` (when in scope) for a match no insertion replaced.

        Raises:
            PatternError: there is one; it names the match, why the module was extracted, and the fix.
        """
        where = graph_path(graph)
        if not self.in_scope(where):
            return
        known = callers or Callers()
        for match in match_graph(self.pattern, graph, where=where, log=MatchLog(),
                                 recorded=recorded_inputs(graph, known.parents, known.inputs)):
            if any(INSERTED_KEY in node.meta for node in match.nodes.values()):
                continue  # the call of a module this rewrite inserted
            raise PatternError(
                f"replace_pattern({self.pattern.name}, replacement_module=...): the extraction of"
                f" '{self.owner_path or '<root>'}' made now (extracted for: {reason}) has a match at {match.anchor}"
                " that the rewrite made no module for (its factory ran once, for the matches of the extractions"
                " replace_pattern saw). Remove the rewrite (its .remove(), or surgery.clear(target)), run this call"
                " once, then call replace_pattern again: its factory then gets this match too. Nothing was run.")

    def withdraw(self) -> None:
        """Nothing to undo on the model (the watch inserts nothing)."""


def _free(base: str, taken: set[str]) -> str:
    name, number = base, 0
    while name in taken:
        number += 1
        name = f"{base}_{number}"
    return name


@dataclass
class ModuleRewrite:
    """What ``replace_pattern(..., replacement_module=...)`` did: an edit, listed by
    ``surgery.edits``, undone by :meth:`remove` (or the end of a ``with`` block).

    Attributes:
        matches: the NodePaths of the anchors replaced.
        modules: ``{NodePath of the new node: the new module}``.
        log: the match log of the call (the matching of later extractions is not logged).
        recipes: one :class:`PatternInsertion` per match, then one :class:`PatternWatch` per
            module whose graphs were in scope.
        scope: the scope asked for.
    """

    matches: list[str] = field(default_factory=list)
    modules: dict[str, torch.nn.Module] = field(default_factory=dict)
    log: MatchLog = field(default_factory=MatchLog)
    recipes: list[PatternInsertion | PatternWatch] = field(default_factory=list)
    scope: str = "**"
    target: Target | None = None
    before: set[int] = field(default_factory=set)
    removed: bool = False

    def __repr__(self) -> str:
        state = "removed" if self.removed else "active"
        return f"ModuleRewrite(matches={self.matches}, {state})"

    @property
    def node_path(self) -> str:
        """The scope the rewrite was asked for (a glob over graph NodePaths)."""
        return self.scope

    def remove(self) -> None:
        """Undo the rewrite: the new modules leave their owners, extractions made with them are
        dropped (the next call is served by an unedited one, or extracts again). Matched modules a
        new module held as children stay the model's. Removing twice does nothing."""
        if self.removed:
            return
        self.removed = True
        for recipe in self.recipes:
            remove_recipe(recipe)
            recipe.withdraw()
        target = self.target
        if target is None:
            return
        if target.bridge is not None:
            own = list(target.model.modules())
            for recipe in self.recipes:
                if isinstance(recipe, PatternInsertion):
                    target.bridge.release(recipe.module, keep=own)
        for dispatcher in target.dispatchers():
            dispatcher.discard(lambda extraction: id(extraction) in self.before)
        target.refresh()

    def __enter__(self) -> ModuleRewrite:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.remove()


@dataclass
class _Planned:
    match: Match
    graph: CompiledGraphModule
    owner: torch.nn.Module
    owner_path: str
    specs: list[Spec]
    expected: list[Spec]


def insert_modules(target: Target, pattern: PatternGraph, factory: Factory, *,
                   found: list[tuple[str, CompiledGraphModule, torch.nn.Module]], parents: Parents,
                   inputs: dict[int, dict[str, Any]], scope: str, in_scope: Callable[[str], bool],
                   log: MatchLog) -> ModuleRewrite:
    """Match ``pattern`` in each ``(NodePath, graph, owner)`` of ``found``, make a module per match
    with ``factory``, check it on fake values, then register every module and recipe (see the
    module docstring). ``parents`` and ``inputs``: each compiled graph's caller and each extraction
    root's inputs (:class:`~.pass_targets.Graphs`); ``scope``: the glob asked for, ``in_scope``
    whether a graph's NodePath is in it.

    Raises:
        PatternError: the factory raises or returns no new module, a module does not fit its match,
            an input's value is unknown; nothing is edited then.
    """
    paths = {id(m): p for p, m in target.model.named_modules(remove_duplicate=False)}
    planned: dict[tuple[int, str], _Planned] = {}
    for where, graph, owner in found:
        for match in match_graph(pattern, graph, where=where, log=log,
                                 recorded=recorded_inputs(graph, parents, inputs)):
            key = (id(owner), node_name(match.anchor_node))
            if key in planned:
                continue  # another graph of the same module (a module called twice): one module serves both
            planned[key] = _Planned(match, graph, owner, paths.get(id(owner), ""),
                                    input_specs(pattern, graph, match, parents=parents, root=inputs, where=match.anchor),
                                    output_specs(graph, match, where=match.anchor))
    made: list[tuple[_Planned, torch.nn.Module]] = []
    for plan in planned.values():
        match = plan.match
        given = PatternMatch(match.graph, match.anchor,
                             {slot: plan.owner.get_submodule(path) for slot, path in match.modules.items()},
                             tuple(pattern.tensors), {n: s[0] for n, s in zip(pattern.tensors, plan.specs)})
        module = _made(factory, given, target.model, earlier=[m for _, m in made])
        check_module(module, plan.specs, plan.expected, several=pattern.returns_tuple, where=match.anchor)
        made.append((plan, module))
    rewrite = ModuleRewrite(log=log, scope=scope, target=target, before={id(e) for e in target.extractions()})
    names: dict[int, set[str]] = {}
    for plan, module in made:
        taken = names.setdefault(id(plan.owner), {node_name(n) for _, g, o in found if o is plan.owner
                                                  for n in g.graph.nodes})
        name = _free(default_name(module), taken | {n for n in dir(plan.owner) if not n.startswith("__")})
        taken.add(name)
        insertion = PatternInsertion(pattern, module, owner=plan.owner, owner_path=plan.owner_path,
                                     prefix=plan.match.graph, anchor=node_name(plan.match.anchor_node),
                                     modules=dict(plan.match.modules), name=name)
        insertion.edit = rewrite
        rewrite.recipes.append(insertion)
        rewrite.modules[insertion.node_path] = module
        rewrite.matches.append(plan.match.anchor)
    owners = {id(o): (o, paths.get(id(o), "")) for _, _, o in found}
    rewrite.recipes.extend(PatternWatch(pattern, owner=owner, owner_path=path, scope=scope, in_scope=in_scope,
                                        applied=rewrite) for owner, path in owners.values())
    try:
        for recipe in rewrite.recipes:
            if isinstance(recipe, PatternInsertion):
                modules_of(recipe.owner)[str(recipe.child)] = recipe.module
                if target.bridge is not None:
                    target.bridge.adopt(recipe.owner, str(recipe.child))  # an envoy for it, as for op points
            add_recipe(recipe)
        target.refresh()
    except BaseException:
        rewrite.remove()
        raise
    return rewrite


def _made(factory: Factory, match: PatternMatch, model: torch.nn.Module, *, earlier: list[torch.nn.Module]
          ) -> torch.nn.Module:
    """``factory(match)``, checked to be a new module.

    Raises:
        PatternError: the factory raises, returns no nn.Module, a module of the model, or one it
            returned for another match.
    """
    name = name_of(factory)
    try:
        module = factory(match)
    except Exception as error:  # noqa: BLE001 - reported with the match
        raise PatternError(f"replace_pattern: the replacement_module factory {name} raised for the match at"
                           f" {match.anchor}: {type(error).__name__}: {error}. Nothing was edited.") from error
    if not isinstance(module, torch.nn.Module):
        raise PatternError(f"replace_pattern: the replacement_module factory {name} returned {type(module).__name__}"
                           f" for the match at {match.anchor}, not an nn.Module; return a new module whose forward"
                           f" takes {list(match.inputs)}. Nothing was edited.")
    if any(m is module for m in model.modules()) or any(m is module for m in earlier):
        raise PatternError(f"replace_pattern: the replacement_module factory {name} returned a {type(module).__name__}"
                           f" for the match at {match.anchor} that is already part of the model or was returned for"
                           " another match; return a new instance per match. Nothing was edited.")
    return module

