"""The module kinds of an extracted hierarchy, as graphpatch named them.

- :class:`CompiledGraphModule`: a ``torch.fx.GraphModule`` holding one invocation's graph of a
  submodule; its parameters and buffers are the original module's own tensors.
- :class:`OpaqueGraphModule`: fallback that runs the original module's code; its inputs, output,
  parameters and buffers are patchable and its children are still extracted.
- :class:`MultiplyInvokedModule`: a ``ModuleList`` with one graph per invocation of a submodule
  that is called more than once (``linear_0``, ``linear_1`` in NodePaths).

Every kind keeps one :class:`~nnbridge.graph.op_point.OpPoint` per node, keyed by node name.
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol, cast

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.graph import PythonCode
from ..compat.torch.module_dicts import buffers_of, modules_of, parameters_of
from ..compat.torch.pytree import fx_pytree
from ..compat.torch.pytree import pytree

from ..compat import NoSubmoduleRecompile, forward_from_source, generated_code_released, keep_tracebacks
from ..compat.torch.fx import sources_compiled_once
from ..compat.accelerate import run_hooked
from ..compat.torch.fast_ops import bindings_fit, with_fast_ops
from .failures import register
from .metadata import GraphMeta, node_meta, node_name, update_node_meta
from .op_point import OpPoint, route


class Router(Protocol):
    """A callee that counts its calls within one run of an opaque module (implemented by
    :class:`nnbridge.extract.opaque.InvocationRouter`)."""

    def restart(self) -> None:
        """Count from the first invocation again (called before each run)."""
#: Calls that only convert between a custom pytree object and its leaves.
_PLUMBING_CALLS = (fx_pytree.tree_flatten_spec, pytree.tree_unflatten)


class GraphModuleBase(abc.ABC):
    """Op-point bookkeeping shared by :class:`CompiledGraphModule` and :class:`OpaqueGraphModule`.

    Op points are created on first use (most nodes of a large model are never listened to).

    Attributes:
        graph_meta: nnbridge's record of this graph (:class:`~.metadata.GraphMeta`).
        original_type: the class of the module this graph was extracted from.
        compiled: whether this is a :class:`CompiledGraphModule` (a class attribute: asked on every
            bridged call, cheaper than ``isinstance`` of this abstract class).
    """

    graph_meta: GraphMeta
    original_type: type[torch.nn.Module]
    compiled: ClassVar[bool]
    _point_names: list[str]
    _op_points: dict[str, OpPoint]
    _nnbridge_ops: types.SimpleNamespace
    _routed: frozenset[str]

    def _init_meta(self, original_type: type[torch.nn.Module]) -> None:
        self.__dict__["graph_meta"] = GraphMeta()
        self.__dict__["original_type"] = original_type
        self.__dict__["_routed"] = frozenset()

    def _set_points(self, names: list[str]) -> None:
        old = self.__dict__.get("_op_points", {})
        self.__dict__["_point_names"] = list(names)
        self.__dict__["_op_points"] = {n: old[n] for n in names if n in old}
        self.__dict__["_nnbridge_ops"] = types.SimpleNamespace(**self._op_points)

    def op_point(self, name: str) -> OpPoint:
        """The op point of node ``name``, created on first use. Raises ``KeyError``."""
        point = self._op_points.get(name)
        if point is None:
            if name not in self._point_names:
                raise KeyError(name)
            point = self._op_points[name] = OpPoint(self, name)
            setattr(self._nnbridge_ops, name, point)
        return point

    @property
    def point_names(self) -> list[str]:
        """Names of the nodes that have (or can have) an op point, in graph order."""
        return self.__dict__["_point_names"]

    @property
    def op_points(self) -> dict[str, OpPoint]:
        """``{node name: OpPoint}`` for every node, in graph order (creates them all)."""
        return {name: self.op_point(name) for name in self.point_names}

    def op_points_made(self) -> Iterable[OpPoint]:
        """The op points created so far (without creating the others): a live view, no copy (asked
        on every bridged call)."""
        return self._op_points.values()

    def named_op_points_made(self) -> dict[str, OpPoint]:
        """``{node name: op point}`` of the op points created so far (a copy)."""
        return dict(self._op_points)

    def share_point(self, name: str, point: OpPoint) -> None:
        """Use ``point`` (another graph's op point for the same node: another call structure of the
        same module) as this graph's op point ``name``, so listeners and hooks on it reach both."""
        if self._op_points.get(name) is point:
            return
        self._op_points[name] = point
        setattr(self._nnbridge_ops, name, point)
        point.add_owner(self)

    def example(self, name: str) -> Any:
        """The summary of node ``name``'s value on the example call (``torch.Size`` for a tensor,
        see :mod:`.summaries`); None when none was recorded."""
        self.examples_due()
        return self.graph_meta.examples.get(name)

    def set_examples(self, examples: dict[str, Any]) -> None:
        """Store ``{node name: summary}`` recorded on the example call."""
        self.examples_due()
        self.graph_meta.examples.update(examples)

    def recorded_examples(self) -> dict[str, Any]:
        """``{node name: summary}`` of every node with a recorded example."""
        self.examples_due()
        return dict(self.graph_meta.examples)

    def examples_due(self) -> None:
        """Compute the example summaries still owed to this graph (see :attr:`GraphMeta.examples_due`)."""
        due = self.graph_meta.examples_due
        if due is not None:
            due()

    @abc.abstractmethod
    def refresh_routing(self) -> None:
        """Route exactly the listened nodes through their op points."""


