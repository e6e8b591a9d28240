"""Replacing the matches of a pattern in one graph (the pass :func:`~nnbridge.surgery.replace_pattern`
runs on each graph in scope).

Per match, the replacement is traced with the matched module objects
(:func:`.pattern_graphs.trace_replacement`) and from the match's own values (fake values of the
graph, :class:`.pattern_spec.ValueTracer`): reading ``x.dtype``, ``x.shape[-1]`` or
``l0.weight.dtype`` gives the match's, and a branch on them takes the match's branch, as Dynamo
specialises. Its nodes go where the matched nodes were: a read of a matched module's parameter or
buffer becomes a ``get_attr`` of that very tensor (no copy: gradients reach the model's parameter), a call of a
matched module re-uses that module's call node (its name, child graph and op point stay), other
ops are new nodes (named by nnbridge's rules after the pass). The anchor's users then read the
replacement's value (for a pattern returning a tuple, each output's users read the replacement's
value at the same position), and the matched nodes no replacement call re-used are erased.
Example::

    rewriter = PatternPass(pattern, replacement, constants={}, log=log)
    rewriter.bind(owner=block, where="blocks_0")
    rewriter(graph_module)          # edits graph_module.graph in place
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import GraphModule, Node

from ..errors import PatternError
from .pattern_graphs import CONSTANT_KEY, TENSOR, PatternGraph, name_of, trace_replacement
from .pattern_log import MatchLog
from .pattern_match import Match, match_graph
from .pattern_spec import NO_VALUE, ValueTracer, graph_values


class PatternPass:
    """The pass replacing ``pattern``'s matches by ``replacement`` in one graph (see the module
    docstring); :meth:`bind` says whose graph it runs on next. ``matches``: those of the last run."""

    def __init__(self, pattern: PatternGraph, replacement: Any, *, constants: Mapping[str, Any], log: MatchLog):
        self.pattern, self.replacement, self.constants, self.log = pattern, replacement, dict(constants), log
        self.__name__ = f"replace_pattern({pattern.name})"
        self._owner: torch.nn.Module | None = None
        self._where = ""
        self._recorded: dict[str, Any] | None = None
        self.matches: list[Match] = []

    def bind(self, *, owner: torch.nn.Module, where: str, recorded: dict[str, Any] | None = None) -> None:
        """The next run edits a graph of ``owner`` at NodePath ``where`` (``recorded``: its inputs'
        recorded values, for a pattern specialised per candidate)."""
        self._owner, self._where, self._recorded = owner, where, recorded

    def __call__(self, graph_module: GraphModule) -> None:
        owner = self._owner
        if owner is None:
            raise PatternError(f"{self.__name__} ran on a graph whose module is unknown")
        self.matches = match_graph(self.pattern, graph_module, where=self._where, log=self.log,
                                   recorded=self._recorded)
        unvalued = [m for m in self.matches if m.mode is None]
        if unvalued:  # matched as traced: the graph's values once, for every match
            values, mode = graph_values(graph_module, recorded=self._recorded, where=self._where)
            for match in unvalued:
                match.values, match.mode = values, mode
        for match in self.matches:
            self._replace(graph_module, match, owner)

    @staticmethod
    def _tracer(match: Match, calls: Mapping[str, Node]) -> ValueTracer:
        """A tracer of the replacement from ``match``'s values (``calls``: ``{matched module path: its
        call node}``); an op failing on fake values leaves its value unknown (the pass's checks then
        run the replacement's graph and refuse what does not fit)."""
        values = match.values or {}
        return ValueTracer({name: values.get(node, NO_VALUE) for name, node in match.tensors.items()},
                           calls={f"owner.{path}": values.get(node, NO_VALUE) for path, node in calls.items()},
                           mode=match.mode, strict=False)

    def _replace(self, module: GraphModule, match: Match, owner: torch.nn.Module) -> None:
        values: dict[str, Any] = {name: TENSOR for name in match.tensors}
        values.update(self.constants)
        values.update((slot, owner.get_submodule(path)) for slot, path in match.modules.items())
        name = name_of(self.replacement)
        dropped = [d for d in self.pattern.dropped if d not in values]
        calls = {path: node for slot, path in match.modules.items() for p, node in match.nodes.items()
                 if p.op == "call_module" and p.target == slot}
        try:
            replacement = trace_replacement(self.replacement, values=values, owner=owner, name=name,
                                            tracer=self._tracer(match, calls))
        except PatternError as error:
            if dropped:
                raise PatternError(f"{error} (the pattern {self.pattern.name} left {dropped} unused, so they were"
                                   " dropped; a replacement cannot use them)") from error
            raise
        reused: set[Node] = set()
        env: dict[Node, Any] = {}

        def mapped(value: Any) -> Any:
            return torch.fx.node.map_arg(value, lambda n: env[n])

        graph = module.graph
        result: Any = None
        last: Node = insertion_point(module, match)
        made: set[Node] = set()
        for node in replacement.nodes:
            if node.op == "placeholder":
                env[node] = match.tensors[str(node.target)]
                continue
            if node.op == "output":
                result = mapped(node.args[0])
                continue
            if node.op == "get_attr" and CONSTANT_KEY in node.meta:
                new = self._constant(module, node.meta[CONSTANT_KEY], after=last)
            elif node.op == "get_attr":
                new = self._attribute(module, owner, str(node.target), after=last)
            elif node.op == "call_module":
                call = calls.get(str(node.target))
                if call is None or call in reused:
                    raise PatternError(
                        f"the replacement {name} calls {node.target!r}, which is not a module the match bound (or calls"
                        f" it twice); it may call each matched module ({sorted(match.modules)}) once, or use their"
                        " parameters.")
                reused.add(call)
                call.args, call.kwargs = mapped(node.args), mapped(node.kwargs)
                last.append(call)
                new = call
            else:
                with graph.inserting_after(last):
                    new = graph.create_node(node.op, node.target, mapped(node.args), mapped(node.kwargs))
            env[node] = last = new
            made.add(new)
        results = self._results(result, match, name=name)
        for output, value in zip(match.outputs, results):
            if value is output:
                continue
            if value not in reused and "val" in output.meta:
                value.meta["val"] = output.meta["val"]  # what the checks take where inputs were not rebuilt
            output.replace_all_uses_with(value, delete_user_cb=lambda user: user not in made)
        pending = [n for n in match.nodes.values() if n not in reused and n not in results]
        while pending:  # users first: the matched nodes have no user outside the match
            node = next(n for n in pending if not n.users)
            graph.erase_node(node)
            pending.remove(node)

    def _results(self, result: Any, match: Match, *, name: str) -> list[Node]:
        """The replacement's value(s), one per pattern output.

        Raises:
            PatternError: a value that is no computed node, or a tuple of another length than the
                pattern's (or a tuple where the pattern returns one value, or the reverse).
        """
        want = len(match.outputs)
        if self.pattern.returns_tuple:
            if not isinstance(result, (tuple, list)) or len(result) != want:
                got = f"a tuple of {len(result)}" if isinstance(result, (tuple, list)) else f"{result!r}"
                raise PatternError(f"the replacement {name} returns {got} at {match.anchor}, but the pattern"
                                   f" {self.pattern.name} returns a tuple of {want} values; return a tuple of {want}"
                                   " tensors, one per pattern output, in the same order.")
            values = list(result)
        else:
            values = [result]
        if not all(isinstance(v, Node) for v in values):
            raise PatternError(f"the replacement {name} must return {'tensors' if want > 1 else 'one tensor'} computed"
                               f" from its inputs; it returns {result!r} at {match.anchor}.")
        return values

    @staticmethod
    def _attribute(module: GraphModule, owner: torch.nn.Module, target: str, *, after: Node) -> Node:
        """A ``get_attr`` node (after ``after``) reading ``owner``'s tensor at ``target``, held by
        ``module`` under a flat name (the tensor itself, not a copy)."""
        value = owner.get_submodule(".".join(target.split(".")[:-1])) if "." in target else owner
        tensor = getattr(value, target.split(".")[-1])
        if not isinstance(tensor, torch.Tensor):
            raise PatternError(f"the replacement reads {target!r}, which is no tensor ({type(tensor).__name__}); read"
                               " the matched modules' parameters and buffers only.")
        flat = "pattern_" + target.replace(".", "_")
        existing = getattr(module, flat, None)
        if existing is None:
            module.register_buffer(flat, tensor, persistent=False)
        elif existing is not tensor:
            raise PatternError(f"the graph already holds another tensor as {flat!r}")
        with module.graph.inserting_after(after):
            return module.graph.get_attr(flat)

    @staticmethod
    def _constant(module: GraphModule, tensor: torch.Tensor, *, after: Node) -> Node:
        """A ``get_attr`` node (after ``after``) reading ``tensor``, a tensor the replacement made,
        held by ``module`` as a constant (``pattern_constant_<n>``, not in any state_dict)."""
        name = _constant_name(module)
        module.register_buffer(name, tensor, persistent=False)
        with module.graph.inserting_after(after):
            return module.graph.get_attr(name)


def _constant_name(module: GraphModule) -> str:
    number = 0
    while hasattr(module, f"pattern_constant_{number}"):
        number += 1
    return f"pattern_constant_{number}"


def insertion_point(module: GraphModule, match: Match) -> Node:
    """The node the replacement's nodes go after, in order: before the anchor (which may be
    re-used); for several outputs, before the first outside user of any of them (the matcher
    checked that the match's inputs come before it)."""
    if len(match.outputs) == 1:
        return match.anchor_node.prev
    inside = set(match.nodes.values())
    position = {node: index for index, node in enumerate(module.graph.nodes)}
    users = [u for output in match.outputs for u in output.users if u not in inside]
    if not users:
        return max(match.outputs, key=position.__getitem__)
    return min(users, key=position.__getitem__).prev
