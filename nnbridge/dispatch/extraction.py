"""Turn a module into a hierarchy of patchable graphs: one graph per submodule invocation.

Route (chosen on torch 2.13, see DESIGN.md): ``torch.export.export(strict=False)`` of the module
with every submodule's call signature preserved, under the caller's grad mode, then
``torch.export.unflatten`` with de-duplication off and codegen on. Each per-invocation graph is
cleaned (:mod:`.cleanup`) and becomes a :class:`CompiledGraphModule` whose parameters and buffers
are the original module's own tensors.

A submodule that cannot be exported is stubbed during export (its recorded output, still
depending on its inputs) and becomes an :class:`OpaqueGraphModule` whose children are extracted
separately; the rest stays a graph. So does a module whose graph would silently differ from its
code (grad-mode changes, custom autograd Functions, Python side effects, Dynamo's ``graph_break()``:
:mod:`~nnbridge.extract.capture_watch`), one whose graph module cannot be built (any exception
while unflattening or building), and one whose custom extraction function raises, as graphpatch
falls back. Submodules the call never runs stay as opaque modules (graphpatch's
``allow_unused_submodules``), and every graph module lists its children, parameters and buffers
in the module's registration order.
Example::

    root, guard = extract(model, (input_ids,), {}, ExtractionOptions(), child_dispatcher=...)
    root.transformer.h[0].attn      # CompiledGraphModule
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from torch.fx import Graph

from ..extract.building import GraphBuilder
from ..guards.call_structure import ShapeGuard, tensor_leaves
from ..guards.preservation import preserved_state
from ..extract.cleanup import input_prologue
from ..extract.capture_watch import GRAD_MODE_REASON, UnfaithfulCaptureError
from ..extract.eager_checks import (ARGUMENT_WRITE_REASON, AUTOGRAD_READ_REASON, DATA_ACCESS_REASON, MASK_SKIP_FIX,
                                    OUTPUT_REASON, REPLACED_REASON, SEEDING_REASON, STATE_READ_REASON,
                                    STORAGE_READ_REASON,
                                    eager_findings, mask_skip_reason)
from ..extract.context import ChildDispatcherFactory, Extraction, ExtractionContext, describe_failure
from ..extract.custom_functions import CUSTOM_FIX, CustomFunctionFailed, custom_graph
from ..graph.graph_module import CompiledGraphModule, OpaqueGraphModule
from ..extract.exporting import CapturingOutputs, ModuleFailure, caller_of, export_module, scalar_stub_caller
from ..graph.hierarchy import walk
from ..graph.node_path import ROOT_PATH, ModulePath
from ..graph.summaries import summarize
from ..graph.kinds import StubKind
from ..graph.locking import CALL_LOCK, locked_calls
from ..graph.module_tree import (
    SharedModuleEntry,
    aliases_hidden,
    named_real_modules,
    reserved_names_renamed,
    shared_container_entries,
)
from ..extract.opaque import opaque_module
from ..extract.shared_names import spread_to_aliases, stateful_callers
from ..store import programs
from ..store.disk_cache import default_cache
from ..store.memory_cache import PROGRAM_RECORD, memory_cache
from ..extract.options import ExtractionOptions
from ..extract.progress import Stages, shows_progress
from ..extract.recording import record_calls
from ..extract.repeat_check import Fingerprint, check_repeatable, fingerprint
from ..extract import sibling_roots
from ..extract.sibling_roots import CallShape, RootWatch, SharedRoot
from ..extract.cache_rebinding import rebind_cache_state
from ..extract.reuse_export_check import check_reused_export
from ..extract.reuse_plan import (
    ReuseFallback,
    ReusePlan,
    cache_index,
    compared_call,
    confirm as confirm_reuse,
    plan as reuse_plan,
)
from ..graph.state import Key, UntouchedLayers, state_keys
from ..compat.output import quiet_stdout
from ..compat.torch.hooks import cleared_module_state
from ..compat.torch.export import (
    constant_outputs,
    copy_spec,
    empty_module_calls,
    forget_export_state,
    invocation_graphs,
    register_cache_pytrees,
    uncalled_module_names,
    unflatten,
)
from ..compat.torch.fx import generated_code_released
from ..extract.source_lines import source_lines_released
from ..compat.accelerate import offloaded_weights_loaded
from ..compat.libc import collection_paused, release_free_heap
from ..compat.torch.fx import fx_patches_confined
from ..compat.transformers.mask_skips import replaced_sdpa_functions
from ..compat.transformers.output_capturing import collector_suspended
from ..compat.torch.pytree import pytree
from ..errors import ExtractionError

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # annotations only: the dispatcher layer imports this module
    from .dispatcher import GraphDispatcher


def extract(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            *, options: ExtractionOptions | None = None, child_dispatcher: ChildDispatcherFactory,
            path: ModulePath = ROOT_PATH,
            on_extraction: list[Callable[[GraphDispatcher, Extraction], None]] | None = None,
            watch: RootWatch | None = None) -> Extraction:
    """Extract ``module`` for the call ``module(*args, **kwargs)``.

    The module is left exactly as it was: its hooks and instance ``forward`` overrides are cleared
    for the duration and restored, also when extraction raises; parameters, buffers, module
    attributes and the CPU random state are unchanged. Graphs are traced under the current grad
    mode (``torch.is_grad_enabled()``), so they are faithful to calls made in that mode.

    Args:
        module: the module; not modified, its parameters are shared with the result.
        args, kwargs: example inputs; graphs are specialised to their structure.
        options: :class:`ExtractionOptions` (defaults if None).
        child_dispatcher: makes the dispatcher an opaque module's child is called through
            (``GraphDispatcher``; :func:`nnbridge.dispatch.dispatcher.extract` passes it).
        path: NodePath prefix for messages (when extracting a child of an opaque module).
        on_extraction: callbacks run on every later extraction made by dispatchers in this tree.
        watch: ``module`` is the representative of its siblings (see :mod:`.sibling_roots`): its
            export watches the attributes that differ between them, and the result is
            :attr:`Extraction.shared` when they may build their graphs from it (with
            ``options.reuse_layers``).

    Returns:
        An :class:`Extraction`.

    Raises:
        ExtractionError: with ``error_on_compilation_failure``: a module could not be exported,
            its graph would differ from its code, building its graph module raised, its custom
            extraction function raised, or (``allow_unused_submodules`` off) it was never called;
            in every mode: a custom extraction function returned a malformed graph, extraction's
            eager run changed a parameter in place (see
            :func:`~nnbridge.guards.preservation.preserved_state`), or two eager runs of the call
            from the same state gave other outputs (see :mod:`nnbridge.extract.repeat_check`).
    """
    # extraction changes shared state (hooks, forwards, parameters while tracing) for its duration:
    # another thread entering any of the model's modules waits (see .locking)
    # (module calls, and tracing's process-wide patches of nn.Module, see .locking)
    # and a caller's transformers output collector does not see extraction's runs; the source of
    # the code export, unflatten and the graph modules generate is dropped with the code (fx keeps
    # every generated source for ever otherwise), as are the source files read for stack traces;
    # what extraction's runs of the forward print is dropped (a module that prints runs eagerly and
    # prints on the user's calls, see compat.output)
    with CALL_LOCK, fx_patches_confined(CALL_LOCK), locked_calls(module.modules()), collector_suspended(), \
            generated_code_released(), source_lines_released(), collection_paused(), quiet_stdout():
        try:
            return _extract(module, args, kwargs, options=options, path=path, on_extraction=on_extraction,
                            child_dispatcher=child_dispatcher, watch=watch)
        finally:  # else torch's globals keep this trace, and through it the model, alive
            forget_export_state()
            release_free_heap()  # the trace's freed memory back to the system (see compat.libc)


def _extract(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             *, options: ExtractionOptions | None, path: ModulePath,
             on_extraction: list[Callable[[GraphDispatcher, Extraction], None]] | None,
             child_dispatcher: ChildDispatcherFactory, watch: RootWatch | None = None) -> Extraction:
    options = options or ExtractionOptions()
    ctx = ExtractionContext(module, options, path, on_extraction=on_extraction if on_extraction is not None else [],
                            child_dispatcher=child_dispatcher)
    # extraction's eager runs must not consume random numbers (dropout in train mode) nor change
    # buffers (batch norm in train mode) or module attributes
    with preserved_state(list(named_real_modules(module))), cleared_module_state(module), \
            offloaded_weights_loaded(module), reserved_names_renamed(module) as renamed, \
            contextlib.ExitStack() as hiding:
        _by_name(ctx, args, kwargs)
        if not ctx.by_name:
            hiding.enter_context(aliases_hidden(module))
        ctx.renamed = renamed
        register_cache_pytrees(module)
        fallback: ReuseFallback | None = None
        try:
            reuse = options.reuse_layers and not ctx.by_name  # (layer reuse stubs by path)
            root, guard = _extract_root(ctx, args, kwargs, reuse=reuse, watch=watch if reuse else None)
        except ReuseFallback as unsafe:  # reuse turned out unsafe for this call: export every layer
            fallback = unsafe
        if fallback is not None:
            # outside the handler: the per-layer export's own failures must not carry the
            # fallback as their context (export failures are searched for a ReuseFallback)
            logger.info("layer reuse fell back to per-layer export: %s", fallback)
            shared_entries, stateful = ctx.shared_entries, ctx.stateful
            ctx = ExtractionContext(module, options, path, on_extraction=ctx.on_extraction,
                                    child_dispatcher=child_dispatcher)
            ctx.renamed, ctx.shared_entries, ctx.stateful = renamed, shared_entries, stateful
            root, guard = _extract_root(ctx, args, kwargs, reuse=False)
    if isinstance(root, OpaqueGraphModule) and root.serves_any_size:
        # its own code runs (no graph is specialised to the call's sizes) and the children it calls
        # are looked up per call by their own dispatchers: any sizes of the call's ranks
        guard = ShapeGuard.any_size(tensor_leaves(args, kwargs))
    root.graph_meta.node_path = path  # for failure notes (see .failures)
    for sub_path, _, _, sub in walk(root):
        if sub is not None:
            sub.graph_meta.node_path = f"{path}.{sub_path}" if path else sub_path

    extraction = Extraction(root, guard, ctx.opaque, (tuple(summarize(a) for a in args),
                                                      {k: summarize(v) for k, v in kwargs.items()}),
                            fallbacks=ctx.fallbacks)
    record = root.__dict__.get(PROGRAM_RECORD)
    extraction.serves_no_grad = (ctx.grad_enabled and isinstance(root, CompiledGraphModule)
                                 and isinstance(record, programs.ProgramRecord) and record.grad_reads == [])
    if watch is not None and fallback is None and options.reuse_layers and not ctx.by_name:
        extraction.shared = _shared_root(extraction, args, kwargs, watch=watch, path=path, templates=ctx.templates)
    return extraction


def _shared_root(extraction: Extraction, args: tuple[Any, ...], kwargs: dict[str, Any], *, watch: RootWatch,
                 path: ModulePath, templates: dict[tuple[str, int], Any]) -> SharedRoot | None:
    """What siblings need to build their graphs from a representative's extraction, when they may:
    one graph hierarchy (nothing opaque), exported with nothing watched read (see
    :mod:`.sibling_roots`); ``templates`` are its built graphs (``GraphBuilder.keep_all``)."""
    record = extraction.root.__dict__.get(PROGRAM_RECORD)
    if not isinstance(extraction.root, CompiledGraphModule) or extraction.opaque or record is None \
            or record.watched != [] or record.stubs:
        return None
    shape = CallShape.of(args, kwargs, watch.index)
    spec = copy_spec(pytree.tree_flatten((args, kwargs))[1])
    return SharedRoot(record, shape, watch.index, path, sibling_roots.call_mode(), spec, templates) \
        if shape is not None else None


def extract_sibling(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    *, options: ExtractionOptions, source: SharedRoot, index: int | None,
                    child_dispatcher: ChildDispatcherFactory, path: ModulePath = ROOT_PATH,
                    on_extraction: list[Callable[[GraphDispatcher, Extraction], None]] | None = None
                    ) -> Extraction | None:
    """Extract ``module`` for the call ``module(*args, **kwargs)`` from a sibling's program, without
    exporting: its graphs are built from ``source``'s over ``module`` (its parameters, buffers and op
    points), reading and writing its own cache layer ``index`` (see :mod:`.sibling_roots`).

    Args:
        module: a sibling of the module ``source`` was extracted from (see
            :func:`.sibling_roots.plan_siblings`); not modified.
        args, kwargs: the call.
        options: :class:`ExtractionOptions` (as for :func:`extract`).
        source: the representative's :attr:`Extraction.shared`.
        index: ``module``'s cache layer index (None when it has none).
        child_dispatcher, path, on_extraction: as for :func:`extract`.

    Returns:
        An :class:`Extraction` equal to the one :func:`extract` gives (graph code, NodePaths,
        outputs), or None when the call is not one ``source``'s graphs serve (another call
        structure; graphs that touch the cache otherwise than through their own layer; any failure
        while building): :func:`extract` must be used. Never raises for those.
    """
    shape = CallShape.of(args, kwargs, index)
    if shape is None or not shape.matches(source.shape) or sibling_roots.call_mode() != source.mode:
        return None
    guard = sibling_roots.sibling_guard(source.record.guard, source.shape, shape, tensors=tensor_leaves(args, kwargs),
                                        call=(args, kwargs))
    if guard is None:  # the representative's program does not serve these sizes
        return None
    quiet = dataclasses.replace(options, warn_on_compilation_failure=False, error_on_compilation_failure=False)
    with CALL_LOCK, generated_code_released(), source_lines_released(), cleared_module_state(module), \
            offloaded_weights_loaded(module), reserved_names_renamed(module) as renamed, aliases_hidden(module):
        ctx = ExtractionContext(module, quiet, path, on_extraction=on_extraction if on_extraction is not None else [],
                                child_dispatcher=child_dispatcher)
        ctx.renamed = renamed
        record = source.record
        rebound = sibling_roots.rebinding(shape, source, index)
        try:
            # copies of the representative's built graphs; it kept none of a submodule it built from
            # an identical submodule's graph (an expert): such a sibling is exported itself
            builder = GraphBuilder(ctx, torch.nn.Module(), {}, calls={}, input_spec=source.input_spec,
                                   states=record.states, constants={}, example=(args, kwargs),
                                   reuse=ReusePlan(),
                                   untouched=sibling_roots.untouched_rebound(record.untouched, rebound))
            root = builder.from_shared(source.templates, module)
            if ctx.opaque:
                raise ReuseFallback(f"a graph of '{source.path}' could not be built here: {ctx.opaque}")
            graphs = [("", root), *((sub_path, sub) for sub_path, _, _, sub in walk(root)
                                    if isinstance(sub, CompiledGraphModule))]
            if input_prologue(root.graph) is not None:  # it would flatten the call with the representative's spec
                raise ReuseFallback("its root graph takes its inputs flattened")
            for sub_path, graph in graphs:
                if rebound is not None:
                    rebind_cache_state(graph, rebound, ctx.full(ModulePath(sub_path)) or "<root>")
        except Exception as error:  # noqa: BLE001 - the sibling is exported itself
            logger.info("'%s' is extracted itself, not from '%s': %s", path, source.path, describe_failure(error))
            return None
    root.graph_meta.node_path = path
    for sub_path, _, _, sub in walk(root):
        if sub is not None:
            sub.graph_meta.node_path = f"{path}.{sub_path}" if path else sub_path
    root.graph_meta.reused_from = source.path
    root.__dict__[PROGRAM_RECORD] = record
    return Extraction(root, guard, {}, (tuple(summarize(a) for a in args), {k: summarize(v) for k, v in kwargs.items()}))


def _by_name(ctx: ExtractionContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Set ``ctx.shared_entries`` (the modules holding a shared module at a container entry, see
    :func:`shared_container_entries`) and, when there are any, ``ctx.stateful`` (the modules an eager
    run calls with a stateful argument): with none, the tree is exported by name (``ctx.by_name``,
    see :mod:`nnbridge.extract.shared_names`)."""
    module = ctx.module
    ctx.shared_entries = shared_container_entries(module)
    if ctx.shared_entries:
        ctx.stateful = stateful_callers(module, args, kwargs)