class CompiledGraphModule(GraphModuleBase, NoSubmoduleRecompile, GraphModule):
    """One invocation of a submodule as a ``torch.fx`` graph (graphpatch's CompiledGraphModule).

    Args:
        root: ``{qualified name: object}`` for every ``get_attr``/``call_module`` target: the original
            module's parameters and buffers (shared, never copied) and the child graph modules.
        graph: the cleaned graph; each node carries its :class:`~.metadata.NodeMeta`.
        original_type: the class of the module this graph was extracted from.
    """

    compiled = True
    _forward_cache: dict[frozenset[str], Callable[..., Any]]
    _trace_forward: Callable[..., Any]
    #: set by :meth:`read_tensors_from`: the module whose tensors ``get_attr`` nodes read at call time
    _nnbridge_module: torch.nn.Module
    #: set by :meth:`add_call_site`: ``{call_module target: callable}`` a bridge calls children through
    _call_sites: dict[str, Callable[..., Any]]

    def __init__(self, root: dict[str, Any], graph: Graph, original_type: type[torch.nn.Module]):
        super().__init__(root, graph, class_name="CompiledGraphModule")
        self._init_meta(original_type)
        self.__dict__["_forward_cache"] = {}
        self._reset_routing()

    # -- node names -----------------------------------------------------------------------------
    def named_nodes(self) -> Iterator[tuple[str, Node]]:
        """``(NodePath name, node)`` for every node in graph order."""
        for node in self.graph.nodes:
            yield node_name(node), node

    def node(self, name: str) -> Node:
        """The node named ``name`` (its NodePath name). Raises ``KeyError``."""
        for node_name, node in self.named_nodes():
            if node_name == name:
                return node
        raise KeyError(name)

    def child_graph(self, node: Node) -> CompiledGraphModule | OpaqueGraphModule:
        """The graph a ``call_module`` node runs (also after a bridge rewired the call site)."""
        linked = self.graph_meta.graph_children
        if linked is not None:
            return linked[node_name(node)]
        # a call_module node of an extracted graph calls a child graph
        return cast(CompiledGraphModule | OpaqueGraphModule, self.get_submodule(str(node.target)))

    def example(self, name: str) -> Any:
        """As :meth:`GraphModuleBase.example`; a compiled graph keeps summaries on its nodes."""
        self.examples_due()
        try:
            return node_meta(self.node(name)).example
        except KeyError:
            return None

    def set_examples(self, examples: dict[str, Any]) -> None:
        self.examples_due()
        for name, node in self.named_nodes():
            if name in examples:
                update_node_meta(node, example=examples[name])

    def recorded_examples(self) -> dict[str, Any]:
        self.examples_due()
        return {name: node_meta(node).example for name, node in self.named_nodes()
                if node_meta(node).example is not None}

    def read_tensors_from(self, module: torch.nn.Module) -> None:
        """Make ``get_attr`` targets ``_nnbridge_module.<name>`` read ``module``'s tensors at call
        time (an in-place bridge: the user may replace a parameter between calls). Kept in
        ``__dict__``: ``module`` must not become a child of this graph."""
        self.__dict__["_nnbridge_module"] = module

    def add_call_site(self, target: str, site: Callable[..., Any]) -> None:
        """Register ``site`` (a callable, not a module) as the ``call_module`` target ``target``
        (an in-place bridge calls the user's module there, which then runs its graph)."""
        self.__dict__.setdefault("_call_sites", {})[target] = site
        self.__dict__[target] = site

    def _plumbing(self, node: Node) -> bool:
        """A ``get_attr`` of something that is not a tensor (export's pytree specs), or a call that
        packs/unpacks a custom pytree (a ``Cache``) or writes a state back: not a value anyone
        patches, so it gets no op point."""
        if node.op == "call_function":
            return node.target in _PLUMBING_CALLS or getattr(node.target, "nnbridge_plumbing", False)
        if node.op != "get_attr":
            return False
        value: object = self
        for part in str(node.target).split("."):
            value = getattr(value, part, None)
        return not isinstance(value, torch.Tensor)

    # -- routing --------------------------------------------------------------------------------
    def recompile(self) -> PythonCode:
        """Regenerate the plain code from ``self.graph`` and re-apply routing (after graph edits).
        The generated source leaves fx's cache and ``linecache`` with the code.

        Inside :func:`code_generation_deferred` the code is generated later instead (returns None):
        on the module's first call, when ``code`` is read, or when the deferral ends.
        """
        if _deferred is not None:
            self._defer_code()
            return cast(PythonCode, None)
        return self._generate_code()

    def _generate_code(self) -> PythonCode:
        if _deferred is not None:
            _deferred.pop(id(self), None)
        with generated_code_released():
            code = super().recompile()
        keep_tracebacks(self)
        if "_forward_cache" in self.__dict__:
            self._reset_routing()
        return code

    def _defer_code(self) -> None:
        assert _deferred is not None
        _deferred[id(self)] = self
        type(self).forward = _generate_then_forward
        if "_forward_cache" in self.__dict__:  # no forward compiled from the graph before this edit may run
            self._reset_routing()

    def generate_pending_code(self) -> None:
        """Generate the code now if its generation is deferred (see :func:`code_generation_deferred`)."""
        if "_code" not in self.__dict__ or (_deferred is not None and id(self) in _deferred):
            self._generate_code()

    @property
    def code(self) -> str:
        """The generated Python code of ``self.graph`` (generated first if deferred)."""
        self.generate_pending_code()
        return super().code

    def _reset_routing(self) -> None:
        names = [name for name, node in self.named_nodes() if node.op != "call_module" and not self._plumbing(node)]
        self._set_points(names)
        self.__dict__.pop("_trace_forward", None)
        self._forward_cache.clear()
        self._forward_cache[frozenset()] = type(self).forward
        register(self, type(self).forward, self.graph, self)
        self.__dict__["_routed"] = frozenset()
        self.refresh_routing()

    def refresh_routing(self) -> None:
        """Switch to generated code that routes exactly the listened nodes through their op points."""
        routed = frozenset(name for name, point in self._op_points.items() if point.listened)
        if routed == self._routed:
            return
        forward = self._forward_cache.get(routed)
        if forward is None:
            forward = self._forward_cache[routed] = self._compile_routed(routed)
        type(self).forward = forward
        self.__dict__["_routed"] = routed

    def fast_forward(self) -> Callable[..., Any]:
        """The current routing's generated ``forward`` (takes ``self`` first) calling aten operators
        without ``OpOverload.__call__``, and the most common ones through their Python bindings when
        every call of the graph fits them (see :func:`~nnbridge.compat.torch.fast_ops.with_fast_ops`):
        what an in-place bridge runs outside Dynamo. Made once per generated function."""
        forward = type(self).forward
        made = self.__dict__.get("_fast_forward")
        if made is None or made[0] is not forward:
            fast = forward
            if isinstance(forward, types.FunctionType) and forward is not _generate_then_forward:
                fast = with_fast_ops(forward, bindings_fit((node.target, node.args, node.kwargs)
                                                           for node in self.graph.nodes if node.op == "call_function"))
            made = self.__dict__["_fast_forward"] = (forward, fast)
        return made[1]

    def trace_forward(self) -> Callable[..., Any]:
        """The generated code used while an nnsight trace runs: every node asks
        :func:`route` whether something listens (a patch, a hook, or a trace waiting at or
        caching the op's location) and only then passes through its op point. Compiled on first use."""
        forward = self.__dict__.get("_trace_forward")
        if forward is None:
            forward = self.__dict__["_trace_forward"] = self._compile_routed(frozenset(self.point_names), asking=True)
        return forward

    def _compile_routed(self, routed: frozenset[str], asking: bool = False) -> Callable[..., Any]:
        graph = Graph()
        val_map: dict[Node, Node] = {}
        output_value = graph.graph_copy(self.graph, val_map)
        output_node = graph.output(output_value)
        copies = {node_name(node): val_map[node] for node in self.graph.nodes
                  if node.op != "output"}
        last_placeholder = None
        for node in graph.nodes:
            if node.op == "placeholder":
                last_placeholder = node
        def through_point(value: Any) -> Node:
            if not asking:
                return graph.call_module(target, (value,))
            point = graph.get_attr(target)
            with graph.inserting_after(point):  # fx inserts each new node right after the anchor
                return graph.call_function(route, (point, value))

        for name in sorted(routed):
            target = f"_nnbridge_ops.{name}"
            if name == "output":
                with graph.inserting_before(output_node):
                    routed_value = through_point(output_node.args[0])
                update_node_meta(routed_value, name=name, routed=True)
                output_node.args = (routed_value,)
                continue
            node = copies[name]
            anchor = last_placeholder if node.op == "placeholder" else node
            with graph.inserting_after(anchor):
                routed_node = through_point(node)
            # a failure in a patch or hook names the op and its source line (see .failures)
            update_node_meta(routed_node, name=name, routed=True)
            routed_node.meta["stack_trace"] = node.meta.get("stack_trace")
            node.replace_all_uses_with(routed_node, delete_user_cb=lambda user: user is not routed_node)
        code = graph.python_code(root_module="self")
        forward = forward_from_source(code.src, code.globals)
        register(self, forward, graph, code)
        return forward


