"""Bridge a model in place: its modules run their graphs, every graph node is a real submodule.

After ``nnbridge.bridge(model, *example_args, **example_kwargs)`` the model is the same object (same
class, ``config``, ``generate()``, ``state_dict()`` keys, parameters) and gives the same outputs, but:

- each module's body runs its extracted graph (``torch.fx`` generated code);
- each graph node has an :class:`~nnbridge.graph.op_point.OpPoint`, registered as a child of its
  module: ``model.get_submodule("transformer.h.0.attn.softmax")``. Torch hooks on it see and may
  replace the op's value; a node is routed through its op point only while something listens;
- the user's own torch hooks, and nnsight's or accelerate's wrappers, keep running around each
  module's body, because only the body is swapped (see :mod:`nnbridge.compat.torch.forwards`);
- ``model.get_submodule`` of a name the model lacks says why it is no op (the module runs eagerly,
  its attention implementation has none, or the closest ops: :mod:`.absence`).

Example::

    nnbridge.bridge(model, input_ids)
    handle = model.get_submodule("transformer.h.0.attn.softmax").register_forward_hook(
        lambda module, args, output: output * 0)
    model(input_ids)            # layer 0 attends to nothing
    handle.remove()
    nnbridge.unbridge(model)    # exactly as before

Op point names: the node's name, with a trailing ``_`` when the module already has an attribute of
that name (``weight`` -> ``weight_``) or the name is ``input``, ``inputs`` or ``output`` (nnsight
envoy properties). A module called several times per forward exposes invocation ``k >= 1``'s
points under ``invocation_<k>`` (``model.linear.invocation_1.linear``).

Order on one op value: torch forward pre-hooks, graph patches (``PatchableGraph.patch``), then
torch forward hooks; nnsight's ``.input``/``.output`` of an op envoy sit just inside the hooks.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, cast

import torch

from ..compat.libc import release_garbage
from ..compat.torch.module_dicts import buffers_of, modules_of, parameters_of
from ..compat.torch.forwards import DirectCall, SwappedBody, restore_body, swap_body
from ..graph import patch_state
from ..graph.failures import add_note
from ..errors import NNBridgeError
from .absence import SubmoduleLookup
from .copies import CarriedOptions, Copier, install_copier, remove_copier
from ..guards.call_structure import call_difference
from ..guards.preservation import preserved_state
from ..dispatch.dispatcher import GraphDispatcher, lookup_outside_dynamo
from ..dispatch.extraction import Extraction
from ..graph.node_path import ModulePath
from ..graph.state import SpecCheck
from ..extract.state_graphs import state_argument_specs
from ..graph.graph_module import CompiledGraphModule, OpaqueGraphModule
from ..extract.examples import static_examples
from ..graph.metadata import node_meta
from ..graph.summaries import bind_inputs
from ..graph.locking import CALL_LOCK, lock_calls, locked_call, unlock_calls
from ..graph.module_tree import ITERATED, named_real_modules, refuse_instance_forwards
from ..graph.op_point import LISTENED, OpPoint, OpPointContainer
from . import own_code
from ..graph.recipes import withdraw_all
from ..extract.options import ExtractionOptions

#: key in a bridged model's ``__dict__`` holding its :class:`Bridge` (removed by :func:`unbridge`);
#: kept on the model, not in a global registry, so a bridged model is freed like any other.
BRIDGE_KEY = "_nnbridge_bridge"
#: key in a bridged model's ``__dict__`` holding its ``get_submodule`` (:class:`~.absence.SubmoduleLookup`:
#: torch's, whose error for a missing name explains why it is no op)
LOOKUP_KEY = "get_submodule"
_LOCAL = threading.local()
_ENVOY_NAMES = frozenset({"input", "inputs", "output"})
#: What an extraction gives for a module: its compiled graph, or an opaque stand-in.
AnyGraph = CompiledGraphModule | OpaqueGraphModule


def _pending() -> dict[int, list[Any]]:
    """``{id(module): [graph, extras, args, kwargs, result]}``: the graph a call site chose for the
    module's call under way, the leading arguments it passes the graph only, the module's arguments
    as the call site passed them, and what its body returned (:data:`_NO_RESULT` until it does; see
    :class:`_CallSite`)."""
    pending = getattr(_LOCAL, "pending", None)
    if pending is None:
        pending = _LOCAL.pending = {}
    return pending


_NO_RESULT = object()


def _same_arguments(entry: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call passes the very objects a :func:`_pending` ``entry`` holds (the common case:
    no hook replaced them)."""
    passed, passed_kwargs = entry[2], entry[3]
    return (len(args) == len(passed) and all(a is b for a, b in zip(args, passed))
            and kwargs.keys() == passed_kwargs.keys() and all(v is passed_kwargs[k] for k, v in kwargs.items()))


