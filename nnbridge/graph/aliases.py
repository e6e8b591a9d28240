"""Variable-name aliases: graphpatch's node names, derived from the source line of each node.

graphpatch (through Dynamo) named a node after the local variable its value was first assigned
to, numbered on reuse within the graph: GPT-2's ``attn_weights``, ``attn_weights_1``, ...;
``query_states``. nnbridge's canonical node names are ATen op names (``softmax``, ``transpose_4``);
an *alias* is a second name for one of those nodes, accepted wherever a NodePath is (``pg.patch``,
``in``, ``pg.graph[...]``, attribute access) and shown next to the canonical name in ``pg.graph``.

The pass (:func:`compute_aliases`, cached per graph by :func:`aliases_of`) reads only
``node.meta["stack_trace"]`` (recorded by ``torch.export``, with helper-function frames, see
:mod:`nnbridge.compat.torch.stack_traces`):

- a *line execution* is a maximal run of consecutive nodes whose stack traces share the same
  frames down to one frame (the nodes of deeper helper calls made on that line belong to it);
- when that frame's source line assigns one name (``x = ...``, ``x: T = ...``), the alias goes to
  the run's last node, the value the line produced; when it unpacks into names (``a, b = ...``)
  and the run ends with one ``getitem`` per name of one value, each name goes to its element;
- a node keeps the first alias it gets, counting from the innermost line (Dynamo renamed a value
  on its first store: ``y = helper(x)`` names the op inside ``helper`` only when ``helper`` did not
  assign it to a local first);
- aliases are numbered per graph in the order the assignments complete: ``x``, ``x_1``, ``x_2``.

Not aliased (documented limits): augmented assignments (``x += y``: an in-place op, Dynamo kept
the old name), attribute/subscript targets (``self.x = ...``, ``d[k] = ...``), assignments whose
value is a submodule call (the child's graph has its own names), repeated executions of one line
in a loop (one run: only the last value gets the alias). An alias never shadows a canonical
name, a child module or a ``forward()`` argument of the module; when two assignments would yield
the same alias (``x_1`` from the second ``x`` and a variable named ``x_1``) neither is created.
Numbers are still consumed by aliases not created, so the others keep Dynamo's numbers.
Extractions whose stack traces were recorded without helper frames (disk-cache entries and
``pg.save`` files that lack them) get aliases from ``forward`` lines only.
Example::

    aliases_of(attention_graph)   # {"query_states": "getitem", ..., "attn_weights_2": "softmax"}
"""

from __future__ import annotations

import difflib
import inspect
import operator
import os
import re
from collections import Counter
from collections.abc import Iterable

from torch.fx import Node

from .graph_module import CompiledGraphModule, GraphModuleBase
from .metadata import node_meta

_NAME = r"[A-Za-z_]\w*"
#: the start of a frame header in nnbridge's own code (the wrappers export traces modules through)
_NNBRIDGE_FRAME = f'File "{os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")}'
#: ``x = ...``, ``x: T = ...``, ``a, b = ...`` (not ``==``, not ``x += ...``, not ``self.x = ...``)
_ASSIGNMENT = re.compile(rf"\s*(?P<targets>{_NAME}(?:\s*,\s*{_NAME})*\s*,?)\s*(?::[^=]+)?=(?!=)")


def assigned_names(source_line: str) -> tuple[str, ...]:
    """The names a statement's first line assigns: ``("x",)`` for ``x = f(y)``, ``("a", "b")`` for
    ``a, b = g(`` ; ``()`` for anything else (augmented assignments, attribute or subscript
    targets, expressions, ``return``)."""
    match = _ASSIGNMENT.match(source_line)
    if match is None:
        return ()
    return tuple(name.strip() for name in match.group("targets").split(",") if name.strip())


def stack_frames(stack_trace: str | None) -> list[str]:
    """A node's ``stack_trace`` split into frames (``File ..., line N, in f`` plus its source
    lines, each right-stripped), outermost first; ``[]`` for none."""
    frames: list[list[str]] = []
    for line in (stack_trace or "").rstrip().splitlines():
        if line.lstrip().startswith("File ") or not frames:
            frames.append([])
        frames[-1].append(line.rstrip())
    return ["\n".join(frame) for frame in frames]


def _source_line(frame: str) -> str:
    lines = frame.splitlines()
    return lines[1].strip() if len(lines) > 1 else ""


def _element_targets(run: list[Node], count: int) -> list[Node] | None:
    """For ``a, b, c = value``: the run's trailing ``getitem`` nodes of one value, by index (None
    when the run does not end with exactly one ``getitem`` per name)."""
    tail = run[-count:] if len(run) >= count else []
    if not tail or any(n.op != "call_function" or n.target is not operator.getitem for n in tail):
        return None
    sources = {n.args[0] for n in tail}
    indices = sorted((n.args[1], i) for i, n in enumerate(tail) if isinstance(n.args[1], int))
    if len(sources) != 1 or [index for index, _ in indices] != list(range(count)):
        return None
    return [tail[i] for _, i in indices]


def _forward_depth(frames: list[str]) -> int:
    """How many frames lead down to the innermost ``forward`` (helper-function frames below it
    not counted)."""
    return 1 + max((i for i, frame in enumerate(frames) if frame.splitlines()[0].endswith(" in forward")),
                   default=len(frames) - 1)