#: the graph modules whose code generation waits, inside :func:`code_generation_deferred`
#: (``{id: module}``); None outside it
_deferred: dict[int, CompiledGraphModule] | None = None


def _generate_then_forward(self: CompiledGraphModule, *args: Any, **kwargs: Any) -> Any:
    """A deferred graph module's ``forward``: generate its code (which replaces this forward), then run it."""
    self._generate_code()
    return type(self).forward(self, *args, **kwargs)


@contextlib.contextmanager
def code_generation_deferred() -> Iterator[None]:
    """Within: a :class:`CompiledGraphModule` built or recompiled generates its Python code when
    first needed (its first call, reading ``code``) or when the body ends, once, instead of at each
    ``recompile``. An in-place bridge rewrites every new graph right after extraction (call sites,
    live tensor reads) and recompiles it, so each graph's code would be generated twice, and fx's
    code generation is a sizeable share of ``bridge()`` (hundreds of graphs). On exit every graph
    still waiting generates its code, also when the body raised (then quietly: the body's error is
    the one raised). Re-entrant (an inner one leaves it to the outer one); used under nnbridge's
    call lock (:meth:`~.dispatcher.GraphDispatcher.add_extraction`), so the state is process-wide.
    """
    global _deferred
    if _deferred is not None:
        yield
        return
    _deferred = {}
    try:
        yield
    except BaseException:
        _generate_waiting(quiet=True)
        raise
    _generate_waiting(quiet=False)