def _skip(ctx: ExtractionContext, module: torch.nn.Module) -> bool:
    return ctx.options.skip_compilation or type(module) in ctx.options.classes_to_skip_compiling


def _extract_root(ctx: ExtractionContext, args: tuple[Any, ...], kwargs: dict[str, Any], *, reuse: bool = False,
                  watch: RootWatch | None = None) -> tuple[CompiledGraphModule | OpaqueGraphModule, ShapeGuard]:
    module = ctx.module
    static = ShapeGuard.static(tensor_leaves(args, kwargs))
    if type(module) in ctx.options.custom_extraction_functions:
        try:
            return custom_graph(ctx, ROOT_PATH, module), static
        except CustomFunctionFailed as failed:  # as graphpatch: a failing function means fallback
            reason = f"its custom extraction function failed: {describe_failure(failed.error)}"
            ctx.fail(ROOT_PATH, reason, failed.error, fix=CUSTOM_FIX)
            return opaque_module(ctx, ROOT_PATH, module, args=args, kwargs=kwargs, reason=reason), static
    if _skip(ctx, module):
        ctx.opaque[ctx.full(ROOT_PATH) or "<root>"] = StubKind.SKIPPED
        return opaque_module(ctx, ROOT_PATH, module, args=args, kwargs=kwargs, reason=StubKind.SKIPPED), static
    stubs: dict[str, str] = {  # a StubKind, or the reason an export failure made it opaque
        fqn: StubKind.CUSTOM if type(sub) in ctx.options.custom_extraction_functions else StubKind.SKIPPED
        for fqn, sub in named_real_modules(module)
        if fqn and (type(sub) in ctx.options.custom_extraction_functions
                    or type(sub) in ctx.options.classes_to_skip_compiling)}
    errors: dict[str, BaseException] = {}
    for fqn, sharing in ({} if ctx.by_name else ctx.shared_entries).items():
        callers = ", ".join(repr(p or "<root>") for p in ctx.stateful)
        reason = (f"{sharing}, and the call passes a stateful argument to {callers}: nnbridge threads its state"
                  " through forwards set on the modules, which hide from torch.export the name a shared module"
                  " is called by, so the calls of one module under two names cannot be kept apart")
        owner = fqn
        while owner and owner in ctx.stateful:  # its stub could not hand the state it writes back to a graph
            owner = caller_of(module, owner)
        if owner != fqn:
            reason += f"; {fqn!r} is called with the stateful argument, so its caller {owner or '<root>'!r} runs its code"
        if owner == "":
            ctx.fail(ROOT_PATH, reason, SharedModuleEntry(reason), fix=SharedModuleEntry.FIX)
            return opaque_module(ctx, ROOT_PATH, module, args=args, kwargs=kwargs, reason=reason), static
        if owner not in stubs:
            stubs[owner], errors[owner] = reason, SharedModuleEntry(reason)
    # the call's structure before anything runs it: export may record a cache argument's spec
    # after the traced code mutated it (torch 2.13, static shapes)
    input_spec = copy_spec(pytree.tree_flatten((args, kwargs))[1])
    with Stages(f"extracting {type(module).__name__}", 3,
                show=shows_progress(ctx.options.progress, module)) as bar:
        exporting = _RootExport(ctx, args, kwargs, bar=bar, stubs=stubs, errors=errors, watch=watch)
        bar.stage("exporting" if exporting.record is None else "reading the cache")
        opaque = exporting.prepare(reuse=reuse)
        if opaque is None:
            opaque = exporting.export()
        if opaque is not None:
            return opaque, static
        guard = exporting.report(static)
        bar.stage("building graphs")
        root = exporting.build(input_spec)
        if isinstance(root, OpaqueGraphModule):
            return root, static
        return root, guard