def _state_specs_hold(graph: AnyGraph, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the state objects (custom pytree arguments such as a ``DynamicCache``) of a call
    have the pytree structure ``graph`` was extracted for (the spec of its input prologue or of its
    :func:`~.state.read_state` / :func:`~.state.write_state` nodes; the graph's code assumes it,
    except for cache layers it never touched, see :class:`~.state.SpecCheck`).
    Graphs without such arguments always hold (checked once per graph); structures that held are
    remembered (see :class:`~.state.SpecCheck`)."""
    checks = graph.graph_meta.state_specs
    if checks is None:
        specs = state_argument_specs(graph)
        # layers the graph's code never touched are compared by type only (see SpecCheck), when
        # the graph has one state argument, read and written at known layers only
        untouched = graph.graph_meta.untouched if len(specs) == 1 else None
        checks = graph.graph_meta.state_specs = [
            (where, SpecCheck(spec, frozenset() if untouched is None or layers is None else untouched - layers))
            for where, spec, layers in specs]
    if not checks:
        return True
    names = graph.graph_meta.argument_names
    if names is None:
        placeholders: Iterable[torch.fx.Node] = graph.graph.nodes if isinstance(graph, CompiledGraphModule) else []
        names = graph.graph_meta.argument_names = [n.name for n in placeholders if n.op == "placeholder"]
    for where, check in checks:
        if isinstance(where, int):
            value = args[where] if where < len(args) else kwargs.get(names[where]) if where < len(names) else None
        else:
            value = kwargs.get(where)
        if value is None or not check(value):
            return False
    return True


#: the model's extraction of a new call structure, made outside Dynamo's trace when a patch or
#: torch hook is on an op point (the model's own code, which Dynamo could trace, would skip them)
_lookup_outside_dynamo = lookup_outside_dynamo(
    "nnbridge extracts this call structure of the model (torch.export), which cannot run inside torch.compile's"
    " trace, because a patch or torch hook is on one of its op points. Call the model once outside torch.compile"
    " with these arguments (or nnbridge.bridge(model, *example_inputs)) before compiling with fullgraph=True.")
#: the same for a model graph surgery edited (its own code lacks the edits)
_edited_lookup_outside_dynamo = lookup_outside_dynamo(
    "nnbridge extracts this call structure of the model (torch.export), which cannot run inside torch.compile's"
    " trace, and the model's own code would lack its graph surgery edits (nnbridge.surgery). Call the model once"
    " outside torch.compile with these arguments before compiling with fullgraph=True.")


@torch.compiler.disable(reason="a patch context (pg.patch) is open in another thread or asyncio task, so whether"
                               " each patch on this model applies depends on the calling context, which torch.compile"
                               " cannot check: the model runs uncompiled. Leave the other context, or compile without"
                               " fullgraph=True.")
def _body_outside_dynamo(bridge: Bridge, module: torch.nn.Module, args: tuple[Any, ...], *,
                         kwargs: dict[str, Any]) -> Any:
    """``bridge.body(module, *args, **kwargs)`` run eagerly when Dynamo traces it (a graph break)."""
    return bridge.body(module, *args, **kwargs)


def _run_own_code(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``module``'s own code for this call (a front-end's body, such as nnsight's, else its
    ``forward``), run with the op points of its tree out of the registries it may walk
    (:func:`.own_code.as_built`): its ``children()`` are the user's."""
    with own_code.as_built(module):
        return (Bridge.front_end_body(module) or type(module).forward)(module, *args, **kwargs)


class _CallSite:
    """What a parent graph calls instead of a child graph: the user's module itself (so its hooks
    and wrappers run), told which graph its body should run for this call. When the module's call
    would only run its body (no hook, no wrapper: see :class:`~nnbridge.compat.DirectCall`), the
    body runs that graph directly, without ``nn.Module.__call__``'s frames.

    A graph that reads an input unflatten added (``extras`` of them, see
    :func:`~nnbridge.extract.cleanup.drop_unused_extras`) is passed those first by its parent's
    graph: the call site takes them off, so the module (its hooks, wrappers and front-ends) sees the
    arguments eager passes it, and the body gives them back to the graph.

    The parent's graph was extracted for the values its own ops computed: a forward hook (or a
    wrapper, or a front-end) may replace the module's output by other values, but not by a value
    of other sizes, dtypes, devices or structure, on which the rest of the parent's graph may have
    specialised (see :meth:`Bridge._replaced` for the arguments).

    Raises:
        NNBridgeError: a forward hook replaced the output by a value the parent's graph was not
            extracted for (a sized :func:`~nnbridge.guards.call_structure.call_difference`).
    """

    __slots__ = ("module", "graph", "bridge", "direct", "extras")

    def __init__(self, module: torch.nn.Module, graph: AnyGraph, bridge: Bridge, *, extras: int = 0):
        self.module, self.graph, self.bridge, self.extras = module, graph, bridge, extras
        self.direct = DirectCall(module, bridge.body, locked_call)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        extras: tuple[Any, ...] = ()
        if self.extras:
            extras, args = args[:self.extras], args[self.extras:]
        # (torch.compile traces the normal call: the check first, so Dynamo never traces DirectCall)
        if not torch.compiler.is_dynamo_compiling() and self.direct():
            return self.bridge.chosen(self.module, self.graph, args, kwargs=kwargs, extras=extras)
        pending, key = _pending(), id(self.module)
        entry = pending[key] = [self.graph, extras, args, kwargs, _NO_RESULT]
        try:
            # nn.Module's call, not the class's: a class overriding ``__call__`` (``return
            # super().__call__(x) * 3``) runs its override in the parent's frame, so the parent's graph
            # holds what it adds, and the call site stands for its ``super().__call__`` (the class's
            # call would run the override a second time: outputs x9 instead of x3, without an error)
            output = torch.nn.Module.__call__(self.module, *args, **kwargs)
        finally:
            pending.pop(key, None)
        result = entry[4]
        if result is not _NO_RESULT and output is not result:
            difference = call_difference(result, output)
            if difference is not None and difference.sized:
                raise NNBridgeError(
                    f"a forward hook, wrapper or nnsight edit (.output = ...) of '{self.graph.graph_meta.node_path}'"
                    f" ({type(self.module).__name__})"
                    f" replaced its output by another kind of value ({difference.text}): the graph of the module"
                    " calling it was extracted for the output the module returns, and may have specialised on"
                    " its sizes. Return values of the same sizes, dtypes and devices from the hook, or run the"
                    " calling module eagerly (ExtractionOptions(classes_to_skip_compiling={...})).")
        return output


class Bridge:
    """The in-place state of one bridged model (see the module docstring).

    Attributes:
        wanted_inside: class-wide ``wanted_inside(module) -> bool``: whether a running trace wants
            a value inside ``module`` (then its graph runs code that asks each node's
            :attr:`OpPoint.wanted`); never, until a front-end installs its test (the envoy layer
            installs nnsight's).
        source_body: class-wide ``source_body(module)``: the body a running trace wants this call of
            ``module`` to run instead of its graph (nnsight's ``.source``-instrumented forward), or
            None. Never, until a front-end installs its test.
        front_end_body: class-wide ``front_end_body(module)``: the body a front-end keeps for
            ``module`` when it runs outside a bridged call (nnsight's own), or None.
        count_unrouted: class-wide ``count_unrouted(module, points)``: told of a call that ran
            ``points`` without routing them, so a front-end counting visits (nnsight's iteration
            steps) counts them as visited. Does nothing until a front-end installs its counter.
        front_end_active: class-wide ``front_end_active(module)``: whether a front-end's run (an
            nnsight trace) is under way that may want something of ``module``'s call; when not,
            ``wanted_inside``, ``source_body`` and ``count_unrouted`` are not asked (each says no
            or does nothing then). False until a front-end installs its test.
    """

    wanted_inside: ClassVar[Callable[[torch.nn.Module], bool]] = staticmethod(lambda module: False)
    source_body: ClassVar[Callable[[torch.nn.Module], Callable[..., Any] | None]] = staticmethod(lambda module: None)
    front_end_body: ClassVar[Callable[[torch.nn.Module], Callable[..., Any] | None]] = staticmethod(lambda module: None)
    count_unrouted: ClassVar[Callable[[torch.nn.Module, Iterable[OpPoint]], None]] = staticmethod(
        lambda module, points: None)
    front_end_active: ClassVar[Callable[[torch.nn.Module], bool]] = staticmethod(lambda module: False)

    def __init__(self, model: torch.nn.Module, options: ExtractionOptions):
        self.model = model
        self.options = options
        self.dispatcher = GraphDispatcher(model, options, on_extraction=[self._on_extraction])
        self.dispatchers: dict[int, GraphDispatcher] = {id(model): self.dispatcher}
        self.swapped: dict[int, SwappedBody] = {}
        self.points: dict[tuple[int, int, str], OpPoint] = {}
        self.registered: list[tuple[torch.nn.Module, str]] = []
        #: ``registered`` grouped by holder, in order of first registration: ``{id(holder): (holder,
        #: {attribute: None})}`` (see :meth:`holders`)
        self._holders: dict[int, tuple[torch.nn.Module, dict[str, None]]] = {}
        #: every attribute name in :attr:`registered` (an op envoy name a trace may read)
        self.registered_names: set[str] = set()
        #: ``(root graph, {placeholder: summary})`` of linked extractions whose example summaries
        #: are not computed yet (see :meth:`examples_due`)
        self.owed_examples: list[tuple[weakref.ref[AnyGraph], dict[str, Any]]] = []
        self.depth = 0
        self.eager = 0  # > 0 while :meth:`running_eagerly`
        #: ``{id: module}`` of the modules that run graphs while :meth:`lazily`, else None
        self.lazy: dict[int, torch.nn.Module] | None = None
        #: calls per lazy module in the current forward, and the modules seen called more than once
        self.calls: Counter[int] = Counter()
        self.repeated: set[int] = set()
        self.locked: list[tuple[torch.nn.Module, Callable[..., Any]]] = []  # locked ``_call_impl``s (see .locking)
        #: ``(holder, attribute)`` of the modules graph surgery inserted (see :meth:`adopt`)
        self.adopted: list[tuple[torch.nn.Module, str]] = []

    # -- running --------------------------------------------------------------------------------
    def body(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        """Every bridged module's body: the graph its caller chose, else its own dispatcher's graph
        for this call structure, else (called on its own, outside a bridged forward) its code.
        Runs under :data:`.locking.CALL_LOCK` (one bridged call at a time per process)."""
        if torch.compiler.is_dynamo_compiling():  # torch.compile traces through: Dynamo cannot enter a lock
            # whether each patch applies depends on the caller's context when another thread or task has
            # patch contexts open (see patch_state): the call then runs uncompiled
            if not patch_state.all_open_here() and self.listened(traced=True):
                return _body_outside_dynamo(self, module, args, kwargs=kwargs)
            return self._body(module, *args, **kwargs)
        with CALL_LOCK:
            return self._body(module, *args, **kwargs)

    def _body(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.eager:
            return _run_own_code(module, args, kwargs)
        entry = _pending().pop(id(module), None)
        graph, extras = (entry[0], entry[1]) if entry is not None else (None, ())
        if entry is not None and not torch.compiler.is_dynamo_compiling() \
                and not _same_arguments(entry, args, kwargs):
            graph, extras = self._replaced(module, entry, args, kwargs=kwargs)
        if graph is None and self.lazy is not None and self.depth == 0:
            if id(module) not in self.lazy:
                if module is self.model:  # a new forward (a generation step)
                    self.calls.clear()
                return _run_own_code(module, args, kwargs)
            self.calls[id(module)] += 1
            if self.calls[id(module)] > 1:  # whole-model extractions number its calls (invocation_<k>)
                self.repeated.add(id(module))
            graph = self._own_dispatcher(module).lookup(args, kwargs).root
        result = self._run(module, graph, args, kwargs=kwargs, extras=extras)
        if entry is not None:
            entry[4] = result
        return result

    def _replaced(self, module: torch.nn.Module, entry: list[Any], args: tuple[Any, ...], *, kwargs: dict[str, Any]
                  ) -> tuple[AnyGraph, tuple[Any, ...]]:
        """``(graph, extras)`` for a call whose arguments a forward pre-hook (or a wrapper, or a
        front-end) replaced after the parent's graph chose ``entry``'s graph for the ones it passed:
        that graph, when only tensor values changed
        (:func:`~nnbridge.guards.call_structure.call_difference`); else the module's own
        extraction, when the sizes, dtypes, devices, structure and plain values are the same (the
        aliasing, memory layout or ``requires_grad`` differ, which the module's code may branch
        on).

        Raises:
            NNBridgeError: the sizes, dtypes, devices, structure or plain values differ: the rest of
                the parent's graph may have specialised on the output they gave.
        """
        graph, extras, passed, passed_kwargs = entry[:4]
        difference = call_difference((passed, passed_kwargs), (args, kwargs))
        if difference is None:
            return graph, extras
        if difference.sized:
            raise NNBridgeError(
                f"a forward pre-hook, wrapper or nnsight edit (.input = ...) of '{graph.graph_meta.node_path}'"
                f" ({type(module).__name__}) replaced"
                f" the arguments its caller's graph passed by another kind of value ((args, kwargs) {difference.text}):"
                " the graph of the module calling it was extracted for the arguments its own ops computed, and"
                " may have specialised on their sizes. Pass values of the same sizes, dtypes and devices from"
                " the hook, or run the calling module eagerly (ExtractionOptions(classes_to_skip_compiling={...})).")
        return self._own_dispatcher(module).lookup(args, kwargs).root, ()

    def chosen(self, module: torch.nn.Module, graph: AnyGraph, args: tuple[Any, ...], *, kwargs: dict[str, Any],
               extras: tuple[Any, ...] = ()) -> Any:
        """What :meth:`body` runs for a call whose caller's graph chose ``graph`` (a call site
        calling the body directly outside Dynamo, see :class:`_CallSite`); ``extras``: the leading
        arguments the call site took off for the graph."""
        with CALL_LOCK:
            if self.eager:
                return _run_own_code(module, args, kwargs)
            graph, extras = self._fitting(module, graph, args, kwargs=kwargs, extras=extras)
            return self._run_graph(module, graph, args, kwargs=kwargs, compiling=False, extras=extras)

    def _run(self, module: torch.nn.Module, graph: AnyGraph | None, args: tuple[Any, ...],
             *, kwargs: dict[str, Any], extras: tuple[Any, ...] = ()) -> Any:
        compiling = torch.compiler.is_dynamo_compiling()  # Dynamo traces the plain checks and code
        if graph is not None and not compiling:
            graph, extras = self._fitting(module, graph, args, kwargs=kwargs, extras=extras)
        if graph is None:
            dispatcher = self.dispatchers.get(id(module))
            if dispatcher is None or not (module is self.model or self.depth > 0):
                return _run_own_code(module, args, kwargs)
            if compiling:
                extraction = dispatcher.find(args, kwargs)
                if extraction is None:
                    # no graph for this call: extraction (torch.export) cannot run inside Dynamo's
                    # trace. With nothing listening to an op point the graphs would compute what
                    # the module's own code computes: Dynamo traces that code (and guards on what
                    # it read here, so a later extraction or hook recompiles). Else the extraction
                    # runs outside the trace (a graph break; fullgraph=True raises, naming why).
                    # (the module's own code lacks graph surgery's edits: then extracted outside too)
                    if self.adopted:
                        extraction = _edited_lookup_outside_dynamo(dispatcher, args, kwargs)
                    elif not self.listened(traced=True):
                        return _run_own_code(module, args, kwargs)
                    else:
                        extraction = _lookup_outside_dynamo(dispatcher, args, kwargs)
                graph = extraction.root
            else:
                graph = dispatcher.lookup(args, kwargs).root
            extras = ()
        return self._run_graph(module, graph, args, kwargs=kwargs, compiling=compiling, extras=extras)

    def _fitting(self, module: torch.nn.Module, graph: AnyGraph, args: tuple[Any, ...],
                 *, kwargs: dict[str, Any], extras: tuple[Any, ...]) -> tuple[AnyGraph, tuple[Any, ...]]:
        """``(graph, extras)``, or ``module``'s own extraction for this call (which takes no extra
        arguments: ``()``) when a state object (a ``Cache``) is not in the state the parent's
        extraction saw: e.g. an earlier layer was skipped (nnsight ``.skip()``) and did not write
        its cache layer, as in eager. Graphs without state arguments are passed through without a
        call (the check runs on every bridged module call)."""
        specs = graph.graph_meta.state_specs
        if (specs is None or specs) and not _state_specs_hold(graph, extras + args, kwargs):
            return self._own_dispatcher(module).lookup(args, kwargs).root, ()
        return graph, extras

    def _run_graph(self, module: torch.nn.Module, graph: AnyGraph, args: tuple[Any, ...], *, kwargs: dict[str, Any],
                   compiling: bool, extras: tuple[Any, ...] = ()) -> Any:
        """Run ``graph`` as ``module``'s body for this call (``compiling``: Dynamo traces it, so
        the plain generated code runs); ``extras``: leading arguments for the graph only (see
        :class:`_CallSite`)."""
        self.depth += 1
        try:
            if graph.compiled:
                return self._graph_body(module, graph, args, kwargs=kwargs, compiling=compiling, extras=extras)
            with own_code.as_built(module):  # an opaque module: its own code runs
                return self._graph_body(module, graph, args, kwargs=kwargs, compiling=compiling, extras=extras)
        except BaseException as error:
            add_note(error)
            raise
        finally:
            self.depth -= 1

    def _graph_body(self, module: torch.nn.Module, graph: AnyGraph, args: tuple[Any, ...], *, kwargs: dict[str, Any],
                    compiling: bool, extras: tuple[Any, ...]) -> Any:
        if Bridge.front_end_active(module):
            # an nnsight trace waiting for something inside this module: each node asks
            # whether it is wanted; otherwise the plain code (which routes patched and hooked
            # nodes), with the trace's visit counts of the graph's ops kept as if each had
            # been served
            source = Bridge.source_body(module)
            if source is None and Bridge.wanted_inside(module):
                return graph.trace_forward()(graph, *extras, *args, **kwargs)
            Bridge.count_unrouted(module, graph.op_points_made())
            if source is not None:  # the trace wants this call's nnsight ``.source`` operations
                with own_code.as_built(module):  # (the module's own code, rewritten by nnsight)
                    return source(module, *args, **kwargs)
        if graph.compiled and not compiling:
            return cast(CompiledGraphModule, graph).fast_forward()(graph, *extras, *args, **kwargs)
        return graph.forward(*extras, *args, **kwargs)

    def listened(self, *, traced: bool = False) -> bool:
        """Whether a patch listener or a torch hook is on any of the model's op points (then a
        call must run the graphs: :meth:`running_eagerly` would skip them).

        ``traced``: asked inside Dynamo's trace, which guards on what it reads: the process-wide
        :data:`LISTENED` is then not read (a weak set whose size changes whenever the garbage
        collector frees another model's point, which would fail the guard on the frame that made
        it), only this model's points."""
        # OpPoint.listened, read off the instance dicts: hundreds of points are checked before every
        # trace, unless no point of any model is listened
        return (traced or bool(LISTENED)) and any(point._listeners or point._hooked for point in self.points.values())

    @contextlib.contextmanager
    def running_eagerly(self) -> Iterator[None]:
        """Every module of the model runs its own code for the body's duration, as if unbridged
        (a front-end's own body, such as nnsight's, included): no graph runs and nothing is
        extracted. For calls that want no op (see :mod:`nnbridge.envoys.op_reads`).

        Raises:
            NNBridgeError: a patch or torch hook is on an op point (they act only in graphs).
        """
        if self.listened():
            listened = [point.node_name for point in self.points.values() if point.listened][:3]
            raise NNBridgeError(f"cannot run {type(self.model).__name__} eagerly: op points {listened} have"
                                " patches or torch hooks, which act only when its graphs run; remove them"
                                " or run the model normally.")
        self.eager += 1
        try:
            with own_code.as_built(self.model):  # once for every forward in the body (generation steps)
                yield
        finally:
            self.eager -= 1

    @contextlib.contextmanager
    def lazily(self, modules: Iterable[torch.nn.Module]) -> Iterator[None]:
        """Extract only ``modules`` for the body's duration: they run their own graphs (each
        extracted per call structure by its own dispatcher, as a module called on its own), every
        other module runs its own code, as in :meth:`running_eagerly` (so a trace extracts only
        the modules it reaches below the module level). ``modules`` must not contain one another.
        Op points keep their names and identity across a lazy and a
        whole-model extraction (points are shared by module, invocation and name).

        Raises:
            NNBridgeError: a patch or torch hook is on an op point (they need the whole model's
                graphs: run it normally).
        """
        if self.listened():
            raise NNBridgeError(f"cannot extract {type(self.model).__name__} lazily: op points have patches or"
                                " torch hooks, which need the whole model's graphs; run it normally.")
        chosen = {id(module): module for module in modules}
        for module in chosen.values():
            if id(module) not in self.swapped:
                self.swap(module)
        previous, self.lazy = self.lazy, chosen
        try:
            yield
        finally:
            self.lazy = previous

    def opaque_reason(self, path: str) -> str | None:
        """Why the module at torch path ``path`` (``""``: the model) runs eagerly in an extraction
        made so far, or None (a graph everywhere, or not extracted)."""
        key = path or "<root>"
        for dispatcher in list(self.dispatchers.values()):
            for extraction in dispatcher.all_extractions():
                reason = extraction.opaque.get(key)
                if reason is not None:
                    return reason
        return None

    def extracted(self) -> bool:
        """Whether the model (or a module of it, lazily) has been extracted."""
        return any(True for dispatcher in list(self.dispatchers.values()) for _ in dispatcher.all_extractions())

    def lazy_allowed(self, modules: Iterable[torch.nn.Module]) -> bool:
        """Whether :meth:`lazily` may serve ``modules``: none is called more than once per forward
        (a whole-model extraction gives each call its own op points, ``invocation_<k>``; a module
        extracted alone has one set for every call), as far as earlier runs tell."""
        return not any(id(module) in self.repeated or "invocation_1" in modules_of(module) for module in modules)

    def warm_up(self, run: Callable[[], Any]) -> None:
        """While :meth:`lazily`: call ``run`` (a call of the model) once, which extracts the lazy
        modules for its call structures (op envoys must exist before an nnsight trace starts) and
        finds those called more than once per forward (see :meth:`lazy_allowed`). Random state
        and every buffer's value are restored after (:func:`state_restored`).

        Raises:
            NNBridgeError: not inside :meth:`lazily` (an nnbridge bug).
        """
        if self.lazy is None:
            raise NNBridgeError("Bridge.warm_up() runs only inside Bridge.lazily(); this is an nnbridge bug.")
        with state_restored(self.model):
            run()

    def _own_dispatcher(self, module: torch.nn.Module) -> GraphDispatcher:
        """``module``'s own dispatcher (made on first need, linked like the model's)."""
        dispatcher = self.dispatchers.get(id(module))
        if dispatcher is None:
            named = self.model.named_modules(remove_duplicate=False)
            path = ModulePath(next((name for name, m in named if m is module), ""))
            dispatcher = GraphDispatcher(module, self.options, path=path, on_extraction=[self._on_extraction])
            self.dispatchers[id(module)] = dispatcher
        return dispatcher

    # -- linking extractions to the user's modules ----------------------------------------------
    def _on_extraction(self, dispatcher: GraphDispatcher, extraction: Extraction) -> None:
        self.link(extraction, cast(torch.nn.Module, dispatcher.module))

    def link(self, extraction: Extraction, module: torch.nn.Module) -> None:
        """Rewire an extraction so its graphs call the user's modules and share op points."""
        if extraction.example is not None:  # shapes for printing op points (no run needed)
            args, kwargs = extraction.example  # summaries (``torch.Size``), not the call's values
            inputs = bind_inputs(extraction.root, list(args), kwargs)
            if inputs is not None:  # (weakly: an evicted extraction is freed, see GraphDispatcher._evict)
                self.owed_examples = [(root, owed) for root, owed in self.owed_examples if root() is not None]
                self.owed_examples.append((weakref.ref(extraction.root), inputs))
        self._link(extraction.root, module, Counter())

    def examples_due(self) -> None:
        """Compute the example summaries of the extractions linked so far, in link order (as if
        each had been computed when linked): on the first read of any graph's examples, since they
        only describe shapes for printing, and computing them is a visible share of a ``bridge()``
        served by the disk cache."""
        while self.owed_examples:
            root, inputs = self.owed_examples.pop(0)
            graph = root()
            if graph is not None:
                static_examples(graph, inputs)

    def _link(self, graph: AnyGraph, module: torch.nn.Module, invocations: Counter[int]) -> None:
        graph.graph_meta.examples_due = self.examples_due
        invocation = invocations[id(module)]
        invocations[id(module)] += 1
        if id(module) not in self.swapped:
            self.swap(module)
        self._share_points(graph, module, invocation)
        if isinstance(graph, CompiledGraphModule):
            if graph.graph_meta.graph_children is not None:
                return  # already linked (an extraction shared by several callers)
            children: dict[str, AnyGraph] = {}
            for i, node in enumerate([n for n in graph.graph.nodes if n.op == "call_module"]):
                child_graph = graph.child_graph(node)
                child_module = module.get_submodule(node_meta(node).module_path or "")
                children[node_meta(node).name] = child_graph
                self._link(child_graph, child_module, invocations)
                site = f"_nnbridge_call_{i}"
                extras = node_meta(node).extra_args
                graph.add_call_site(site, _CallSite(child_module, child_graph, self, extras=extras))
                node.target = site
            graph.graph_meta.graph_children = children
            self._read_tensors_live(graph, module)
            graph.recompile()
        elif isinstance(graph, OpaqueGraphModule):
            graph.call_original_children()  # the original code calls the (bridged) user modules
            for holder in graph.graph_meta.child_dispatchers.values():
                dispatcher = cast(GraphDispatcher, holder)  # the dispatcher layer made it
                self.dispatchers[id(dispatcher.module)] = dispatcher
                for extraction in dispatcher.all_extractions():
                    self._link(extraction.root, dispatcher.module, Counter())

    @staticmethod
    def _read_tensors_live(graph: CompiledGraphModule, module: torch.nn.Module) -> None:
        """Read parameters and buffers off the module at call time (``self._nnbridge_module.weight``)
        instead of holding them: a replaced parameter, or a weight accelerate loads for the call,
        is what the graph uses; the graph keeps no tensor alive."""
        graph.read_tensors_from(module)  # a cycle through the model, freed with it
        for node in graph.graph.nodes:
            if node.op != "get_attr" or str(node.target).startswith("_nnbridge_module."):
                continue
            target = str(node.target)
            value: torch.Tensor
            try:
                value = module.get_parameter(target)
            except AttributeError:
                try:
                    value = module.get_buffer(target)
                except AttributeError:
                    continue
            if isinstance(value, torch.Tensor):
                *prefix, name = target.split(".")
                holder = graph.get_submodule(".".join(prefix)) if prefix else graph
                parameters_of(holder).pop(name, None)
                buffers_of(holder).pop(name, None)
                node.target = f"_nnbridge_module.{target}"

    def _share_points(self, graph: AnyGraph, module: torch.nn.Module, invocation: int) -> None:
        for name in graph.point_names:
            key = (id(module), invocation, name)
            point = self.points.get(key)
            if point is None:
                self.points[key] = graph.op_point(name)
                self._register(module, invocation, name, point=self.points[key])
            else:
                graph.share_point(name, point)

    def link_of(self, graph: AnyGraph) -> tuple[torch.nn.Module, int] | None:
        """``(module, invocation)`` whose op points ``graph`` shares (the user's module whose body
        runs it, and which of the module's calls per forward it serves); None when the graph has no
        op point registered by this bridge."""
        keys = {id(point): key for key, point in self.points.items()}
        for point in graph.op_points_made():
            key = keys.get(id(point))
            if key is not None and key[0] in self.swapped:
                return self.swapped[key[0]].module, key[1]
        return None

    def add_points(self, graph: AnyGraph, module: torch.nn.Module, invocation: int) -> None:
        """After an edit of ``graph`` (one of ``module``'s graphs for call ``invocation``): register
        op points for its new nodes, as :meth:`link` does for an extraction's nodes."""
        self._share_points(graph, module, invocation)

    def remove_point(self, module: torch.nn.Module, invocation: int, name: str) -> None:
        """After an edit removed node ``name`` from every graph of ``module``'s call
        ``invocation``: unregister its op point (a hook on it could never fire)."""
        point = self.points.pop((id(module), invocation, name), None)
        if point is None:
            return
        for i, (holder, attribute) in enumerate(self.registered):
            if modules_of(holder).get(attribute) is point:
                modules_of(holder).pop(attribute)
                del self.registered[i]
                self._holders[id(holder)][1].pop(attribute, None)
                return

    def _register(self, module: torch.nn.Module, invocation: int, name: str, *, point: OpPoint) -> None:
        if isinstance(module, ITERATED):
            # a container's registry is its entries (len, indices, iteration, append's next
            # index), which its own code and the user's read: an op point there would be one more
            # entry (a bridged Sequential's model[-1] the output op point, ParametrizationList's
            # next parametrization named after it and never run). Its op points stay on its
            # graphs, which PatchableGraph's NodePaths reach
            return
        holder = module
        if invocation:
            container_name = f"invocation_{invocation}"
            existing = modules_of(module).get(container_name) or own_code.hidden(module, container_name)
            holder = existing if existing is not None else OpPointContainer()
            if existing is None:
                own_code.register(module, container_name, holder)
                self._note_registered(module, container_name)
        attribute = name
        while attribute in _ENVOY_NAMES or hasattr(holder, attribute):
            attribute += "_"
        own_code.register(holder, attribute, point)  # (beside the others while its module's own code runs)
        self._note_registered(holder, attribute)

    def _note_registered(self, holder: torch.nn.Module, attribute: str) -> None:
        self.registered.append((holder, attribute))
        self._holders.setdefault(id(holder), (holder, {}))[1][attribute] = None
        self.registered_names.add(attribute)

    def holders(self) -> list[tuple[torch.nn.Module, dict[str, None]]]:
        """:attr:`registered` grouped by holder: ``[(holder, {attribute: None})]``, each holder once,
        holders and attributes in order of first registration (a module's ``invocation_<k>``
        container before the container's own points). For walks over what a bridge registered
        that look up one thing per holder, not per op point (:func:`~nnbridge.compat.nnsight.interleaving.mirror_envoys`)."""
        return list(self._holders.values())

    def swap(self, module: torch.nn.Module) -> None:
        """Make ``module``'s body :meth:`body`, and its copies bridged copies (see .copies)."""
        self.swapped[id(module)] = swap_body(module, self.body)
        install_copier(module, Copier(module, self.detached, bridged_copy, options=self.options))

    # -- undoing --------------------------------------------------------------------------------
    def adopt(self, holder: torch.nn.Module, attribute: str) -> None:
        """Count ``holder.<attribute>`` (a module graph surgery inserted) among the modules the
        bridge registered: front-ends give it an envoy (see :meth:`holders`), :meth:`undo` takes it
        off, :meth:`release` too. While any is inserted, a call Dynamo traces is never served by
        the modules' own code (it lacks the edits)."""
        self._note_registered(holder, attribute)
        self.adopted.append((holder, attribute))

    def release(self, module: torch.nn.Module, *, keep: Iterable[torch.nn.Module] = ()) -> None:
        """Undo the bridge on ``module``'s tree only (a module graph surgery inserted, then took
        out again): its registration (see :meth:`adopt`), bodies, copiers, op points and
        dispatchers, as :meth:`undo` does for the model. Modules in ``keep`` (the model's own
        modules the inserted one held as children, such as a LoRA adapter's base layer) stay
        bridged."""
        spared = {id(m) for m in keep}
        ids = {id(m) for m in module.modules() if id(m) not in spared}

        def released(holder: torch.nn.Module, attribute: str) -> bool:
            return id(holder) in ids or modules_of(holder).get(attribute) is module
        for holder, attribute in reversed(self.registered):
            if released(holder, attribute):
                modules_of(holder).pop(attribute, None)
                kept = self._holders.get(id(holder))
                if kept is not None:
                    kept[1].pop(attribute, None)
        self.registered = [(h, a) for h, a in self.registered if id(h) not in ids and a in modules_of(h)]
        self.adopted = [(h, a) for h, a in self.adopted if a in modules_of(h)]
        for ident in ids:
            self._holders.pop(ident, None)
            self.dispatchers.pop(ident, None)
            swapped = self.swapped.pop(ident, None)
            if swapped is not None:
                restore_body(swapped)
                remove_copier(swapped.module)
        self.registered_names = {attribute for _, attribute in self.registered}
        self.points = {key: point for key, point in self.points.items() if key[0] not in ids}

    def undo(self) -> None:
        """Put every module back exactly as it was."""
        for holder, attribute in reversed(self.registered):
            modules_of(holder).pop(attribute, None)
        for swapped in reversed(list(self.swapped.values())):
            restore_body(swapped)
            remove_copier(swapped.module)
        self.registered.clear()
        self.adopted = []
        self._holders.clear()
        self.registered_names.clear()
        self.swapped.clear()
        unlock_calls(self.locked)
        self.locked = []

    @contextlib.contextmanager
    def detached(self) -> Iterator[None]:
        """Every module exactly as before bridging for the body's duration (under the call lock),
        then bridged again as it was: the same graphs, op points and hooks on them."""
        with CALL_LOCK:
            removed = [(holder, attribute, modules_of(holder).pop(attribute))
                       for holder, attribute in reversed(self.registered)]
            swapped = list(self.swapped.values())
            for body in reversed(swapped):
                restore_body(body)
                remove_copier(body.module)
            unlock_calls(self.locked)
            entry = self.model.__dict__.pop(BRIDGE_KEY, None)
            lookup = remove_lookup(self.model)
            try:
                yield
            finally:
                if entry is not None:
                    self.model.__dict__[BRIDGE_KEY] = entry
                if lookup is not None:
                    self.model.__dict__[LOOKUP_KEY] = lookup
                self.lock_calls()
                for body in swapped:
                    self.swap(body.module)
                for holder, attribute, point in reversed(removed):
                    modules_of(holder)[attribute] = point

    def lock_calls(self) -> None:
        """Make every call of the model or of any of its modules, hooks included, hold the
        process-wide call lock (see :mod:`.locking`)."""
        self.locked = lock_calls(self.model.modules())


@contextlib.contextmanager
def state_restored(model: torch.nn.Module) -> Iterator[None]:
    """Restore, after the body, what a run of ``model`` changes (a warm-up run must leave no trace:
    BatchNorm statistics, counters, draws, an adapter merged or unmerged through ``.data``): torch's
    CPU random state, Python's and numpy's RNGs, every parameter and buffer (the same tensor under
    each name, holding its values from before), module attributes and ``training`` flags, and the
    module globals its code writes (see :func:`~nnbridge.guards.preservation.preserved_state`).
    Attributes the body created stay (the run bridges the modules it reaches).

    Raises:
        ExtractionError: the run changed a parameter in place other than through ``.data``
            (its old values are lost).
    """
    with preserved_state(list(named_real_modules(model)), keep_new_attributes=True):
        yield


def bridge(model: torch.nn.Module, *example_args: Any, options: ExtractionOptions | None = None,
           **example_kwargs: Any) -> torch.nn.Module:
    """Bridge ``model`` in place (see the module docstring) and return it.

    Args:
        model: the model; it stays the same object.
        *example_args: an example call's positional arguments; other call structures are
            extracted when they first happen. Without an example call, the first call is extracted
            (op points appear then).
        **example_kwargs: the example call's keyword arguments.
        options: :class:`ExtractionOptions`.

    Returns:
        ``model``.

    Raises:
        NNBridgeError: ``model`` is already bridged (call :func:`unbridge` first).
        ExtractionError: a module has a ``forward`` set on the instance (see
            :func:`~.module_tree.refuse_instance_forwards`), nothing done; or extraction failed
            and ``options.error_on_compilation_failure`` is set; or a module's eager code gives
            other outputs on two runs from the same state (:mod:`nnbridge.extract.repeat_check`).
            The model is left exactly as it was.
    """
    if BRIDGE_KEY in model.__dict__:
        raise NNBridgeError(f"{type(model).__name__} is already bridged; call nnbridge.unbridge(model) first"
                            " to bridge it again with other options.")
    refuse_instance_forwards(model, "nnbridge.bridge")
    state = Bridge(model, options or ExtractionOptions())
    try:
        state.lock_calls()
        if example_args or example_kwargs:
            state.dispatcher.add_extraction(tuple(example_args), dict(example_kwargs))
        else:  # deferred: the first call extracts (and links) its own call structure
            state.swap(model)
    except BaseException:
        state.undo()
        raise
    model.__dict__[BRIDGE_KEY] = state
    if LOOKUP_KEY not in model.__dict__:  # the user's own get_submodule on the instance stays
        model.__dict__[LOOKUP_KEY] = SubmoduleLookup(model, state)
    return model


def remove_lookup(model: torch.nn.Module) -> SubmoduleLookup | None:
    """Take :class:`~.absence.SubmoduleLookup` off ``model`` (the class's ``get_submodule`` again)."""
    if isinstance(model.__dict__.get(LOOKUP_KEY), SubmoduleLookup):
        return cast(SubmoduleLookup, model.__dict__.pop(LOOKUP_KEY))
    return None


def unbridge(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`bridge`: forwards, ``_modules`` and ``named_modules()`` exactly as before (graph
    surgery's edits are removed, with the modules they inserted); the graphs' memory goes back to the operating system (see :mod:`nnbridge.compat.libc`).

    Raises:
        NNBridgeError: ``model`` is not bridged.
    """
    state = model.__dict__.pop(BRIDGE_KEY, None)
    if state is None:
        raise NNBridgeError(f"{type(model).__name__} is not bridged; nothing to undo.")
    remove_lookup(model)
    state.undo()
    withdraw_all(model)  # graph surgery's edits and the modules they inserted
    del state
    release_garbage()  # the graphs are reference cycles: collected before the heap is trimmed
    return model


def bridged_copy(plain: torch.nn.Module, carried: CarriedOptions) -> torch.nn.Module:
    """Bridge a copy of a bridged module (``copy.deepcopy``, ``pickle.load``, ``torch.load``; see
    :mod:`.copies`) with its original's options; its first call extracts its graphs."""
    return bridge(plain, options=carried.options)


def bridge_of(model: torch.nn.Module) -> Bridge | None:
    """The :class:`Bridge` of a bridged model, or None."""
    return model.__dict__.get(BRIDGE_KEY)
