"""Finding a traced pattern (:mod:`.pattern_graphs`) in one extracted graph.

Every node of the graph of the pattern's output kind is a candidate anchor: a ``call_module``
node for a pattern ending in a module call, an op of the same name for one ending in an op. From
the anchor, the pattern is walked backwards along arguments:

- a module slot matches a ``call_module`` node whose child graph was extracted from a subclass of
  the slot's annotation (kernl's extended matcher matches ``call_module`` by type likewise);
- an op of a pattern extracted by nnbridge's exporter (:mod:`.pattern_export`) matches the same
  ATen op and overload with equal arguments;
- an op of a torch.fx trace matches an ATen op of the same name (``operator.add``, ``torch.add`` and
  ``Tensor.add`` all match ``aten.add.*``; ``F.linear`` matches ``aten.linear.*``), with equal
  literal arguments; the target may have more trailing arguments (filled defaults), and may lack
  a keyword the pattern passes at its Python function's default (``F.silu``'s ``inplace=False``);
  walked leniently (a generic pattern, :mod:`.pattern_spec`) literals, keywords, argument counts
  and the names of ops other than the anchor are not compared;
- a tensor input matches any node, the same node wherever the input is used.

A pattern returning a tuple (``return a, b``) is anchored at its first value; each other value
is the node of its kind that completes the match consistently (a value the walk from the anchor
reached already, or one found among the graph's nodes of that kind).

A pattern is searched by :mod:`.pattern_spec`: its generic traces are walked leniently, then each
candidate's specialised pattern with every op and literal compared.

A structural match is then REJECTED when a value inside it (not one of the outputs) has a user
outside it (the user is named), when it shares a node with an earlier match, or (several
outputs) when an input of the match is computed after an outside user of one of its outputs
(one replacement cannot then stand before that user). Candidates and reasons go
to a :class:`~.pattern_log.MatchLog`; the failure that got furthest is the graph's near miss (as
onnxscript's MatchingTracer reports the best match attempt of a rule). Example::

    found = match_graph(pattern, graph_module, where="blocks_0", log=log)
    found[0].modules      # {'l0': 'l0', 'l1': 'l1'}: each slot's module path below the graph's module
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from torch.fx import GraphModule, Node

from ..errors import PatternError
from ..extract.naming import op_base_name
from ..graph.graph_module import CompiledGraphModule, GraphModuleBase
from ..graph.metadata import node_meta, node_name
from .pass_graphs import fetch
from .pattern_graphs import PatternGraph
from .pattern_log import LogEntry, MatchLog


@dataclass
class Match:
    """One match in one graph.

    Attributes:
        graph: the graph's NodePath (``""`` for a whole-model graph).
        anchor: the NodePath of the node whose value the pattern's output matched.
        nodes: ``{pattern node: graph node}`` for the pattern's ops and module calls.
        tensors: ``{tensor input: graph node}``.
        modules: ``{module slot: the matched module's path below the graph's module}``.
        outputs: the graph nodes of the pattern's output values, in order.
        values: ``{graph node: fake value}`` of the graph, by fake propagation, and ``mode`` their
            fake-tensor mode, where the search computed them (a pattern traced from values); else
            ``None`` (the rewrite computes them when it traces the replacement).
    """

    graph: str
    anchor: str
    nodes: dict[Node, Node] = field(default_factory=dict)
    tensors: dict[str, Node] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)
    outputs: list[Node] = field(default_factory=list)
    values: dict[Node, Any] | None = field(default=None, repr=False, compare=False)
    mode: Any = field(default=None, repr=False, compare=False)

    @property
    def anchor_node(self) -> Node:
        return next(iter(self.nodes.values()))

    def node_paths(self) -> list[str]:
        """The NodePaths of the matched graph nodes (anchor first)."""
        return [_path(self.graph, n) for n in self.nodes.values()]


def _path(where: str, node: Node) -> str:
    return f"{where}.{node_name(node)}" if where else node_name(node)


def _pattern_op_name(node: Node) -> str:
    if getattr(node.target, "overloadpacket", None) is not None:  # an ATen op of an extracted pattern
        return op_base_name(node).strip("_")
    if node.op == "call_method":
        return str(node.target).strip("_")
    return (getattr(node.target, "__name__", None) or str(node.target)).strip("_")


def _graph_op_name(node: Node) -> str:
    return op_base_name(node).strip("_")


class _Failed(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _Attempt:
    """One walk from one anchor (raises :class:`_Failed` with the reason)."""

    def __init__(self, pattern: PatternGraph, module: GraphModule, where: str, *, lenient: bool = False):
        self.pattern, self.module, self.where = pattern, module, where
        self.lenient = lenient  # literals not compared (a generic pattern's: see .pattern_spec)
        self.found = Match(where, "")
        self.taken: set[Node] = set()

    def path(self, node: Node) -> str:
        return _path(self.where, node)

    def module_class(self, node: Node) -> type | None:
        try:
            called = fetch(self.module, str(node.target))
        except AttributeError:
            return None
        if not isinstance(called, GraphModuleBase) and isinstance(self.module, CompiledGraphModule):
            called = self.module.child_graph(node)  # a bridged graph calls its children through call sites
        return called.original_type if isinstance(called, GraphModuleBase) else type(called)

    def node(self, p: Node, t: Node) -> None:
        if p in self.found.nodes:
            if self.found.nodes[p] is not t:
                raise _Failed(f"the pattern uses one value twice; {self.path(self.found.nodes[p])} and {self.path(t)}"
                              " differ")
            return
        if t in self.taken:
            raise _Failed(f"{self.path(t)} would stand for two pattern nodes")
        if p.op == "call_module":
            self.module_call(p, t)
        elif self.pattern.exported is not None and p.op == "call_function" and not self.lenient:  # the same overload
            if t.op != "call_function" or t.target != p.target:
                what = f"the op {t.target}" if t.op == "call_function" else f"a {t.op} node"
                raise _Failed(f"{self.path(t)} is {what}; the pattern wants {p.target}")
        else:
            want, got = _pattern_op_name(p), (_graph_op_name(t) if t.op == "call_function" else None)
            if got != want and not (self.lenient and got is not None and p is not self.pattern.output):
                what = f"the op {t.target}" if got is not None else f"a {t.op} node"
                raise _Failed(f"{self.path(t)} is {what}; the pattern wants {want}")
        self.found.nodes[p] = t
        self.taken.add(t)
        self.arguments(p, list(p.args), list(t.args), t=t)
        for key, value in p.kwargs.items():
            if key not in t.kwargs and (_default_of(p, key) == (value,) or self.lenient and not isinstance(value, Node)):
                continue  # F.silu(x, inplace=False) traced by fx: the ATen op has no such keyword
            if key not in t.kwargs:
                raise _Failed(f"{self.path(t)} has no keyword argument {key}={value!r}")
            self.argument(p, value, t.kwargs[key], t=t, which=key)

    def module_call(self, p: Node, t: Node) -> None:
        slot = str(p.target)
        want = self.pattern.slots[slot]
        if t.op != "call_module":
            raise _Failed(f"{self.path(t)} is {t.op} {t.target}, not a call of a {want.__name__} ({slot})")
        got = self.module_class(t)
        if got is None or not issubclass(got, want):
            name = got.__name__ if got is not None else "unknown module"
            raise _Failed(f"module type differs: {self.path(t)} is a {name}; the pattern's {slot} wants a"
                          f" {want.__name__}")
        module_path = node_meta(t).module_path or node_name(t)
        bound = self.found.modules.setdefault(slot, module_path)
        if bound != module_path:
            raise _Failed(f"{slot} is bound to {bound} already; {self.path(t)} calls {module_path}")
        if node_meta(t).extra_args:
            raise _Failed(f"{self.path(t)} passes state or constants the pattern cannot see")

    def arguments(self, p: Node, pattern_args: list[Any], args: list[Any], *, t: Node) -> None:
        if self.lenient and p.op != "call_module":  # literals are compared (in ATen form) once specialised
            if any(isinstance(want, Node) for want in pattern_args[len(args):]):
                raise _Failed(f"{self.path(t)} takes {len(args)} positional argument(s); the pattern passes a value as"
                              f" argument {len(args)}")
            pattern_args = pattern_args[:len(args)]
        if len(args) < len(pattern_args) or (p.op == "call_module" and len(args) != len(pattern_args)):
            raise _Failed(f"{self.path(t)} takes {len(args)} positional argument(s); the pattern passes"
                          f" {len(pattern_args)}")
        for index, (want, got) in enumerate(zip(pattern_args, args)):
            self.argument(p, want, got, t=t, which=index)

    def argument(self, p: Node, want: Any, got: Any, *, t: Node, which: int | str) -> None:
        if isinstance(want, Node):
            if want.op == "placeholder":
                if not isinstance(got, Node):
                    raise _Failed(f"argument {which} of {self.path(t)} is the literal {got!r}; the pattern's input"
                                  f" {want.target} wants a computed value")
                name = str(want.target)
                bound = self.found.tensors.setdefault(name, got)
                if bound is not got:
                    raise _Failed(f"the pattern's input {name} is {self.path(bound)} and {self.path(got)}")
                return
            if not isinstance(got, Node):
                raise _Failed(f"argument {which} of {self.path(t)} is the literal {got!r}; the pattern computes it")
            self.node(want, got)
            return
        if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)) and len(want) == len(got):
            for w, g in zip(want, got):
                self.argument(p, w, g, t=t, which=which)
            return
        if self.lenient and not isinstance(got, Node):
            return
        if isinstance(got, Node) or type(want) is not type(got) or want != got:
            shown = self.path(got) if isinstance(got, Node) else repr(got)
            raise _Failed(f"literal differs: argument {which} of {self.path(t)} is {shown}; the pattern has {want!r}")


def _default_of(p: Node, key: str) -> tuple[Any, ...]:
    """``(default,)`` of keyword ``key`` of a pattern's Python function; ``()`` when it has none."""
    if p.op != "call_function":
        return ()
    try:
        parameter = inspect.signature(p.target).parameters.get(key)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ()
    return () if parameter is None or parameter.default is inspect.Parameter.empty else (parameter.default,)