class _RootExport:
    """One root module's way to a program that serves the call, and the graphs built from it.

    Attributes:
        stubs: ``{module path: a StubKind, or the reason a failure made it opaque}`` of the modules
            stubbed (or traced through, see ``traced``) while exporting; ``errors`` their errors.
        calls: the recorded calls of the stubbed modules (see :func:`.recording.record_calls`).
        plan: the layers whose graphs are built from their representative's (see :mod:`.reuse_plan`).
        traced: modules export traces through although they are shown opaque; ``frozen``: those
            of them whose grad-mode changes are ignored.
        record: the program's record (looked up for the call, else made after the export).
        exported, dynamic, states, untouched: the program and what :func:`export_module` said of it.
        watch_reads: what the export of a watched representative read (see :mod:`.sibling_roots`).
    """

    def __init__(self, ctx: ExtractionContext, args: tuple[Any, ...], kwargs: dict[str, Any], *, bar: Stages,
                 stubs: dict[str, str], errors: dict[str, BaseException], watch: RootWatch | None):
        self.ctx, self.module, self.args, self.kwargs, self.bar = ctx, ctx.module, args, kwargs, bar
        self.stubs, self.errors = stubs, errors
        self.watch = watch
        self.dynamic = ctx.options.dynamic_shapes
        # a saved or cached export of this call (see .programs) replaces the export loop
        self.request = programs.ExportRequest(ctx.module, ctx.path, args, kwargs, ctx.options, ctx.grad_enabled)
        self.cache = default_cache() or memory_cache()  # the disk cache, else the process's (see .memory_cache)
        self.record: programs.ProgramRecord | None = programs.lookup(self.request, self.cache)
        self.exported: torch.export.ExportedProgram | None = None
        self.states: dict[str, list[list[Key]]] = {}
        self.untouched: dict[str, list[UntouchedLayers | None]] = {}
        self.eager: _EagerStubs | None = None
        self.calls: dict[str, list] = {}
        self.plan = ReusePlan()
        self.traced: set[str] = set()
        self.frozen: set[str] = set()
        self.watch_reads: list[str] | None = None

    def prepare(self, *, reuse: bool) -> OpaqueGraphModule | None:
        """Stub what an eager run finds (or take a record's stubs), record the stubbed modules'
        calls and confirm the reuse plan; the root's opaque module when it must run its own code."""
        module, args, kwargs = self.module, self.args, self.kwargs
        initial_stubs, initial_errors = dict(self.stubs), dict(self.errors)
        if self.record is None:  # an eager run finds modules to stub before the calls are recorded (one recording)
            opaque = self._stub_eagerly()
            if opaque is not None:
                return opaque
        else:
            self._take(self.record)
        # (a record's plan is derived again from the module as it was derived before its export)
        candidates = reuse_plan(module, set(self.stubs if self.record is None else initial_stubs)) \
            if reuse else ReusePlan()
        recorded = set(self.stubs) | set(candidates.siblings) | candidates.representatives()
        # (calls of layers only compared for reuse are outlined, their tensors not kept: see
        # .reuse_plan.compared_call; building records again the call of one it makes opaque)
        compared = (set(candidates.siblings) | candidates.representatives()) - set(self.stubs)
        returned: list[Any] = []  # the recording run's output: the second run of the repeat check
        self.calls = record_calls(module, recorded, args, kwargs=kwargs, outlined={
            fqn: compared_call(cache_index(candidates, fqn)) for fqn in compared},
            output=returned) if recorded else {}
        second = fingerprint(returned.pop()) if returned else None
        self.plan = confirm_reuse(module, candidates, {fqn: self.calls.pop(fqn, []) for fqn in compared})
        if self.record is not None and self.record.reuse != self.plan.siblings:
            # a record keeps the siblings its export stubbed; the plan is derived again for this call
            if self.record.reuse or not reuse:  # another plan than this call's: export again
                self.record, self.stubs, self.errors = None, initial_stubs, initial_errors
                opaque = self._stub_eagerly()
                if opaque is not None:
                    return opaque
                stubbed = recorded | set(self.stubs)
                self.calls = record_calls(module, stubbed, args, kwargs=kwargs, output=returned) if stubbed else {}
                second = fingerprint(returned.pop()) if returned else None
            else:  # the export fell back to per-layer export for this call before: so does this build
                self.plan = ReusePlan()
        self._check_repeatable(second)
        # a skipped module called with a cache is traced through (its new cache state must reach its
        # caller's graph) and only shown as opaque; the others are stubbed while exporting
        self.traced = {fqn for fqn in self.stubs if self.stubs[fqn] == StubKind.SKIPPED
                       and any(state_keys(a, k) for a, k, _ in self.calls[fqn])}
        # traced modules whose own grad-mode changes are ignored while exporting
        self.frozen = set(self.eager.frozen) if self.eager is not None else set()
        self.traced |= self.eager.traced if self.eager is not None else set()
        if self.record is None:
            self.untouched = {}
        self.watch_reads = [] if self.watch is not None else None
        return None

    def _stub_eagerly(self) -> OpaqueGraphModule | None:
        self.eager = _eager_stubs(self.ctx, self.module, self.args, kwargs=self.kwargs, stubs=self.stubs,
                                  errors=self.errors)
        if self.eager.root is None:
            return None
        self._check_repeatable(None)
        self.bar.close()
        return _opaque_root(self.ctx, self.module, self.args, kwargs=self.kwargs, root=self.eager.root)

    def _check_repeatable(self, recorded: Fingerprint | None) -> None:
        """Compare the output of the eager findings' run with that of a second run from the same
        state (:func:`~nnbridge.extract.repeat_check.check_repeatable`): ``recorded`` is the
        fingerprint of the recording run's output when one was made, which serves unless
        the two ran under other grad modes and the code reads grad mode (the check then runs the
        call itself)."""
        eager = self.eager
        if eager is None or eager.printed is None:  # a record's stubs were taken, or the eager run raised
            return
        same_mode = not self.ctx.grad_enabled or eager.grad_reads == []
        check_repeatable(self.module, self.args, self.kwargs, first=eager.printed,
                         second=recorded if same_mode else None, grad_enabled=self.ctx.grad_enabled,
                         path=self.ctx.path)

    def _take(self, record: programs.ProgramRecord) -> None:
        """Use ``record``'s program and stubs."""
        self.stubs = dict(record.stubs)
        self.exported, self.dynamic, self.states = record.exported, record.dynamic, record.states
        self.untouched = record.untouched
        # a shared container entry's error (with its fix) is known again from the module itself
        errors = self.errors
        self.errors = {fqn: errors[fqn] if isinstance(errors.get(fqn), SharedModuleEntry) and str(errors[fqn]) == reason
                       else programs.RecordedFailure(reason) for fqn, reason in self.stubs.items()}

    def export(self) -> OpaqueGraphModule | None:
        """Without a record: export until a program serves the call, stubbing the modules at fault;
        the root's opaque module when the root itself is at fault."""
        module, args, kwargs = self.module, self.args, self.kwargs
        while self.record is None:
            if self.ctx.by_name:
                self._spread_to_aliases()
            frozen_by = scalar_stub_caller(module, self.stubs, self.traced, calls=self.calls)
            if frozen_by is not None:
                caller, cause = frozen_by
                if caller == "":
                    return self._fail_root(cause)
                self._stub(caller, cause)
                continue
            try:
                self.exported, self.dynamic, self.states = export_module(
                    module, args, kwargs, stubs={f: r for f, r in self.stubs.items() if f not in self.traced},
                    calls=self.calls, dynamic=self.dynamic, grad_enabled=self.ctx.grad_enabled, traced=self.traced,
                    dims=self.ctx.options.dynamic_dims if self.ctx.path == ROOT_PATH else None,
                    frozen=self.frozen, reuse=self.plan, untouched=self.untouched, root_watch=self.watch,
                    watch_reads=self.watch_reads, by_name=self.ctx.by_name)
                # calls export recorded no node for (nn.Identity): unflatten would fail on them; they
                # run as themselves, called from their caller's graph (a stub records a node)
                # (a name of a shared module the code never called is no call, see .shared_names)
                uncalled = uncalled_module_names(self.exported) if self.ctx.by_name else set()
                empty = {fqn.partition("@")[0].partition(".")[2]
                         for fqn in empty_module_calls(self.exported) if fqn not in uncalled} - {""} - set(self.stubs)
                if not empty:
                    break
                for fqn in sorted(empty):
                    self.stubs[fqn] = StubKind.PASSTHROUGH
                self.calls = record_calls(module, set(self.stubs), args, kwargs=kwargs)
                continue
            except ModuleFailure as failure:
                opaque = self._stub_failure(failure)
                if opaque is not None:
                    return opaque
        return None

    def _spread_to_aliases(self) -> None:
        """Stub (or trace through) every name of a module object stubbed (traced through) under one
        name (see :func:`~nnbridge.extract.shared_names.spread_to_aliases`); record the calls again
        when that stubs more."""
        stubs = spread_to_aliases(self.module, self.stubs)
        self.traced = set(spread_to_aliases(self.module, dict.fromkeys(self.traced)))
        self.frozen = set(spread_to_aliases(self.module, dict.fromkeys(self.frozen)))
        if stubs != self.stubs:
            self.stubs, self.errors = stubs, spread_to_aliases(self.module, self.errors)
            self.calls = record_calls(self.module, set(self.stubs), self.args, kwargs=self.kwargs)

    def _stub_failure(self, failure: ModuleFailure) -> OpaqueGraphModule | None:
        """Stub the module ``failure`` is attributed to (or its caller, or trace through the modules
        whose graphs would differ from their code); the root's opaque module when it is the root."""
        fqn, error = failure.fqn, failure.error
        faults = [(fqn, error), *failure.more]
        if all(isinstance(e, UnfaithfulCaptureError) and f and f not in self.stubs for f, e in faults):
            # their code traces (shapes stay symbolic, cache state is threaded): keep tracing
            # through them, with grad-mode changes inside them ignored, and show them opaque
            for fqn, error in faults:
                self.stubs[fqn] = describe_failure(error)
                self.errors[fqn] = error
                self.traced.add(fqn)
                if cast(UnfaithfulCaptureError, error).grad_mode:  # all are, checked above
                    self.frozen.add(fqn)
            self.calls = record_calls(self.module, set(self.stubs), self.args, kwargs=self.kwargs)
            return None
        while fqn and any(failure.states.get(fqn, [])):
            # a stub cannot write the cache state the module would have: its caller is opaque
            fqn = caller_of(self.module, fqn)
        if fqn == "" or fqn in self.stubs:
            return self._fail_root(error)
        self._stub(fqn, error)
        return None

    def _stub(self, fqn: str, error: BaseException) -> None:
        self.stubs[fqn] = describe_failure(error)
        self.errors[fqn] = error
        self.calls = record_calls(self.module, set(self.stubs), self.args, kwargs=self.kwargs)

    def _fail_root(self, error: BaseException) -> OpaqueGraphModule:
        self.bar.close()
        self.ctx.fail(ROOT_PATH, describe_failure(error), error)
        return opaque_module(self.ctx, ROOT_PATH, self.module, args=self.args, kwargs=self.kwargs,
                             reason=describe_failure(error))

    def report(self, static: ShapeGuard) -> ShapeGuard:
        """Report the stubbed modules (opaque fallbacks), check the reuse plan against the program,
        make its record when there was none (stored for later calls); the guard of the program."""
        ctx = self.ctx
        for fqn, reason in self.stubs.items():
            if reason not in (StubKind.CUSTOM, StubKind.SKIPPED, StubKind.PASSTHROUGH):
                shared = isinstance(self.errors[fqn], SharedModuleEntry)
                ctx.fail(ModulePath(fqn), reason, self.errors[fqn],
                         fix=SharedModuleEntry.FIX if shared else getattr(self.errors[fqn], "fix", None))
            elif reason != StubKind.CUSTOM:  # opaque by design, not by a failure: no warning, never an error
                ctx.opaque[ctx.full(ModulePath(fqn))] = reason
        exported = self.program
        self.plan = self.plan.outside(self.stubs)
        if self.plan.siblings:
            check_reused_export(self.plan, exported, self.stubs, states=self.states)
        record = self.record
        guard = record.guard if record is not None else ShapeGuard.from_export(exported) if self.dynamic else static
        if record is None:
            self.bar.stage("writing the cache")
            self.record = programs.ProgramRecord(ctx.path, self.request.call_fingerprint(), exported, self.dynamic,
                                                 self.states, dict(self.stubs), guard, dict(self.plan.siblings),
                                                 self.untouched, self.watch_reads,
                                                 self.eager.grad_reads if self.eager is not None else None)
            programs.store(self.request, self.record, self.cache)
        return guard

    @property
    def program(self) -> torch.export.ExportedProgram:
        """The program (the record's, or the export's)."""
        assert self.exported is not None  # set by a record or by export()
        return self.exported

    def build(self, input_spec: Any) -> CompiledGraphModule | OpaqueGraphModule:
        """The root's graph module built from the program; its opaque module when there is no graph
        or, as graphpatch falls back, anything failed while compiling (unflattening, building)."""
        ctx, module, args, kwargs, exported = self.ctx, self.module, self.args, self.kwargs, self.program
        try:
            # no op ran (``return x``, ``return 3``): unflatten (torch 2.13) makes no graph for the module
            holder = None
            if any(node.op == "call_function" for node in exported.graph.nodes):
                unflattened = unflatten(exported)
                unflattened_model = dict(unflattened.named_children()).get("model")
                holder = invocation_graphs(unflattened_model)[0] if unflattened_model is not None else None
            if holder is None or not isinstance(getattr(holder, "graph", None), Graph):
                self.bar.close()
                reason = "its forward runs no tensor operation: there is no graph to extract"
                ctx.fail(ROOT_PATH, reason, None)
                return opaque_module(ctx, ROOT_PATH, module, args=args, kwargs=kwargs, reason=reason)
            builder = GraphBuilder(ctx, unflattened, self.stubs, calls=self.calls, input_spec=input_spec,
                                   states=self.states, constants=constant_outputs(exported), example=(args, kwargs),
                                   reuse=self.plan, untouched=self.untouched)
            builder.number_calls(holder)
            builder.keep_all = self.watch is not None  # its sibling roots build their graphs from its built ones
            root = builder.build(ROOT_PATH, module, holder)
            ctx.templates = builder.templates
            # the record lives as long as its graphs: the process's memory cache refers to it weakly
            root.__dict__[PROGRAM_RECORD] = self.record
        except (ExtractionError, ReuseFallback):
            raise  # deliberate and loud (a malformed custom graph; a failure under the error option)
        except Exception as error:  # noqa: BLE001
            self.bar.close()
            reason = f"building its graph failed: {describe_failure(error)}"
            ctx.fail(ROOT_PATH, reason, error)
            return opaque_module(ctx, ROOT_PATH, module, args=args, kwargs=kwargs, reason=reason)
        return root


