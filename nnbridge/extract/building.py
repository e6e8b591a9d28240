"""Building graph modules from the unflattened export: one per submodule invocation.

:class:`GraphBuilder` walks the unflattened program top-down: each invocation's graph is cleaned
and named (:mod:`.cleanup`), threads module state (:mod:`.state_graphs`), gets its children
(graphs, opaque modules, custom graphs, multiply invoked containers) and becomes a
:class:`~.graph_module.CompiledGraphModule` over the original module's own tensors. A reused
sibling layer's graphs are copies of its representative's built graphs (:class:`BuiltTemplate`,
:meth:`GraphBuilder.from_template`). Example::

    root = GraphBuilder(ctx, unflattened, stubs, calls, states, traced).build("", model, holder, 0)
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch.fx import Graph, Node

from .assembly import original_path, persistent, renamed_template, resolve_attr, retype_containers
from .naming import name_nodes
from .cleanup import (clean_graph, drop_unused_extras, input_prologue, remove_dead_code,
                      restore_constant_outputs)
from .context import ExtractionContext, describe_failure
from .custom_functions import CUSTOM_FIX, CustomFunctionFailed, custom_graph
from ..graph.graph_module import CompiledGraphModule, GraphModuleBase, OpaqueGraphModule
from ..graph.kinds import StubKind
from ..graph.metadata import node_meta, update_node_meta
from ..graph.module_tree import safe_name
from .opaque import opaque_module
from .recording import record_calls
from .reuse_plan import ReuseFallback, ReusePlan
from .sibling_graphs import ReusedHolder, copy_graph, placeholder_signature
from .cache_rebinding import rebind_cache_state
from ..graph.node_path import ROOT_PATH, ModulePath
from ..graph.state import Key, UntouchedLayers
from .cache_widening import widen_narrowed_calls
from .state_graphs import (argument_objects, drop_unused_reads, forward_state_objects, read_states_back,
                           write_states_back)
from .unused import keep_unused, registration_order
from ..compat.torch.export import invocation_graphs
from ..compat.torch.pytree import pytree
from ..errors import ExtractionError


_LIFTED = re.compile(r"lifted_tensor_(\d+)")


def _number(name: str) -> int:
    return int(name.rpartition("_")[2])


@dataclass(frozen=True)
class TemplateCall:
    """One submodule call of a representative's built graph (see :class:`BuiltTemplate`).

    Attributes:
        attribute: the call's target in the built graph (``self_attn``; ``linear.1`` for the
            second of several calls).
        target: the callee's path from the caller (``self_attn``).
        invocation: which invocation of the callee it is.
        trimmed: the call's leading extra arguments were dropped (the callee takes exactly its
            ``forward``'s arguments).
        position: the call node's index in the built graph (None: dead code, removed).
    """

    attribute: str
    target: str
    invocation: int
    trimmed: bool
    position: int | None = None


@dataclass(frozen=True)
class BuiltTemplate:
    """A representative's built graph, kept to build its siblings' graphs from
    (:meth:`GraphBuilder.from_template`).

    Attributes:
        graph: a copy of the graph as built, before its graph module was made.
        attrs: ``{get_attr target: value}`` extraction gave the graph's attributes (tree specs,
            lifted constants; a module's own tensors are resolved on each sibling instead).
        calls: the submodule calls, in build order (dead ones too: their graphs were built).
        multi: the call targets called several times (built as per-invocation lists).
        exact_signature: the graph takes exactly the module's ``forward`` arguments.
    """

    graph: Graph
    attrs: dict[str, Any]
    calls: tuple[TemplateCall, ...]
    multi: frozenset[str]
    exact_signature: bool

    def fits(self, builder: GraphBuilder, fqn: ModulePath, source: ModulePath, *, invocation: int) -> bool:
        """Whether sibling ``fqn``'s invocation threads the same state keys as its representative
        ``source``'s (through itself and each of its calls): only then is its built graph the
        representative's."""
        return all(builder.state_keys(ModulePath(f"{fqn}{sub}"), k)
                   == builder.state_keys(ModulePath(f"{source}{sub}"), k)
                   for sub, k in [("", invocation), *((f".{c.target}", c.invocation) for c in self.calls)])