def candidates(pattern: PatternGraph, module: GraphModule, *, node: Node | None = None) -> list[Node]:
    """The graph's nodes of the kind of the pattern's output (or of its ``node``): see the module
    docstring."""
    anchor = pattern.output if node is None else node
    if anchor.op == "call_module":
        return [n for n in module.graph.nodes if n.op == "call_module"]
    name = _pattern_op_name(anchor)
    return [n for n in module.graph.nodes if n.op == "call_function" and _graph_op_name(n) == name]


def _other_outputs(attempt: _Attempt, pattern: PatternGraph, module: GraphModule) -> None:
    """Bind the pattern's outputs after the first (see the module docstring)."""
    for index, p in enumerate(pattern.outputs[1:], start=1):
        if p in attempt.found.nodes:
            continue
        reason = "no node of its kind"
        for t in candidates(pattern, module, node=p):
            if t in attempt.taken:
                continue
            found, taken = attempt.found, set(attempt.taken)
            attempt.found = Match(found.graph, found.anchor, dict(found.nodes), dict(found.tensors),
                                  dict(found.modules))
            try:
                attempt.node(p, t)
                break
            except _Failed as failed:
                reason = f"{attempt.path(t)}: {failed.reason}"
                attempt.found, attempt.taken = found, taken
        else:
            raise _Failed(f"no node completes the match as the pattern's output {index} ({p.name}): {reason}")