class _EagerStubs(NamedTuple):
    """What :func:`_eager_stubs` added: modules traced through though shown opaque, those of them
    whose grad-mode changes are ignored, and why the root itself is opaque (reason, error, fix) or
    None; the modules whose code read grad mode (``EagerFindings.grad_reads``); and the
    fingerprint of the run's output (None when the run raised: see :mod:`..extract.repeat_check`)."""

    traced: set[str]
    frozen: set[str]
    root: tuple[str, BaseException, str | None] | None
    grad_reads: list[str] | None = None
    printed: Fingerprint | None = None


def _eager_stubs(ctx: ExtractionContext, module: torch.nn.Module, args: tuple[Any, ...], *, kwargs: dict[str, Any],
                 stubs: dict[str, str], errors: dict[str, BaseException]) -> _EagerStubs:
    """Stub (in ``stubs`` and ``errors``) what one eager run of the call finds (see
    :func:`~nnbridge.extract.eager_checks.eager_findings`), before the first export instead of
    after it failed."""
    found = eager_findings(module, args, kwargs, grad_enabled=ctx.grad_enabled)
    printed = fingerprint(found.output[0]) if found.output else None
    found = found._replace(output=())
    traced: set[str] = set()
    frozen: set[str] = set()
    # modules that change grad mode: traced through with the change ignored from the first export
    # on, as after an export found them (one export, not two)
    for fqn in found.grad_mode:
        grad_change = UnfaithfulCaptureError(GRAD_MODE_REASON, grad_mode=True)
        if fqn == "":  # no caller's graph to trace it into: the module runs eagerly, as after its export failed
            return _EagerStubs(traced, frozen, (describe_failure(grad_change), grad_change, None), printed=printed)
        if fqn not in stubs:
            stubs[fqn], errors[fqn] = describe_failure(grad_change), grad_change
            traced.add(fqn)
            frozen.add(fqn)
    # modules whose code collects submodules' outputs with transformers' hooks: stubbed from the
    # first export on (export would fail on them, one export later)
    for fqn in found.capturing:
        capturing = CapturingOutputs(fqn)
        if fqn == "":
            return _EagerStubs(traced, frozen, (describe_failure(capturing), capturing, None), printed=printed)
        if fqn not in stubs:
            stubs[fqn], errors[fqn] = describe_failure(capturing), capturing
    # modules whose eager call may take a native fast path (nn.MultiheadAttention in eval mode
    # without grad): a trace takes the Python path, whose numbers differ; they run eagerly
    for fqn, op in found.fast_paths:
        fast = UnfaithfulCaptureError(f"may run the native fast path {op} in eager code (eval mode, no grad), which a"
                                      " trace does not take: a graph would compute the Python path's numbers")
        if fqn == "":
            return _EagerStubs(traced, frozen, (describe_failure(fast), fast, None), printed=printed)
        if fqn not in stubs:
            stubs[fqn], errors[fqn] = describe_failure(fast), fast
    # modules in which transformers skipped an sdpa mask that a graph would build, while another
    # attention function than transformers' stands for sdpa: traced through, shown opaque (their
    # own code runs, passing no mask as in eager)
    replaced = replaced_sdpa_functions(module) if found.mask_skips else {}
    for fqn in found.mask_skips if replaced else ():
        skip = UnfaithfulCaptureError(mask_skip_reason(replaced), fix=MASK_SKIP_FIX)
        if fqn == "":
            return _EagerStubs(traced, frozen, (describe_failure(skip), skip, MASK_SKIP_FIX), printed=printed)
        if fqn not in stubs:
            stubs[fqn], errors[fqn] = describe_failure(skip), skip
            traced.add(fqn)
    # modules whose code touches .data (export would fail on them at the root), reads autograd state
    # or process-wide state no call structure records, or seeds torch's RNG: they run eagerly (see
    # extract.eager_checks)
    for fqns, reason in ((found.data_access, DATA_ACCESS_REASON), (found.autograd_reads, AUTOGRAD_READ_REASON),
                         (found.seeding, SEEDING_REASON), (found.state_reads, STATE_READ_REASON),
                         (found.argument_writes, ARGUMENT_WRITE_REASON), (found.printing, OUTPUT_REASON),
                         (found.storage_reads, STORAGE_READ_REASON), (found.replaced, REPLACED_REASON)):
        for fqn in fqns:
            error = UnfaithfulCaptureError(reason)
            if fqn == "":
                return _EagerStubs(traced, frozen, (describe_failure(error), error, None), printed=printed)
            if fqn not in stubs:
                stubs[fqn], errors[fqn] = describe_failure(error), error
    return _EagerStubs(traced, frozen, None, found.grad_reads, printed)


def _opaque_root(ctx: ExtractionContext, module: torch.nn.Module, args: tuple[Any, ...], *, kwargs: dict[str, Any],
                 root: tuple[str, BaseException, str | None]) -> OpaqueGraphModule:
    reason, error, fix = root
    ctx.fail(ROOT_PATH, reason, error, fix=fix)
    return opaque_module(ctx, ROOT_PATH, module, args=args, kwargs=kwargs, reason=reason)
