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
:mod:`.capture_checks`), one whose graph module cannot be built (any exception while unflattening or
building), and one whose custom extraction function raises, as graphpatch falls back. Submodules the
call never runs stay as opaque modules (graphpatch's ``allow_unused_submodules``), and every graph
module lists its children, parameters and buffers in the module's registration order.
Example::

    root, guard = extract(model, (input_ids,), {}, ExtractionOptions(), child_dispatcher=...)
    root.transformer.h[0].attn      # CompiledGraphModule
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from torch.fx import Graph
from tqdm.auto import tqdm

from ..extract.building import GraphBuilder
from ..guards.call_structure import ShapeGuard, tensor_leaves
from ..extract.cleanup import input_prologue
from ..extract.capture_checks import (
    DATA_ACCESS_REASON,
    GRAD_MODE_REASON,
    MASK_SKIP_FIX,
    UnfaithfulCaptureError,
    eager_findings,
    mask_skip_reason,
    preserved_state,
)
from ..extract.context import ChildDispatcherFactory, Extraction, ExtractionContext, describe_failure
from ..extract.custom_functions import CUSTOM_FIX, CustomFunctionFailed, custom_graph
from ..graph.graph_module import CompiledGraphModule, OpaqueGraphModule
from ..extract.exporting import CapturingOutputs, ModuleFailure, caller_of, export_module, scalar_stub_caller
from ..graph.hierarchy import walk
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
from ..store import programs
from ..store.disk_cache import default_cache
from ..store.memory_cache import PROGRAM_RECORD, memory_cache
from ..extract.options import ExtractionOptions
from ..extract.recording import record_calls
from ..extract import sibling_roots
from ..extract.sibling_roots import CallShape, RootWatch, SharedRoot
from ..extract.cache_rebinding import rebind_cache_state
from ..extract.reuse_export_check import check_reused_export
from ..extract.reuse_plan import (
    ReuseFallback,
    ReusePlan,
    confirm as confirm_reuse,
    plan as reuse_plan,
)
from ..graph.state import state_keys
from ..compat import (cleared_module_state, constant_outputs, copy_spec, empty_module_calls, forget_export_state,
                      generated_code_released, invocation_graphs, offloaded_weights_loaded, register_cache_pytrees,
                      unflatten)
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
            options: ExtractionOptions | None = None, *, child_dispatcher: ChildDispatcherFactory, path: str = "",
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
            in every mode: a custom extraction function returned a malformed graph, or extraction's
            eager run changed a parameter in place (see :func:`.capture_checks.preserved_state`).
    """
    # extraction changes shared state (hooks, forwards, parameters while tracing) for its duration:
    # another thread entering any of the model's modules waits (see .locking)
    # (module calls, and tracing's process-wide patches of nn.Module, see .locking)
    # and a caller's transformers output collector does not see extraction's runs; the source of
    # the code export, unflatten and the graph modules generate is dropped with the code (fx keeps
    # every generated source for ever otherwise)
    with CALL_LOCK, fx_patches_confined(CALL_LOCK), locked_calls(module.modules()), collector_suspended(), \
            generated_code_released(), collection_paused():
        try:
            return _extract(module, args, kwargs, options, path, on_extraction, child_dispatcher, watch)
        finally:  # else torch's globals keep this trace, and through it the model, alive
            forget_export_state()
            release_free_heap()  # the trace's freed memory back to the system (see compat.allocator)


def _extract(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             options: ExtractionOptions | None, path: str,
             on_extraction: list[Callable[[GraphDispatcher, Extraction], None]] | None,
             child_dispatcher: ChildDispatcherFactory, watch: RootWatch | None = None) -> Extraction:
    options = options or ExtractionOptions()
    ctx = ExtractionContext(module, options, path, on_extraction if on_extraction is not None else [], child_dispatcher)
    # extraction's eager runs must not consume random numbers (dropout in train mode) nor change
    # buffers (batch norm in train mode) or module attributes
    with preserved_state(list(named_real_modules(module))), cleared_module_state(module), \
            offloaded_weights_loaded(module), reserved_names_renamed(module) as renamed, aliases_hidden(module):
        ctx.renamed = renamed
        register_cache_pytrees(module)
        fallback: ReuseFallback | None = None
        try:
            root, guard = _extract_root(ctx, args, kwargs, reuse=options.reuse_layers,
                                        watch=watch if options.reuse_layers else None)
        except ReuseFallback as unsafe:  # reuse turned out unsafe for this call: export every layer
            fallback = unsafe
        if fallback is not None:
            # outside the handler: the per-layer export's own failures must not carry the
            # fallback as their context (export failures are searched for a ReuseFallback)
            logger.info("layer reuse fell back to per-layer export: %s", fallback)
            ctx = ExtractionContext(module, options, path, ctx.on_extraction, child_dispatcher)
            ctx.renamed = renamed
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
                                                      {k: summarize(v) for k, v in kwargs.items()}))
    if watch is not None and fallback is None and options.reuse_layers:
        extraction.shared = _shared_root(extraction, args, kwargs, watch, path, ctx.templates)
    return extraction


def _shared_root(extraction: Extraction, args: tuple[Any, ...], kwargs: dict[str, Any], watch: RootWatch, path: str,
                 templates: dict[tuple[str, int], Any]) -> SharedRoot | None:
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


def extract_sibling(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], options: ExtractionOptions,
                    source: SharedRoot, index: int | None, *, child_dispatcher: ChildDispatcherFactory, path: str = "",
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
    guard = sibling_roots.sibling_guard(source.record.guard, source.shape, shape, tensor_leaves(args, kwargs),
                                        (args, kwargs))
    if guard is None:  # the representative's program does not serve these sizes
        return None
    quiet = dataclasses.replace(options, warn_on_compilation_failure=False, error_on_compilation_failure=False)
    with CALL_LOCK, generated_code_released(), cleared_module_state(module), offloaded_weights_loaded(module), \
            reserved_names_renamed(module) as renamed, aliases_hidden(module):
        ctx = ExtractionContext(module, quiet, path, on_extraction if on_extraction is not None else [],
                                child_dispatcher)
        ctx.renamed = renamed
        record = source.record
        rebound = sibling_roots.rebinding(shape, source, index)
        try:
            # copies of the representative's built graphs; it kept none of a submodule it built from
            # an identical submodule's graph (an expert): such a sibling is exported itself
            builder = GraphBuilder(ctx, torch.nn.Module(), {}, {}, source.input_spec, record.states, {}, (args, kwargs),
                                   ReusePlan(), sibling_roots.untouched_rebound(record.untouched, rebound))
            root = builder.from_shared(source.templates, module)
            if ctx.opaque:
                raise ReuseFallback(f"a graph of '{source.path}' could not be built here: {ctx.opaque}")
            graphs = [("", root), *((sub_path, sub) for sub_path, _, _, sub in walk(root)
                                    if isinstance(sub, CompiledGraphModule))]
            if input_prologue(root.graph) is not None:  # it would flatten the call with the representative's spec
                raise ReuseFallback("its root graph takes its inputs flattened")
            for sub_path, graph in graphs:
                if rebound is not None:
                    rebind_cache_state(graph, rebound, ctx.full(sub_path) or "<root>")
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


def _skip(ctx: ExtractionContext, module: torch.nn.Module) -> bool:
    return ctx.options.skip_compilation or type(module) in ctx.options.classes_to_skip_compiling


def _extract_root(ctx: ExtractionContext, args: tuple[Any, ...], kwargs: dict[str, Any], reuse: bool = False,
                  watch: RootWatch | None = None) -> tuple[CompiledGraphModule | OpaqueGraphModule, ShapeGuard]:
    module = ctx.module
    static = ShapeGuard.static(tensor_leaves(args, kwargs))
    if type(module) in ctx.options.custom_extraction_functions:
        try:
            return custom_graph(ctx, "", module), static
        except CustomFunctionFailed as failed:  # as graphpatch: a failing function means fallback
            reason = f"its custom extraction function failed: {describe_failure(failed.error)}"
            ctx.fail("", reason, failed.error, fix=CUSTOM_FIX)
            return opaque_module(ctx, "", module, args, kwargs, reason), static
    if _skip(ctx, module):
        ctx.opaque[ctx.full("") or "<root>"] = StubKind.SKIPPED
        return opaque_module(ctx, "", module, args, kwargs, StubKind.SKIPPED), static
    stubs: dict[str, str] = {  # a StubKind, or the reason an export failure made it opaque
        fqn: StubKind.CUSTOM if type(sub) in ctx.options.custom_extraction_functions else StubKind.SKIPPED
        for fqn, sub in named_real_modules(module)
        if fqn and (type(sub) in ctx.options.custom_extraction_functions
                    or type(sub) in ctx.options.classes_to_skip_compiling)}
    errors: dict[str, BaseException] = {}
    for fqn, reason in shared_container_entries(module).items():
        if fqn == "":
            ctx.fail("", reason, SharedModuleEntry(reason), fix=SharedModuleEntry.FIX)
            return opaque_module(ctx, "", module, args, kwargs, reason), static
        if fqn not in stubs:
            stubs[fqn], errors[fqn] = reason, SharedModuleEntry(reason)
    dynamic = ctx.options.dynamic_shapes
    # the call's structure before anything runs it: export may record a cache argument's spec
    # after the traced code mutated it (torch 2.13, static shapes)
    input_spec = copy_spec(pytree.tree_flatten((args, kwargs))[1])
    bar = tqdm(total=2, desc=f"extracting {type(module).__name__}", unit="stage", disable=not ctx.options.progress,
               leave=False)
    bar.set_postfix_str("torch.export")
    # a saved or cached export of this call (see .programs) replaces the loop below
    request = programs.ExportRequest(module, ctx.path, args, kwargs, ctx.options, ctx.grad_enabled)
    cache = default_cache() or memory_cache()  # the disk cache, else the process's (see .memory_cache)
    record = programs.lookup(request, cache)
    initial_stubs, initial_errors = dict(stubs), dict(errors)
    eager: _EagerStubs | None = None
    if record is None:  # an eager run finds modules to stub before the calls are recorded (one recording)
        eager = _eager_stubs(ctx, module, args, kwargs, stubs, errors)
        if eager.root is not None:
            bar.close()
            return _opaque_root(ctx, module, args, kwargs, eager.root), static
    else:
        stubs = dict(record.stubs)
        exported, dynamic, states = record.exported, record.dynamic, record.states
        untouched = record.untouched
        # a shared container entry's error (with its fix) is known again from the module itself
        errors = {fqn: errors[fqn] if isinstance(errors.get(fqn), SharedModuleEntry) and str(errors[fqn]) == reason
                  else programs.RecordedFailure(reason) for fqn, reason in stubs.items()}
    # (a record's plan is derived again from the module as it was derived before its export)
    candidates = reuse_plan(module, set(stubs if record is None else initial_stubs)) if reuse else ReusePlan()
    recorded = set(stubs) | set(candidates.siblings) | candidates.representatives()
    # (layers only compared for reuse keep their tensors shared: deep copies cost more than the run)
    compared = (set(candidates.siblings) | candidates.representatives()) - set(stubs)
    calls = record_calls(module, recorded, args, kwargs, shared=compared) if recorded else {}
    plan = confirm_reuse(module, candidates, calls)
    if record is not None and record.reuse != plan.siblings:
        # a record keeps the siblings its export stubbed; the plan is derived again for this call
        if record.reuse or not reuse:  # another plan than this call's: export again
            record, stubs, errors = None, initial_stubs, initial_errors
            eager = _eager_stubs(ctx, module, args, kwargs, stubs, errors)
            if eager.root is not None:
                bar.close()
                return _opaque_root(ctx, module, args, kwargs, eager.root), static
            calls = record_calls(module, recorded | set(stubs), args, kwargs) if recorded | set(stubs) else {}
        else:  # the export fell back to per-layer export for this call before: so does this build
            plan = ReusePlan()
    # a skipped module called with a cache is traced through (its new cache state must reach its
    # caller's graph) and only shown as opaque; the others are stubbed while exporting
    traced = {fqn for fqn in stubs if stubs[fqn] == StubKind.SKIPPED and any(state_keys(a, k) for a, k, _ in calls[fqn])}
    # traced modules whose own grad-mode changes are ignored while exporting
    frozen: set[str] = set(eager.frozen) if eager is not None else set()
    traced |= eager.traced if eager is not None else set()
    if record is None:
        untouched = {}
    watch_reads: list[str] | None = [] if watch is not None else None
    while record is None:
        frozen_by = scalar_stub_caller(module, stubs, traced, calls)
        if frozen_by is not None:
            caller, cause = frozen_by
            if caller == "":
                bar.close()
                ctx.fail("", describe_failure(cause), cause)
                return opaque_module(ctx, "", module, args, kwargs, describe_failure(cause)), static
            stubs[caller] = describe_failure(cause)
            errors[caller] = cause
            calls = record_calls(module, set(stubs), args, kwargs)
            continue
        try:
            exported, dynamic, states = export_module(module, args, kwargs,
                                                {f: r for f, r in stubs.items() if f not in traced}, calls, dynamic,
                                                ctx.grad_enabled, traced, frozen, plan, untouched, watch, watch_reads)
            # calls export recorded no node for (nn.Identity): unflatten would fail on them; they
            # run as themselves, called from their caller's graph (a stub records a node)
            empty = {fqn.partition("@")[0].partition(".")[2] for fqn in empty_module_calls(exported)} - {""} - set(stubs)
            if not empty:
                break
            for fqn in sorted(empty):
                stubs[fqn] = StubKind.PASSTHROUGH
            calls = record_calls(module, set(stubs), args, kwargs)
            continue
        except ModuleFailure as failure:
            fqn, error = failure.fqn, failure.error
            faults = [(fqn, error), *failure.more]
            if all(isinstance(e, UnfaithfulCaptureError) and f and f not in stubs for f, e in faults):
                # their code traces (shapes stay symbolic, cache state is threaded): keep tracing
                # through them, with grad-mode changes inside them ignored, and show them opaque
                for fqn, error in faults:
                    stubs[fqn] = describe_failure(error)
                    errors[fqn] = error
                    traced.add(fqn)
                    if cast(UnfaithfulCaptureError, error).grad_mode:  # all are, checked above
                        frozen.add(fqn)
                calls = record_calls(module, set(stubs), args, kwargs)
                continue
            while fqn and any(failure.states.get(fqn, [])):
                # a stub cannot write the cache state the module would have: its caller is opaque
                fqn = caller_of(module, fqn)
            if fqn == "" or fqn in stubs:
                bar.close()
                ctx.fail("", describe_failure(error), error)
                return opaque_module(ctx, "", module, args, kwargs, describe_failure(error)), static
            stubs[fqn] = describe_failure(error)
            errors[fqn] = error
            calls = record_calls(module, set(stubs), args, kwargs)
    for fqn, reason in stubs.items():
        if reason not in (StubKind.CUSTOM, StubKind.SKIPPED, StubKind.PASSTHROUGH):
            shared = isinstance(errors[fqn], SharedModuleEntry)
            ctx.fail(fqn, reason, errors[fqn], fix=SharedModuleEntry.FIX if shared else getattr(errors[fqn], "fix", None))
        elif reason != StubKind.CUSTOM:  # opaque by design, not by a failure: no warning, never an error
            ctx.opaque[ctx.full(fqn)] = reason
    plan = plan.outside(stubs)
    if plan.siblings:
        check_reused_export(plan, exported, stubs, states=states)
    guard = record.guard if record is not None else ShapeGuard.from_export(exported) if dynamic else static
    if record is None:
        record = programs.ProgramRecord(ctx.path, request.call_fingerprint(), exported, dynamic, states, dict(stubs),
                                        guard, dict(plan.siblings), untouched, watch_reads)
        programs.store(request, record, cache)
    bar.update()
    bar.set_postfix_str("unflatten and build graphs")
    try:  # as graphpatch: any failure while compiling (unflattening, building) means fallback
        # no op ran (``return x``, ``return 3``): unflatten (torch 2.13) makes no graph for the module
        holder = None
        if any(node.op == "call_function" for node in exported.graph.nodes):
            unflattened = unflatten(exported)
            unflattened_model = dict(unflattened.named_children()).get("model")
            holder = invocation_graphs(unflattened_model)[0] if unflattened_model is not None else None
        if holder is None or not isinstance(getattr(holder, "graph", None), Graph):
            bar.close()
            reason = "its forward runs no tensor operation: there is no graph to extract"
            ctx.fail("", reason, None)
            return opaque_module(ctx, "", module, args, kwargs, reason), static
        builder = GraphBuilder(ctx, unflattened, stubs, calls, input_spec, states, constant_outputs(exported),
                               (args, kwargs), plan, untouched)
        builder.number_calls(holder)
        builder.keep_all = watch is not None  # its sibling roots build their graphs from its built ones
        root = builder.build("", module, holder)
        ctx.templates = builder.templates
        # the record lives as long as its graphs: the process's memory cache refers to it weakly
        root.__dict__[PROGRAM_RECORD] = record
    except (ExtractionError, ReuseFallback):
        raise  # deliberate and loud (a malformed custom graph; a failure under the error option)
    except Exception as error:  # noqa: BLE001
        bar.close()
        reason = f"building its graph failed: {describe_failure(error)}"
        ctx.fail("", reason, error)
        return opaque_module(ctx, "", module, args, kwargs, reason), static
    bar.update()
    bar.close()
    return root, guard


class _EagerStubs(NamedTuple):
    """What :func:`_eager_stubs` added: modules traced through though shown opaque, those of them
    whose grad-mode changes are ignored, and why the root itself is opaque (reason, error, fix) or None."""

    traced: set[str]
    frozen: set[str]
    root: tuple[str, BaseException, str | None] | None


def _eager_stubs(ctx: ExtractionContext, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 stubs: dict[str, str], errors: dict[str, BaseException]) -> _EagerStubs:
    """Stub (in ``stubs`` and ``errors``) what one eager run of the call finds (see
    :func:`.capture_checks.eager_findings`), before the first export instead of after it failed."""
    found = eager_findings(module, args, kwargs, ctx.grad_enabled)
    traced: set[str] = set()
    frozen: set[str] = set()
    # modules that change grad mode: traced through with the change ignored from the first export
    # on, as after an export found them (one export, not two)
    for fqn in found.grad_mode:
        grad_change = UnfaithfulCaptureError(GRAD_MODE_REASON, grad_mode=True)
        if fqn == "":  # no caller's graph to trace it into: the module runs eagerly, as after its export failed
            return _EagerStubs(traced, frozen, (describe_failure(grad_change), grad_change, None))
        if fqn not in stubs:
            stubs[fqn], errors[fqn] = describe_failure(grad_change), grad_change
            traced.add(fqn)
            frozen.add(fqn)
    # modules whose code collects submodules' outputs with transformers' hooks: stubbed from the
    # first export on (export would fail on them, one export later)
    for fqn in found.capturing:
        capturing = CapturingOutputs(fqn)
        if fqn == "":
            return _EagerStubs(traced, frozen, (describe_failure(capturing), capturing, None))
        if fqn not in stubs:
            stubs[fqn], errors[fqn] = describe_failure(capturing), capturing
    # modules whose eager call may take a native fast path (nn.MultiheadAttention in eval mode
    # without grad): a trace takes the Python path, whose numbers differ; they run eagerly
    for fqn, op in found.fast_paths:
        fast = UnfaithfulCaptureError(f"may run the native fast path {op} in eager code (eval mode, no grad), which a"
                                      " trace does not take: a graph would compute the Python path's numbers")
        if fqn == "":
            return _EagerStubs(traced, frozen, (describe_failure(fast), fast, None))
        if fqn not in stubs:
            stubs[fqn], errors[fqn] = describe_failure(fast), fast
    # modules in which transformers skipped an sdpa mask that a graph would build, while another
    # attention function than transformers' stands for sdpa: traced through, shown opaque (their
    # own code runs, passing no mask as in eager)
    replaced = replaced_sdpa_functions(module) if found.mask_skips else {}
    for fqn in found.mask_skips if replaced else ():
        skip = UnfaithfulCaptureError(mask_skip_reason(replaced), fix=MASK_SKIP_FIX)
        if fqn == "":
            return _EagerStubs(traced, frozen, (describe_failure(skip), skip, MASK_SKIP_FIX))
        if fqn not in stubs:
            stubs[fqn], errors[fqn] = describe_failure(skip), skip
            traced.add(fqn)
    # modules whose code touches .data: export would fail on them at the root (see capture_checks)
    for fqn in found.data_access:
        data = UnfaithfulCaptureError(DATA_ACCESS_REASON)
        if fqn == "":
            return _EagerStubs(traced, frozen, (describe_failure(data), data, None))
        if fqn not in stubs:
            stubs[fqn], errors[fqn] = describe_failure(data), data
    return _EagerStubs(traced, frozen, None)


def _opaque_root(ctx: ExtractionContext, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 root: tuple[str, BaseException, str | None]) -> OpaqueGraphModule:
    reason, error, fix = root
    ctx.fail("", reason, error, fix=fix)
    return opaque_module(ctx, "", module, args, kwargs, reason)