def match_graph(pattern: PatternGraph, module: GraphModule, *, where: str, log: MatchLog,
                recorded: dict[str, Any] | None = None) -> list[Match]:
    """The non-overlapping matches of ``pattern`` in ``module``'s graph (at NodePath ``where``), in
    graph order; each candidate is logged (see the module docstring). A pattern traced from values
    is specialised per candidate (:mod:`.pattern_spec`; ``recorded``: the graph's recorded inputs,
    :func:`~.pass_inputs.recorded_inputs`, for the candidates' values)."""
    shown = where or "<root>"
    found: list[Match] = []
    consumed: dict[Node, str] = {}
    best: LogEntry | None = None
    size = sum(1 for n in pattern.graph.nodes if n.op not in ("placeholder", "output"))
    if pattern.specialiser is None:
        raise PatternError(f"the pattern {pattern.name} was not made by a Specialiser (see .pattern_spec)")
    search = pattern.specialiser.search(module, where=where, recorded=recorded)
    for node in search.candidates():
        attempt, reason = search.attempt(node)
        anchor = _path(where, node)
        if reason is None:
            try:
                _other_outputs(attempt, attempt.pattern, module)
                reason = (_leak(attempt, attempt.pattern) or _overlap(attempt, consumed)
                          or _order(attempt, attempt.pattern, module))
            except _Failed as failed:
                reason = failed.reason
        if reason is None:
            match = attempt.found
            match.anchor = anchor
            match.outputs = [match.nodes[p] for p in attempt.pattern.outputs]
            found.append(match)
            consumed.update((n, anchor) for n in match.nodes.values())
            log.add(LogEntry(pattern.name, shown, anchor, "MATCHED"))
            for unused in attempt.pattern.dropped:
                if unused not in pattern.dropped:  # unused in the pattern specialised for this candidate
                    log.add(LogEntry(pattern.name, shown, anchor, "DROPPED",
                                     f"input {unused} unused in the pattern specialised for {anchor}"))
            continue
        entry = LogEntry(pattern.name, shown, anchor, "REJECTED", reason, score=len(attempt.found.nodes))
        log.add(entry)
        if best is None or entry.score > best.score:
            best = entry
    if not found and best is not None:
        log.add(LogEntry(pattern.name, shown, best.anchor, "NEAR-MISS",
                         f"{best.score}/{size} pattern nodes matched; {best.reason}", best.score))
    return found