class GraphBuilder:
    """Builds the mirror hierarchy from an unflattened export."""

    def __init__(self, ctx: ExtractionContext, unflattened: torch.nn.Module, stubs: dict[str, str], *,
                 calls: dict[str, list],
                 input_spec: pytree.TreeSpec | None = None, states: dict[str, list[list[Key]]] | None = None,
                 constants: dict[tuple[str, int], dict[int, Any]] | None = None,
                 example: tuple[tuple[Any, ...], dict[str, Any]] = ((), {}), reuse: ReusePlan | None = None,
                 untouched: dict[str, list[UntouchedLayers | None]] | None = None):
        self.ctx, self.unflattened, self.stubs, self.calls = ctx, unflattened, stubs, calls
        self.input_spec = input_spec
        self.states = states or {}
        self.untouched = untouched or {}  # {path: [cache layers untouched per invocation]}, see .state
        self.constants = constants or {}  # {(program path, invocation): {output leaf: value}}
        self.example = example  # the extracted call of the root (to record a fallback's calls)
        self.numbers: dict[Node, int] = {}  # {submodule call: its invocation}, see number_calls
        self.reuse = reuse or ReusePlan()
        # {(representative subtree path, invocation): (unflattened holder, pristine graph copy, its call numbers)}
        self.pristine: dict[tuple[str, int], tuple[Any, Graph, dict[Node, int]]] = {}
        # {sibling: {representative's lifted constant: (the sibling's name for it, its value)}}
        self.lifted: dict[str, dict[str, tuple[str, Any]]] = {}
        # {(representative subtree path, invocation): its built graph}, to build siblings from
        self.templates: dict[tuple[str, int], BuiltTemplate] = {}
        # keep every graph's template, the root's included: the module is a representative whose
        # sibling roots build theirs from them (see .sibling_roots and :meth:`from_shared`)
        self.keep_all = False
        # {(path, invocation): built graph} of a representative root, when this builder builds one
        # of its sibling roots (see :meth:`from_shared`)
        self.shared: dict[tuple[str, int], BuiltTemplate] | None = None

    def invocations(self, fqn: ModulePath) -> list[Any]:
        """The holders of submodule ``fqn``'s invocation graphs (unflattened modules), in call order."""
        return invocation_graphs(self.unflattened.get_submodule(f"model.{fqn}"))

    def number_calls(self, holder: Any) -> None:
        """Number every submodule call of the unflattened graphs, from the root graph ``holder``
        down, before any graph is built: invocation ``k`` of a module is its ``k``-th call in
        the program, also when an earlier caller's graph is dead code or fell back to opaque
        half-built (a running count while building would then hand later calls the wrong graph).
        Stubbed modules' children are not numbered (they are extracted separately)."""
        counts: Counter[str] = Counter()

        def walk(fqn: ModulePath, graph_holder: torch.nn.Module) -> None:
            graph = cast(Graph, graph_holder.graph)  # an unflattened InterpreterModule's graph
            for node in graph.nodes:
                if node.op != "call_module":
                    continue
                child_fqn = ModulePath(f"{fqn}.{node.target}" if fqn else str(node.target))
                self.numbers[node] = invocation = counts[child_fqn]
                counts[child_fqn] += 1
                if child_fqn not in self.stubs:
                    walk(child_fqn, self.invocations(child_fqn)[invocation])
        try:
            walk(ROOT_PATH, holder)
        except Exception:  # noqa: BLE001 - an unexpected structure: count while building instead
            self.numbers.clear()
        self.keep_pristine()

    def keep_pristine(self) -> None:
        """Copy every graph of the representatives' subtrees before building changes them: each
        sibling builds its own copy (see :mod:`.reuse_plan`)."""
        reps = self.reuse.representatives()
        if not reps:
            return
        for fqn, sub in self.unflattened.named_modules(remove_duplicate=False):
            path = fqn.removeprefix("model.")
            if not fqn.startswith("model.") or not any(path == r or path.startswith(f"{r}.") for r in reps):
                continue
            if path in self.pristine_paths():
                continue
            for invocation, holder in enumerate(invocation_graphs(sub)):
                graph = getattr(holder, "graph", None)
                if isinstance(graph, Graph):
                    copied, numbers = copy_graph(graph, self.numbers)
                    self.pristine[(path, invocation)] = (holder, copied, numbers)

    def pristine_paths(self) -> set[str]:
        return {path for path, _ in self.pristine}

    def pristine_graph(self, fqn: ModulePath, source: ModulePath,
                       invocation: int) -> tuple[Any, Graph, dict[Node, int]]:
        """``(unflattened holder, pristine graph copy, its call numbers)`` of invocation
        ``invocation`` of representative ``source`` (see :meth:`keep_pristine`).

        Raises:
            ReuseFallback: there is none (sibling ``fqn`` cannot be built from it)."""
        entry = self.pristine.get((source, invocation))
        if entry is None:
            raise ReuseFallback(f"no graph of '{source}' to build '{fqn}' from")
        return entry

    def sibling_extras(self, fqn: ModulePath, source: ModulePath, invocation: int) -> int:
        """How many leading extra inputs the representative's graph has that the sibling's call
        lacks (0 below a sibling's root).

        Raises:
            ReuseFallback: the sibling's call passes other inputs than its representative's."""
        _, graph, _ = self.pristine_graph(fqn, source, invocation)
        if fqn not in self.reuse.siblings:
            return 0
        # the sibling's own call must pass what the graph expects
        stub = self.invocations(fqn)[invocation]
        mine, theirs = placeholder_signature(cast(Graph, stub.graph)), placeholder_signature(graph)
        # the representative's leading extra inputs (a tensor unflatten passes for a symbolic
        # size) must be unused once built (see child)
        # (the sibling's own leading extras, e.g. for a size its stub unified, are dropped by
        # its caller, as the built graph takes exactly its module's arguments)
        extras = len(theirs) - len(mine)
        if theirs[max(extras, 0):] != mine[max(-extras, 0):]:
            raise ReuseFallback(f"'{fqn}' is called with other inputs than '{source}': {mine} vs {theirs}")
        return extras

    def reused_holder(self, fqn: ModulePath, source: ModulePath, invocation: int) -> ReusedHolder:
        """A sibling's invocation module: a fresh copy of its representative's pristine graph
        (:class:`~.sibling_graphs.ReusedHolder`); the copy's calls keep the representative's numbers."""
        holder, graph, numbers = self.pristine_graph(fqn, source, invocation)
        copied, copied_numbers = copy_graph(graph, numbers)
        self.numbers.update(copied_numbers)
        return ReusedHolder(copied, holder)

    def own_constants(self, fqn: ModulePath, graph: Graph, attrs: dict[str, Any]) -> None:
        """Give a reused graph the sibling's own lifted constants (the empty tensors a cache
        layer starts from), under the names a full extraction gives them: export numbers them
        per program (``lifted_tensor_2``), and the sibling's stub created its own, in the same
        order as its representative. Names stay the representative's when the counts differ, and a
        constant the stub did not make is a copy of the representative's."""
        sibling = self.reuse.sibling_of(fqn)
        if sibling is None:
            return
        if sibling not in self.lifted:
            rep = self.reuse.siblings[sibling]
            theirs = sorted({str(n.target) for (path, _), (_, g, _) in self.pristine.items()
                             if path == rep or path.startswith(f"{rep}.") for n in g.nodes
                             if n.op == "get_attr" and _LIFTED.fullmatch(str(n.target))}, key=_number)
            stub = self.invocations(sibling)[0]
            mine = sorted({str(n.target) for n in cast(Graph, stub.graph).nodes
                           if n.op == "get_attr" and _LIFTED.fullmatch(str(n.target))}, key=_number)
            self.lifted[sibling] = ({t: (m, resolve_attr(stub, m)) for t, m in zip(theirs, mine)}
                                   if len(theirs) == len(mine) else {})
        renames = self.lifted[sibling]
        for node in graph.nodes:
            if node.op == "get_attr" and str(node.target) in renames:
                name, value = renames[str(node.target)]
                del attrs[str(node.target)]
                node.target, attrs[name] = name, value
            elif node.op == "get_attr" and _LIFTED.fullmatch(str(node.target)) \
                    and isinstance(attrs.get(str(node.target)), torch.Tensor):
                # a constant the sibling's stub did not make (its cache update ran untraced, see
                # .sibling_stubs): a copy of the representative's, as a full extraction has its own
                attrs[str(node.target)] = attrs[str(node.target)].clone()

    def untouched_layers(self, fqn: ModulePath, invocation: int) -> UntouchedLayers | None:
        """The cache layers export recorded as untouched by this invocation's code (None: unknown)."""
        recorded = self.untouched.get(fqn, [])
        return recorded[invocation] if invocation < len(recorded) else None

    def state_keys(self, fqn: ModulePath, invocation: int) -> list[Key]:
        """The state keys export recorded for this invocation ([] when it had no stateful argument)."""
        recorded = self.states.get(fqn)
        if recorded is None:  # a reused sibling's submodule, never traced: its representative's
            recorded = self.states.get(self.reuse.source(fqn), [])
        return recorded[invocation] if invocation < len(recorded) else []

    def child(self, fqn: ModulePath, module: torch.nn.Module, invocation: int) -> torch.nn.Module:
        """Invocation ``invocation`` of submodule ``fqn``: its graph, or an opaque module when it
        is stubbed, or when building its graph raises and ``error_on_compilation_failure`` is off
        (as graphpatch, any failure while compiling a module falls back to opaque).

        Raises:
            ExtractionError: building failed and ``error_on_compilation_failure`` is set; or a
                custom extraction function returned a malformed graph (always loud).
        """
        if fqn in self.stubs:
            if self.stubs[fqn] == StubKind.CUSTOM:
                return self.custom(fqn, module, invocation)
            return self.opaque(fqn, module, invocation, reason=self.stubs[fqn])
        try:
            source = self.reuse.source(fqn)
            if source != fqn:
                extras = self.sibling_extras(fqn, source, invocation)
                built = self.templates.get((source, invocation))
                if built is not None and built.fits(self, fqn, source, invocation=invocation):
                    cgm = self.from_template(built, fqn, module, invocation=invocation, source=source)
                else:
                    cgm = self.build(fqn, module, self.reused_holder(fqn, source, invocation), invocation=invocation,
                                     source=source)
                if extras and not cgm.graph_meta.exact_signature:
                    raise ReuseFallback(f"'{source}' and '{fqn}' are passed {abs(extras)} different value(s) by"
                                        " their callers")
                sibling = self.reuse.sibling_of(fqn)
                if sibling in self.reuse.caches:
                    rebinding = self.reuse.caches[sibling]
                    rebind_cache_state(cgm, rebinding, fqn)
                    # the representative's untouched layers, and the one its layer index selected;
                    # the sibling's own is untouched as the representative's own was
                    untouched = self.untouched_layers(source, invocation)
                    if untouched is not None:
                        cgm.graph_meta.untouched = rebinding.untouched(untouched)
                if fqn in self.reuse.siblings:
                    cgm.graph_meta.reused_from = self.ctx.full(source)
                return cgm
            if self.shared is not None:
                return self.from_template(self.shared_template(fqn, invocation), fqn, module, invocation=invocation,
                                          source=fqn)
            graphs = self.invocations(fqn)
            return self.build(fqn, module, graphs[invocation], invocation=invocation)
        except (ExtractionError, ReuseFallback):
            raise  # deliberate and loud (a malformed custom graph; a failure under the error option)
        except Exception as error:  # noqa: BLE001 - any other failure means fallback (or a loud error)
            if self.state_keys(fqn, invocation):  # an opaque module cannot hand its cache state back
                raise
            reason = f"building its graph failed: {describe_failure(error)}"
            self.ctx.fail(fqn, reason, error)
            return self.opaque(fqn, module, invocation, reason=reason)

    def recorded_call(self, fqn: ModulePath, invocation: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of invocation ``invocation`` of ``fqn`` in the extracted call."""
        if fqn not in self.calls:
            self.calls.update(record_calls(self.ctx.module, {fqn}, self.example[0], kwargs=self.example[1]))
        recorded = self.calls.get(fqn, [])
        args, kwargs, _ = recorded[min(invocation, len(recorded) - 1)]
        return args, kwargs

    def opaque(self, fqn: ModulePath, module: torch.nn.Module, invocation: int, *, reason: str) -> OpaqueGraphModule:
        args, kwargs = self.recorded_call(fqn, invocation)
        return opaque_module(self.ctx, fqn, module, args=args, kwargs=kwargs, reason=reason)

    def custom(self, fqn: ModulePath, module: torch.nn.Module, invocation: int) -> torch.nn.Module:
        """The graph of a custom extraction function; opaque when the function raises (as
        graphpatch's ``custom_extraction_functions``), per the warn/error options."""
        try:
            return custom_graph(self.ctx, fqn, module)
        except CustomFunctionFailed as failed:
            reason = f"its custom extraction function failed: {describe_failure(failed.error)}"
            self.ctx.fail(fqn, reason, failed.error, fix=CUSTOM_FIX)
            return self.opaque(fqn, module, invocation, reason=reason)

    def build(self, fqn: ModulePath, module: torch.nn.Module, holder: Any,
              *, invocation: int = 0, source: ModulePath | None = None) -> CompiledGraphModule:
        """``fqn``'s graph module from ``holder``'s graph (an unflattened InterpreterModule's, or
        a :class:`~.sibling_graphs.ReusedHolder`'s copy of representative ``source``'s)."""
        source = fqn if source is None else source
        graph = cast(Graph, holder.graph)
        attrs = {str(n.target): resolve_attr(holder, str(n.target)) for n in graph.nodes if n.op == "get_attr"}
        if source != fqn:
            self.own_constants(fqn, graph, attrs)
        restore_constant_outputs(graph, self.constants.get((f"model.{source}" if source else "model", invocation), {}))
        keys = self.state_keys(fqn, invocation)
        if keys:
            write_states_back(graph, attrs, keys, path=self.ctx.full(fqn))
        arguments = argument_objects(graph, attrs)
        if fqn == "" and self.input_spec is not None:
            prologue = input_prologue(graph)
            if prologue is not None:
                spec = cast(Node, prologue.args[1])  # tree_flatten_spec(inputs, get_attr(_spec_N))
                target = str(spec.target)
                attrs[target] = self.input_spec
                setattr(holder, target, self.input_spec)
        extras = clean_graph(graph, attrs)
        widen_narrowed_calls(graph, attrs)
        calls = [n for n in graph.nodes if n.op == "call_module"]
        per_target = Counter(str(n.target) for n in calls)
        local: Counter[str] = Counter()
        children: list[tuple[str, torch.nn.Module]] = []
        made: list[tuple[Node, TemplateCall]] = []
        call_names: dict[Node, str] = {}
        multi: set[str] = set()
        threaded: list[tuple[Node, list[Key], int]] = []
        for node in calls:
            target = str(node.target)
            child_fqn = ModulePath(f"{fqn}.{target}" if fqn else target)
            invocation_k = self.numbers[node] if node in self.numbers else self.ctx.invocations[child_fqn]
            self.ctx.invocations[child_fqn] = invocation_k + 1
            child = self.child(child_fqn, module.get_submodule(target), invocation_k)
            extra = node_meta(node).extra_args
            trimmed = not isinstance(child, GraphModuleBase) or child.graph_meta.exact_signature
            if trimmed:
                node.args, extra = node.args[extra:], 0
                update_node_meta(node, extra_args=0)
            if self.state_keys(child_fqn, invocation_k):  # recorded for modules export traced through
                read_states_back(graph, node, self.state_keys(child_fqn, invocation_k), extra=extra)
                threaded.append((node, self.state_keys(child_fqn, invocation_k), extra))
            first, *rest = target.split(".")
            safe_target = ".".join([safe_name(first), *rest])
            base = safe_target.replace(".", "_")
            if per_target[target] > 1:
                k = local[target]
                local[target] += 1
                node.target = f"{safe_target}.{k}"
                multi.add(safe_target)
                call_names[node] = f"{base}_{k}"
            else:
                node.target = safe_target
                call_names[node] = base
            children.append((str(node.target), child))
            made.append((node, TemplateCall(str(node.target), target, invocation_k, trimmed)))
            update_node_meta(node, module_path=original_path(self.ctx, module, target))
        forward_state_objects(graph, attrs, threaded, arguments=arguments)
        remove_dead_code(graph)
        drop_unused_reads(graph)
        exact_signature = drop_unused_extras(graph, extras)
        name_nodes(graph, type(module).forward, call_names)
        if source == fqn and (self.keep_all or self.reuse.covers(fqn)):  # a representative's subtree
            self.keep_template(fqn, invocation, graph, attrs=attrs, made=made, multi=multi,
                               exact_signature=exact_signature)
        root = self.graph_attributes(module, graph, attrs)
        return self.finish(fqn, module, graph, root=root, children=children, multi=multi,
                           exact_signature=exact_signature, invocation=invocation, source=source)

    def keep_template(self, fqn: ModulePath, invocation: int, graph: Graph, *, attrs: dict[str, Any],
                      made: list[tuple[Node, TemplateCall]], multi: set[str], exact_signature: bool) -> None:
        """Keep a copy of a representative's built graph (before its graph module exists, which a
        bridge then rewrites): the siblings' graphs are copies of it (see :meth:`from_template`)."""
        positions = {node: i for i, node in enumerate(graph.nodes)}
        calls = tuple(replace(call, position=positions.get(node)) for node, call in made)
        targets = {str(n.target) for n in graph.nodes if n.op == "get_attr"}
        self.templates[(fqn, invocation)] = BuiltTemplate(
            copy_graph(graph, {})[0], {t: attrs[t] for t in targets if t in attrs}, calls, frozenset(multi),
            exact_signature)

    def from_template(self, built: BuiltTemplate, fqn: ModulePath, module: torch.nn.Module, *, invocation: int,
                      source: ModulePath) -> CompiledGraphModule:
        """A sibling's graph module as :meth:`build` makes it from a copy of its representative's
        pristine graph, made from a copy of the representative's built graph instead: every step of
        :meth:`build` that reads only the graph, the module's class and the recorded state keys
        gave the representative's result already (the same graph, since the sibling's copy is the
        representative's); what is the sibling's own is redone here: its children (built from
        their own templates), their invocation counts and module paths, its lifted constants
        (:meth:`own_constants`) and its tensors, which costs less than building each sibling
        from a copy of the pristine graph.

        Raises:
            ReuseFallback: a child of the sibling takes its arguments otherwise than the
                representative's child (one is opaque, the other a graph, say).
        """
        graph, positions = copy_graph(built.graph, {node: i for i, node in enumerate(built.graph.nodes)
                                                    if node.op == "call_module"})
        at = {i: node for node, i in positions.items()}
        children: list[tuple[str, torch.nn.Module]] = []
        for call in built.calls:
            child_fqn = ModulePath(f"{fqn}.{call.target}" if fqn else call.target)
            self.ctx.invocations[child_fqn] = call.invocation + 1
            child = self.child(child_fqn, module.get_submodule(call.target), call.invocation)
            if call.trimmed != (not isinstance(child, GraphModuleBase) or child.graph_meta.exact_signature):
                raise ReuseFallback(f"'{child_fqn}' takes other arguments than '{source}.{call.target}'")
            children.append((call.attribute, child))
            if call.position is not None:
                update_node_meta(at[call.position], module_path=original_path(self.ctx, module, call.target))
        attrs = dict(built.attrs)
        self.own_constants(fqn, graph, attrs)
        root = self.graph_attributes(module, graph, attrs)
        return self.finish(fqn, module, graph, root=root, children=children, multi=set(built.multi),
                           exact_signature=built.exact_signature, invocation=invocation, source=source)

    def shared_template(self, fqn: ModulePath, invocation: int) -> BuiltTemplate:
        """The representative root's built graph of ``fqn``'s invocation (see :meth:`from_shared`).

        Raises:
            ReuseFallback: it kept none (a graph it built from another sibling's template)."""
        built = (self.shared or {}).get((fqn, invocation))
        if built is None:
            raise ReuseFallback(f"no built graph of '{fqn or '<root>'}' (invocation {invocation}) to build from")
        return built

    def from_shared(self, templates: dict[tuple[str, int], BuiltTemplate], module: torch.nn.Module
                    ) -> CompiledGraphModule:
        """A sibling root's graph hierarchy over ``module``, built from its representative root's
        built graphs (``templates``, kept by a builder with :attr:`keep_all`): every graph is
        :meth:`from_template`'s copy of the representative's, as a reused sibling layer's inside
        one export. The builder must have been given the representative's program record (state
        keys, untouched cache layers rebound to the sibling's, see
        :func:`.sibling_roots.untouched_rebound`); the caller rebinds the cache state. This costs
        less than copying the representative's unflattened graphs for each sibling root and
        building them again.

        Raises:
            ReuseFallback: a graph has no template, or a child takes its arguments otherwise than
                the representative's (see :meth:`from_template`)."""
        self.shared = templates
        return self.from_template(self.shared_template(ROOT_PATH, 0), ROOT_PATH, module, invocation=0, source=ROOT_PATH)

    @staticmethod
    def graph_attributes(module: torch.nn.Module, graph: Graph, attrs: dict[str, Any]) -> dict[str, Any]:
        """``{get_attr target: value}`` of a built graph: the module's own tensor (shared; never an
        op point a bridge registered), else the value extraction gave it (``attrs``)."""
        root: dict[str, Any] = {}
        for node in graph.nodes:
            if node.op == "get_attr":
                target = str(node.target)
                try:
                    value = resolve_attr(module, target)
                except AttributeError:
                    value = None
                root[target] = value if isinstance(value, torch.Tensor) else attrs[target]
        return root

    def finish(self, fqn: ModulePath, module: torch.nn.Module, graph: Graph, *, root: dict[str, Any],
               children: list[tuple[str, torch.nn.Module]], multi: set[str], exact_signature: bool,
               invocation: int, source: ModulePath) -> CompiledGraphModule:
        """The graph module of a built graph, with the original module's containers, buffers,
        unused parameters and registration order (and the user's postprocessing)."""
        cgm = CompiledGraphModule({**root, **dict(children)}, graph, type(module))
        cgm.graph_meta.exact_signature = exact_signature
        untouched = self.untouched_layers(fqn, invocation) if source == fqn else None  # (a reused sibling's: see child)
        if untouched is not None:
            cgm.graph_meta.untouched = untouched.paths
        retype_containers(cgm, [target for target, _ in children], renamed_template(module), multi=multi)
        for target, tensor in root.items():
            if isinstance(tensor, torch.Tensor) and not isinstance(tensor, torch.nn.Parameter):
                if not persistent(module, target):
                    *prefix, name = target.split(".")
                    cgm.get_submodule(".".join(prefix)).register_buffer(name, tensor, persistent=False)
        keep_unused(self.ctx, fqn, cgm, module=module)
        registration_order(cgm, module)
        if self.ctx.options.postprocessing_function is not None:
            self.ctx.options.postprocessing_function(cgm, module)
            cgm.recompile()
        return cgm