def _generate_waiting(quiet: bool) -> None:
    global _deferred
    waiting = list((_deferred or {}).values())
    _deferred = None
    with sources_compiled_once():  # sibling layers' graphs generate the same code: compiled once
        for module in waiting:
            try:
                module._generate_code()
            except Exception:  # noqa: BLE001 - only while another error propagates
                if not quiet:
                    raise


class MultiplyInvokedModule(torch.nn.ModuleList):
    """One graph per invocation of a module called several times (graphpatch's MultiplyInvokedModule).

    The parent graph calls invocation ``k`` as ``self.<name>[k]``; NodePaths name it ``<name>_k``.
    """


class OpaqueGraphModule(GraphModuleBase, torch.nn.Module):
    """Runs the original module's code; inputs, output, parameters and buffers stay patchable.

    Node names: the ``forward()`` argument names, the module's own parameter and buffer names, and
    ``output``. Children are still extracted: while this module runs, the original module's children
    are swapped for their graph dispatchers (and put back afterwards, also on error).

    Args:
        module: the original module (not copied; its parameters are registered here too).
        reason: why it is opaque (``"GuardOnDataDependentSymNode: ..."``, ``"skipped"``).
        children: ``{child name: extracted child}`` shown in the hierarchy (primary extractions).
        callees: ``{child name: module called in its place}`` while the original code runs.
        routers: the callees that count their calls per run (``restart()`` before each run): a
            child called several times, one graph per invocation (see :mod:`.opaque`).
        serves_any_size: see the attribute.
    """

    compiled = False
    original: torch.nn.Module
    reason: str
    #: whether a call of other sizes (same ranks) runs as the extracted one did (see
    #: :func:`~.opaque.opaque_module`: its code called each child, once)
    serves_any_size: bool
    _callees: dict[str, torch.nn.Module | None]
    _routers: list[Router]
    _signature: inspect.Signature
    _tensor_names: list[str]

    def __init__(self, module: torch.nn.Module, reason: str, children: Mapping[str, torch.nn.Module | None],
                 callees: Mapping[str, torch.nn.Module | None], routers: Sequence[Router] | None = None,
                 serves_any_size: bool = False):
        super().__init__()
        self._init_meta(type(module))
        self.__dict__["original"] = module
        self.reason = reason
        for name, tensor in module.named_parameters(recurse=False):
            # as the module holds it: ``torch.func.functional_call`` puts plain tensors there
            parameters_of(self)[name] = tensor
        for name, buffer in module.named_buffers(recurse=False):
            self.register_buffer(name, buffer)
        for name, child in children.items():
            self.add_module(name, child)
        self.__dict__["_callees"] = dict(callees)
        self.__dict__["_routers"] = list(routers or [])
        self.__dict__["serves_any_size"] = serves_any_size
        signature = inspect.signature(type(module).forward)
        params = list(signature.parameters.values())[1:]
        self.__dict__["_signature"] = signature.replace(parameters=params)
        self.__dict__["_tensor_names"] = [n for n, _ in module.named_parameters(recurse=False)] + [
            n for n, _ in module.named_buffers(recurse=False)]
        self._set_points([p.name for p in params] + self._tensor_names + ["output"])

    def refresh_routing(self) -> None:
        self.__dict__["_routed"] = frozenset(n for n, p in self._op_points.items() if p.listened)

    def call_original_children(self) -> None:
        """Let the original code call the module's own children instead of their graph
        dispatchers (an in-place bridge: the children are bridged themselves)."""
        self.__dict__["_callees"] = {}
        self.__dict__["_routers"] = []

    def trace_forward(self) -> Callable[..., Any]:
        """The forward used while an nnsight trace runs: every input, tensor and the output may be
        routed (see :func:`route`)."""
        return type(self)._traced

    def _traced(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(args, kwargs, frozenset(self.point_names), asking=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(args, kwargs, self._routed, asking=False)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any], routed: frozenset[str], asking: bool) -> Any:
        # inside the module's accelerate hook, if any, as its eager call: offloaded weights load first
        return run_hooked(self.original, args, kwargs, lambda a, k: self._run_loaded(a, k, routed, asking))

    def _run_loaded(self, args: tuple[Any, ...], kwargs: dict[str, Any], routed: frozenset[str],
                    asking: bool) -> Any:
        module = self.original
        if asking:
            points = {name: self.op_point(name) for name in routed}

            def call(name: str, value: Any) -> Any:
                return route(points[name], value)
        else:
            points = self._op_points

            def call(name: str, value: Any) -> Any:
                return points[name](value)
        if routed:
            args, kwargs = self._route_arguments(args, kwargs, routed, call)
        saved_modules = {name: modules_of(module)[name] for name in self._callees}
        saved_tensors: dict[str, tuple[dict[str, Any], Any, Any]] = {}
        for router in self._routers:
            router.restart()
        try:
            modules_of(module).update(self._callees)
            for name in self._tensor_names:
                if name in routed:
                    store = parameters_of(module) if name in parameters_of(module) else buffers_of(module)
                    value = call(name, store[name])
                    saved_tensors[name] = (store, store[name], value)
                    store[name] = value
            output = type(module).forward(module, *args, **kwargs)
        finally:
            modules_of(module).update(saved_modules)
            for name, (store, tensor, value) in saved_tensors.items():
                if store.get(name) is value:  # else the forward re-assigned it (an EMA buffer): keep that
                    store[name] = tensor
        if "output" in routed:
            output = call("output", output)
        return output

    def _route_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any], routed: frozenset[str],
                         call: Callable[[str, Any], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Route each argument through its op point, passing it as the caller did: positionally or
        by keyword (re-binding keywords positionally makes transformers 5's forward decorators,
        which fill ``use_cache`` and the like into ``kwargs``, see them twice)."""
        positional, kwargs = list(args), dict(kwargs)
        bound = self._signature.bind(*positional, **kwargs)  # raises TypeError as the forward would
        position = 0
        for parameter in self._signature.parameters.values():
            name, kind = parameter.name, parameter.kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                if name in routed and name in bound.arguments:
                    positional[position:] = list(call(name, tuple(positional[position:])))
                position = len(positional)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                if name in routed and name in bound.arguments:
                    extra = {k: v for k, v in kwargs.items() if k not in self._signature.parameters}
                    kwargs.update(call(name, extra))
            elif kind is not inspect.Parameter.KEYWORD_ONLY and position < len(positional):
                if name in routed:
                    positional[position] = call(name, positional[position])
                position += 1
            elif name in kwargs and name in routed:
                kwargs[name] = call(name, kwargs[name])
        return tuple(positional), kwargs

    def extra_repr(self) -> str:
        return f"reason={str(self.reason)!r}"  # a StubKind prints as its value