def compute_aliases(nodes: Iterable[tuple[str, Node, list[str]]], aliasable: set[Node],
                    reserved: set[str]) -> dict[str, str]:
    """``{alias: canonical node name}`` for a graph's nodes (see the module docstring).

    Args:
        nodes: ``(canonical name, node, frames)`` of every node of the graph, in graph order, with
            the frames of its stack trace (for a submodule call, the frames down to the calling
            line); nodes without frames take no part.
        aliasable: the nodes an alias may name (ops with an op point).
        reserved: names an alias may not take (every canonical name of the graph, child module
            names, ``forward()`` argument names).
    """
    # nodes torch made up (runtime asserts: a frame without a source line) belong to no line
    traced = [(name, node, frames) for name, node, frames in nodes if frames and _source_line(frames[-1])]
    names = {node: name for name, node, _ in traced}
    # the graph's own forward frame: the callers' frames above it are not this graph's lines
    own = min((_forward_depth(frames) for _, _, frames in traced), default=1)
    # line executions in the order their assignments complete (innermost first): (names, run)
    stores: list[tuple[tuple[str, ...], list[Node]]] = []
    open_runs: list[tuple[str, list[Node]]] = []  # one per depth: (frame, nodes)

    def close(keep: int) -> None:
        while len(open_runs) > keep:
            frame, run = open_runs.pop()
            stores.append((assigned_names(_source_line(frame)), run))

    for _, node, all_frames in traced:
        frames = all_frames[own - 1:]
        common = 0
        while common < min(len(open_runs), len(frames)) and open_runs[common][0] == frames[common]:
            common += 1
        close(common)
        open_runs.extend((frame, []) for frame in frames[common:])
        for _, run in open_runs:
            run.append(node)
    close(0)
    named: set[Node] = set()
    counts: Counter[str] = Counter()
    candidates: dict[str, list[str]] = {}
    for targets, run in stores:
        if not targets:
            continue
        values = [run[-1]] if len(targets) == 1 else _element_targets(run, len(targets))
        if values is None:
            continue
        for target, value in zip(targets, values):
            if value in named or value not in aliasable:
                continue
            named.add(value)
            alias = target if counts[target] == 0 else f"{target}_{counts[target]}"
            counts[target] += 1
            candidates.setdefault(alias, []).append(names[value])
    return {alias: targets[0] for alias, targets in candidates.items()
            if len(targets) == 1 and alias not in reserved}


def _first_frames(graph: GraphModuleBase) -> list[str]:
    """The frames of the first op traced in ``graph`` or its children ([] for none, opaque graphs)."""
    if not isinstance(graph, CompiledGraphModule):
        return []
    for node in graph.graph.nodes:
        frames = stack_frames(node.meta.get("stack_trace"))
        if node.op != "call_module" and frames and _source_line(frames[-1]):
            return frames
        if node.op == "call_module":
            found = _first_frames(graph.child_graph(node))
            if found:
                return found
    return []


def _call_frames(graph: CompiledGraphModule, node: Node) -> list[str]:
    """A submodule call's frames down to the calling line: a child op's frames above the child's
    own ``forward``, without nnbridge's own wrapper frames."""
    child_frames = _first_frames(graph.child_graph(node))
    caller = child_frames[:_forward_depth(child_frames) - 1] if child_frames else []
    while caller and _NNBRIDGE_FRAME in caller[-1].splitlines()[0]:
        caller.pop()
    return caller


def aliases_of(graph: CompiledGraphModule) -> dict[str, str]:
    """``{alias: canonical node name}`` of a compiled graph, computed once and kept in its
    :class:`~.metadata.GraphMeta` ``aliases``."""
    meta = graph.graph_meta
    if meta.aliases is None:
        points = set(graph.point_names)
        nodes = [(name, node, _call_frames(graph, node) if node.op == "call_module"
                  else stack_frames(node.meta.get("stack_trace"))) for name, node in graph.named_nodes()]
        aliasable = {node for name, node, _ in nodes
                     if name in points and node.op in ("call_function", "call_method") and not node_meta(node).routed}
        reserved = {name for name, _, _ in nodes}
        try:
            reserved |= set(inspect.signature(graph.original_type.forward).parameters)
        except (TypeError, ValueError):
            pass
        meta.aliases = compute_aliases(nodes, aliasable, reserved)
    return meta.aliases


def aliases_by_node(graph: CompiledGraphModule) -> dict[str, str]:
    """``{canonical node name: alias}`` (the inverse of :func:`aliases_of`)."""
    return {name: alias for alias, name in aliases_of(graph).items()}


def looks_like_alias(segment: str) -> bool:
    """Whether a NodePath segment could be a variable alias (``attn_weights_3``, ``query_states``):
    a Python identifier."""
    return segment.isidentifier()


def suggestion(graph: object, segment: str, prefix: str) -> str:
    """A hint for an unknown ``segment`` in ``graph``: ``" Did you mean 'a.softmax' (alias
    attn_weights_2)?"`` when it is close to one of the graph's aliases; ``""`` otherwise (also for
    graphs without aliases). ``prefix`` is the graph's NodePath (``""`` for the root)."""
    if not isinstance(graph, CompiledGraphModule) or not looks_like_alias(segment):
        return ""
    aliases = aliases_of(graph)
    close = difflib.get_close_matches(segment, list(aliases), n=3, cutoff=0.6)
    if not close:
        return ""
    shown = ", ".join(f"{(f'{prefix}.{aliases[a]}' if prefix else aliases[a])!r} (alias {a})" for a in close)
    return f" Did you mean {shown}?"