def _leak(attempt: _Attempt, pattern: PatternGraph) -> str | None:
    inside = set(attempt.found.nodes.values())
    outputs = set(pattern.outputs)
    for p, t in attempt.found.nodes.items():
        if p in outputs:
            continue
        for user in t.users:
            if user not in inside:
                return (f"the value of {attempt.path(t)} is also used by {attempt.path(user)}, outside the pattern; a"
                        " replacement would lose it")
    return None


def _order(attempt: _Attempt, pattern: PatternGraph, module: GraphModule) -> str | None:
    """(Several outputs) an input of the match computed after an outside user of an output."""
    if len(pattern.outputs) == 1:
        return None
    position = {node: index for index, node in enumerate(module.graph.nodes)}
    inside = set(attempt.found.nodes.values())
    users = [u for p in pattern.outputs for u in attempt.found.nodes[p].users if u not in inside]
    if not users:
        return None
    first = min(users, key=position.__getitem__)
    late = [t for t in attempt.found.tensors.values() if position[t] > position[first]]
    if late:
        return (f"the input {attempt.path(late[0])} is computed after {attempt.path(first)}, which uses an output of"
                " the match; one replacement cannot stand before that user")
    return None


def _overlap(attempt: _Attempt, consumed: dict[Node, str]) -> str | None:
    for t in attempt.found.nodes.values():
        if t in consumed:
            return f"overlaps the earlier match at {consumed[t]} (both use {attempt.path(t)})"
    return None
