"""Turn a module into a hierarchy of patchable graphs: one graph per submodule invocation.

Route (measured on torch 2.13, see DESIGN.md): ``torch.export.export(strict=False)`` of the module
with every submodule's call signature preserved, under the caller's grad mode, then
``torch.export.unflatten`` with de-duplication off and codegen on. Each per-invocation graph is
cleaned (:mod:`.cleanup`) and becomes a :class:`CompiledGraphModule` whose parameters and buffers
are the original module's own tensors.

A submodule that cannot be exported is stubbed during export (its recorded output, still
depending on its inputs) and becomes an :class:`OpaqueGraphModule` whose children are extracted
separately; the rest stays a graph. So does a module whose graph would silently differ from its
code (grad-mode changes, custom autograd Functions, Python side effects, ``torch._dynamo.graph_break()``:
:mod:`.capture_checks`), one whose graph module cannot be built (any exception while unflattening or
building), and one whose custom extraction function raises, as graphpatch falls back. Submodules the
call never runs stay as opaque modules (graphpatch's ``allow_unused_submodules``), and every graph
module lists its children, parameters and buffers in the module's registration order.
Example::

    root, guard = extract(model, (input_ids,), {}, ExtractionOptions())
    root.transformer.h[0].attn      # CompiledGraphModule
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, Node
from ..compat.module_dicts import buffers_of, modules_of, parameters_of
from ..compat.pytree import pytree
from tqdm.auto import tqdm

from ..compat import (cleared_module_state, constant_outputs, copy_spec, export, forget_export_state,
                      generated_code_released, invocation_graphs, offloaded_weights_loaded, register_cache_pytrees,
                      unflatten)
from ..compat.output_capturing import active_collector, collector_suspended
from ..compat.fx import fx_patches_confined
from ..errors import ExtractionError, NNBridgeWarning, warn
from .call_structure import ShapeGuard, tensor_leaves
from .capture_checks import CaptureWatch, UnfaithfulCaptureError, preserved_state
from .cleanup import (EXTRA_ARGS_KEY, clean_graph, drop_unused_extras, input_prologue, name_nodes, plain_value,
                      remove_dead_code, restore_constant_outputs)
from .graph_module import NAME_KEY, CompiledGraphModule, MultiplyInvokedModule, OpaqueGraphModule
from .kinds import HookKind, StubKind
from .locking import CALL_LOCK, locked_calls
from .op_point import OpPoint, OpPointContainer
from . import programs
from .options import ExtractionOptions
from .state import Key, state_keys, states_returned
from .state_graphs import argument_objects, forward_state_objects, read_states_back, write_states_back

#: Names a child may not take in a graph module or in ``pg.graph``; such children get a trailing
#: ``_`` in NodePaths and as attributes (graphpatch mangled them too).
RESERVED_NAMES = frozenset(
    {"graph", "code", "_code", "_shape", "forward", "training", "output", "op_points"}
    | {name for name in dir(CompiledGraphModule) if not name.startswith("__")}
)
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def real_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and its submodules, without the op points a bridge registered on them."""
    return [m for _, m in named_real_modules(module)]


def named_real_modules(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """``named_modules()`` without op points and their per-invocation containers."""
    yield prefix, module
    for name, child in module.named_children():
        if not isinstance(child, (OpPoint, OpPointContainer)):
            yield from named_real_modules(child, f"{prefix}.{name}" if prefix else name)


def safe_name(name: str) -> str:
    """``name`` with a trailing ``_`` when it is reserved (``graph`` -> ``graph_``)."""
    return f"{name}_" if name in RESERVED_NAMES else name


class _Wrapper(torch.nn.Module):
    """Export root whose child ``model`` is the user's module, so the module's own call signature
    is preserved like every other submodule's."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.model = module

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.model(*args, **kwargs)


@contextlib.contextmanager
def reserved_names_renamed(module: torch.nn.Module) -> Iterator[dict[int, dict[str, str]]]:
    """Rename children whose names are reserved (``graph`` -> ``graph_``) for the body's duration.

    ``torch.export.unflatten`` cannot hold a submodule called ``graph`` and a GraphModule cannot
    hold one called ``_code``. The child moves to the safe key in ``_modules`` while an instance
    attribute keeps ``self.graph`` working in the module's own code. Yields
    ``{id(parent): {safe name: original name}}``; restores everything on exit, also on error.

    Raises:
        ExtractionError: the safe name is already taken by another child.
    """
    renamed: list[tuple[torch.nn.Module, str, str]] = []
    try:
        for parent in real_modules(module):
            for name in [n for n in modules_of(parent) if n in RESERVED_NAMES]:
                safe = safe_name(name)
                if safe in modules_of(parent):
                    raise ExtractionError(
                        f"{type(parent).__name__} has children named both {name!r} and {safe!r}; nnbridge renames"
                        f" {name!r} (reserved) to {safe!r} in NodePaths. Rename one of them.")
                child = modules_of(parent)[name]
                _rename_key(modules_of(parent), name, safe)  # in its place: registration order is kept
                parent.__dict__[name] = child
                renamed.append((parent, name, safe))
        mapping: dict[int, dict[str, str]] = {}
        for parent, name, safe in renamed:
            mapping.setdefault(id(parent), {})[safe] = name
        yield mapping
    finally:
        for parent, name, safe in reversed(renamed):
            parent.__dict__.pop(name, None)
            _rename_key(modules_of(parent), safe, name)  # the child keeps its place (state_dict order)


def _rename_key(store: dict[str, Any], old: str, new: str) -> None:
    """Rename key ``old`` of ``store`` to ``new`` in place, keeping its position."""
    items = list(store.items())
    store.clear()
    for key, value in items:
        store[new if key == old else key] = value


def _reorder(store: dict[str, Any], order: list[str]) -> None:
    """Reorder ``store`` in place: the keys in ``order`` first, in that order, then the others."""
    items = dict(store)
    store.clear()
    for name in [n for n in order if n in items] + [n for n in items if n not in order]:
        store[name] = items[name]


@contextlib.contextmanager
def aliases_hidden(module: torch.nn.Module) -> Iterator[None]:
    """Hide every further registration of a module object (``self.alias = self.linear``, or one
    child shared by two parents) from ``_modules`` for the body's duration.

    torch.export (2.13, non-strict) traces a model with shared submodules through attribute
    proxies whose paths break when a forward is overridden on the instance (``KeyError: 'linear'``
    in its tracepoint pass). The hidden name stays an instance attribute, so the module's code
    still reaches the child through it; export then knows the child by its first name only, and
    every call of it, under any name, is an invocation of that name (``linear_0``, ``linear_1``).
    Restores every registration in its place on exit, also on error.
    """
    hidden: list[tuple[torch.nn.Module, str, torch.nn.Module, list[str]]] = []
    seen = {id(module)}

    def visit(parent: torch.nn.Module) -> None:
        for name, child in list(modules_of(parent).items()):
            if child is None or isinstance(child, (OpPoint, OpPointContainer)):
                continue
            if id(child) in seen:
                hidden.append((parent, name, child, list(modules_of(parent))))
                del modules_of(parent)[name]
                parent.__dict__[name] = child
                continue
            seen.add(id(child))
            visit(child)
    try:
        visit(module)
        yield
    finally:
        for parent, name, child, order in reversed(hidden):
            parent.__dict__.pop(name, None)
            modules_of(parent)[name] = child
            _reorder(modules_of(parent), order)


def describe_failure(error: BaseException) -> str:
    """One-line reason for a failed export (``GuardOnDataDependentSymNode: ...``)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def direct_callees(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """Children a module's forward can call, looking through ModuleList/ModuleDict containers."""
    for name, child in module.named_children():
        if isinstance(child, (OpPoint, OpPointContainer)):
            continue
        if isinstance(child, _CONTAINERS):
            yield from direct_callees(child, f"{prefix}{name}.")
        else:
            yield prefix + name, child


def copy_inputs(value: Any) -> Any:
    """A copy of example inputs that extraction may run or trace without touching the caller's
    objects (a cache is mutated by the run). ``deepcopy`` when it works; else (tensors with autograd
    history cannot be deep-copied) a pytree copy with detached clones, which also rebuilds
    registered objects such as transformers' caches."""
    try:
        return copy.deepcopy(value)
    except Exception:
        def clone(t: torch.Tensor) -> torch.Tensor:
            copied = t.detach().clone()
            return copied.requires_grad_() if t.requires_grad and copied.is_floating_point() else copied
        return pytree.tree_map_only(torch.Tensor, clone, value)


def observed_run(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 hooks: list[tuple[torch.nn.Module, HookKind, Callable[..., None]]]) -> None:
    """One eager run of ``module`` on copies of the inputs (a cache would be mutated), no grad,
    with temporary hooks: ``(submodule, HookKind, fn)``, both with kwargs."""
    handles = []
    try:
        for sub, kind, fn in hooks:
            register = sub.register_forward_pre_hook if kind == HookKind.PRE else sub.register_forward_hook
            handles.append(register(fn, with_kwargs=True))
        with torch.no_grad():
            module(*copy_inputs(args), **copy_inputs(kwargs))
    finally:
        for handle in handles:
            handle.remove()


def record_calls(module: torch.nn.Module, fqns: set[str], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> dict[str, list[tuple[tuple[Any, ...], dict[str, Any], Any]]]:
    """One eager run recording ``(args, kwargs, output)`` of every call of the named submodules;
    the inputs are copied before the call (a cache argument is updated by it)."""
    calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any], Any]]] = defaultdict(list)
    pending: dict[str, list[tuple[Any, Any]]] = defaultdict(list)

    def before(fqn: str) -> Callable[..., None]:
        return lambda mod, a, k: pending[fqn].append((copy_inputs(a), copy_inputs(k)))

    def after(fqn: str) -> Callable[..., None]:
        return lambda mod, a, k, out: calls[fqn].append((*pending[fqn].pop(), copy_inputs(out)))
    observed_run(module, args, kwargs, [(module.get_submodule(fqn), kind, hook(fqn))
                                        for fqn in fqns for kind, hook in ((HookKind.PRE, before), (HookKind.POST, after))])
    return calls


def _stub_output(args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    """The recorded output as zeros that still depend on every tensor input (else export drops
    whatever computed the inputs, e.g. the integer ``position_ids`` a stubbed rotary embedding
    receives)."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    dep = sum((0 * t.sum().float() for t in tensors), torch.tensor(0.0))

    def stub(t: torch.Tensor) -> torch.Tensor:
        zeros = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
        return zeros + dep.to(t.dtype) if t.is_floating_point() else zeros
    return pytree.tree_map_only(torch.Tensor, stub, output)


@dataclass
class Extraction:
    """One extraction of a module for one call structure.

    Attributes:
        root: the extracted root (:class:`CompiledGraphModule` or :class:`OpaqueGraphModule`).
        guard: the tensor sizes it accepts.
        opaque: ``{module path: reason}`` for every module that fell back to opaque.
        example: summaries (``torch.Size`` for tensors) of the call it was extracted from.
        state: the module state it bakes in (:class:`~nnbridge.bridge.guards.StateGuard`), set by
            the dispatcher that made it.
        reason: why it was made: ``"first call"``, or the guard that failed for the call.
    """

    root: torch.nn.Module
    guard: ShapeGuard
    opaque: dict[str, str] = field(default_factory=dict)
    example: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    state: Any = None
    reason: str = "first call"


class _Context:
    def __init__(self, module: torch.nn.Module, options: ExtractionOptions, path: str,
                 on_extraction: list[Callable[[Any, Extraction], None]]):
        self.module = module
        self.options = options
        self.path = path
        self.on_extraction = on_extraction
        self.opaque: dict[str, str] = {}
        self.invocations: Counter[str] = Counter()
        self.renamed: dict[int, dict[str, str]] = {}
        self.grad_enabled = torch.is_grad_enabled()  # graphs follow the grad mode of the extracted call

    def full(self, fqn: str) -> str:
        return ".".join(p for p in (self.path, fqn) if p)

    def fail(self, fqn: str, reason: str, error: BaseException | None, fix: str | None = None) -> None:
        """Record an opaque fallback, honouring the warn/error options (``fix``: what the error
        message tells the user to do instead of the default advice)."""
        where = self.full(fqn) or "<root>"
        if self.options.error_on_compilation_failure and error is not None:
            raise ExtractionError(
                f"Could not extract a graph for module '{where}' ({type(self.module.get_submodule(fqn)).__name__}):"
                f" {reason}. " + (fix or "Fix the module's code for torch.export, add its class to "
                                  "ExtractionOptions.classes_to_skip_compiling, or set error_on_compilation_failure="
                                  "False to fall back to an opaque module.")
            ) from error
        if self.options.warn_on_compilation_failure and error is not None:
            warn(f"Module '{where}' is opaque (only its inputs, output, parameters and buffers are"
                 f" patchable): {reason}", NNBridgeWarning)
        self.opaque[where] = reason


def extract(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            options: ExtractionOptions | None = None, *, path: str = "",
            on_extraction: list[Callable[[Any, Extraction], None]] | None = None) -> Extraction:
    """Extract ``module`` for the call ``module(*args, **kwargs)``.

    The module is left exactly as it was: its hooks and instance ``forward`` overrides are cleared
    for the duration and restored, also when extraction raises; parameters, buffers, module
    attributes and the CPU random state are unchanged. Graphs are traced under the current grad
    mode (``torch.is_grad_enabled()``), so they are faithful to calls made in that mode.

    Args:
        module: the module; not modified, its parameters are shared with the result.
        args, kwargs: example inputs; graphs are specialised to their structure.
        options: :class:`ExtractionOptions` (defaults if None).
        path: NodePath prefix for messages (when extracting a child of an opaque module).
        on_extraction: callbacks run on every later extraction made by dispatchers in this tree.

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
            generated_code_released():
        try:
            return _extract(module, args, kwargs, options, path, on_extraction)
        finally:  # else torch's globals keep this trace, and through it the model, alive
            forget_export_state()


def _extract(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             options: ExtractionOptions | None, path: str,
             on_extraction: list[Callable[[Any, Extraction], None]] | None) -> Extraction:
    options = options or ExtractionOptions()
    ctx = _Context(module, options, path, on_extraction if on_extraction is not None else [])
    # extraction's eager runs must not consume random numbers (dropout in train mode) nor change
    # buffers (batch norm in train mode) or module attributes
    with preserved_state(list(named_real_modules(module))), cleared_module_state(module), \
            offloaded_weights_loaded(module), reserved_names_renamed(module) as renamed, aliases_hidden(module):
        ctx.renamed = renamed
        register_cache_pytrees(module)
        root, guard = _extract_root(ctx, args, kwargs)
    from .hierarchy import summarize, walk

    root.__dict__["node_path"] = path  # for failure notes (see .failures)
    for sub_path, _, _, sub in walk(root):  # type: ignore[arg-type]
        if sub is not None:
            sub.__dict__["node_path"] = f"{path}.{sub_path}" if path else sub_path

    return Extraction(root, guard, ctx.opaque, (tuple(summarize(a) for a in args),
                                                {k: summarize(v) for k, v in kwargs.items()}))


def _skip(ctx: _Context, module: torch.nn.Module) -> bool:
    return ctx.options.skip_compilation or type(module) in ctx.options.classes_to_skip_compiling


def _extract_root(ctx: _Context, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.nn.Module, ShapeGuard]:
    module = ctx.module
    static = ShapeGuard.static(tensor_leaves(args, kwargs))
    if type(module) in ctx.options.custom_extraction_functions:
        try:
            return _custom(ctx, "", module), static
        except _CustomFunctionFailed as failed:  # as graphpatch: a failing function means fallback
            reason = f"its custom extraction function failed: {describe_failure(failed.error)}"
            ctx.fail("", reason, failed.error, fix=_CUSTOM_FIX)
            return _opaque(ctx, "", module, args, kwargs, reason), static
    if _skip(ctx, module):
        ctx.opaque[ctx.full("") or "<root>"] = StubKind.SKIPPED
        return _opaque(ctx, "", module, args, kwargs, StubKind.SKIPPED), static
    stubs: dict[str, str] = {  # a StubKind, or the reason an export failure made it opaque
        fqn: StubKind.CUSTOM if type(sub) in ctx.options.custom_extraction_functions else StubKind.SKIPPED
        for fqn, sub in named_real_modules(module)
        if fqn and (type(sub) in ctx.options.custom_extraction_functions
                    or type(sub) in ctx.options.classes_to_skip_compiling)}
    errors: dict[str, BaseException] = {}
    dynamic = ctx.options.dynamic_shapes
    # the call's structure before anything runs it: export may record a cache argument's spec
    # after the traced code mutated it (torch 2.13, static shapes)
    input_spec = copy_spec(pytree.tree_flatten((args, kwargs))[1])
    bar = tqdm(total=2, desc=f"extracting {type(module).__name__}", unit="stage", disable=not ctx.options.progress,
               leave=False)
    bar.set_postfix_str("torch.export")
    # a saved or cached export of this call (see .programs) replaces the loop below
    request = programs.ExportRequest(module, ctx.path, args, kwargs, ctx.options, ctx.grad_enabled)
    record = programs.lookup(request)
    if record is not None:
        stubs = dict(record.stubs)
        exported, dynamic, states = record.exported, record.dynamic, record.states
        errors = {fqn: programs.RecordedFailure(reason) for fqn, reason in stubs.items()}
    calls = record_calls(module, set(stubs), args, kwargs) if stubs else {}
    # a skipped module called with a cache is traced through (its new cache state must reach its
    # caller's graph) and only shown as opaque; the others are stubbed while exporting
    traced = {fqn for fqn in stubs if stubs[fqn] == StubKind.SKIPPED and any(state_keys(a, k) for a, k, _ in calls[fqn])}
    frozen: set[str] = set()  # traced modules whose own grad-mode changes are ignored while exporting
    while record is None:
        frozen_by = _scalar_stub_caller(module, stubs, traced, calls)
        if frozen_by is not None:
            caller, cause = frozen_by
            if caller == "":
                bar.close()
                ctx.fail("", describe_failure(cause), cause)
                return _opaque(ctx, "", module, args, kwargs, describe_failure(cause)), static
            stubs[caller] = describe_failure(cause)
            errors[caller] = cause
            calls = record_calls(module, set(stubs), args, kwargs)
            continue
        try:
            exported, dynamic, states = _export(module, args, kwargs,
                                                {f: r for f, r in stubs.items() if f not in traced}, calls, dynamic,
                                                ctx.grad_enabled, traced, frozen)
            break
        except _ModuleFailure as failure:
            fqn, error = failure.fqn, failure.error
            faults = [(fqn, error), *failure.more]
            if all(isinstance(e, UnfaithfulCaptureError) and f and f not in stubs for f, e in faults):
                # their code traces (shapes stay symbolic, cache state is threaded): keep tracing
                # through them, with grad-mode changes inside them ignored, and show them opaque
                for fqn, error in faults:
                    stubs[fqn] = describe_failure(error)
                    errors[fqn] = error
                    traced.add(fqn)
                    if error.grad_mode:  # type: ignore[attr-defined]
                        frozen.add(fqn)
                calls = record_calls(module, set(stubs), args, kwargs)
                continue
            while fqn and any(failure.states.get(fqn, [])):
                # a stub cannot write the cache state the module would have: its caller is opaque
                fqn = _caller(module, fqn)
            if fqn == "" or fqn in stubs:
                bar.close()
                ctx.fail("", describe_failure(error), error)
                return _opaque(ctx, "", module, args, kwargs, describe_failure(error)), static
            stubs[fqn] = describe_failure(error)
            errors[fqn] = error
            calls = record_calls(module, set(stubs), args, kwargs)
    for fqn, reason in stubs.items():
        if reason not in (StubKind.CUSTOM, StubKind.SKIPPED):
            ctx.fail(fqn, reason, errors[fqn])
        elif reason == StubKind.SKIPPED:
            ctx.opaque[ctx.full(fqn)] = reason
    guard = record.guard if record is not None else ShapeGuard.from_export(exported) if dynamic else static
    if record is None:
        programs.store(request, programs.ProgramRecord(ctx.path, request.call_fingerprint(), exported, dynamic,
                                                       states, dict(stubs), guard))
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
            return _opaque(ctx, "", module, args, kwargs, reason), static
        builder = _Builder(ctx, unflattened, stubs, calls, input_spec, states, constant_outputs(exported),
                           (args, kwargs))
        builder.number_calls(holder)
        root = builder.build("", module, holder)
    except ExtractionError:
        raise  # deliberate and loud (a malformed custom graph; a failure under the error option)
    except Exception as error:  # noqa: BLE001
        bar.close()
        reason = f"building its graph failed: {describe_failure(error)}"
        ctx.fail("", reason, error)
        return _opaque(ctx, "", module, args, kwargs, reason), static
    bar.update()
    bar.close()
    return root, guard


_SCALARS = (bool, int, float, complex, str)


def _scalar_stub_caller(module: torch.nn.Module, stubs: dict[str, str], traced: set[str],
                        calls: dict[str, list]) -> tuple[str, UnfaithfulCaptureError] | None:
    """The caller of a stub that returned Python scalars, which must then run its own code too.

    A stub replays its recorded output while export traces the caller, so an ``int`` it returned
    (``int(x.argmax())``, a size) would be frozen into the caller's graph as a constant, wrong for
    the next input. Returns ``(caller path, reason)`` for the first such stub whose callers are
    not stubbed already, else None. Modules export traces through (``traced``) return their real
    values (symbolic or specialised), so they are not concerned.
    """
    for fqn in stubs:
        if fqn in traced or stubs[fqn] == StubKind.CUSTOM:
            continue
        values = [leaf for _, _, out in calls.get(fqn, []) for leaf in pytree.tree_leaves(out)
                  if isinstance(leaf, _SCALARS)]
        if not values:
            continue
        caller = _caller(module, fqn)
        if any(other != fqn and (not other or fqn.startswith(f"{other}.")) for other in stubs):
            continue  # an enclosing module already runs its own code
        return caller, UnfaithfulCaptureError(
            f"calls '{fqn}', which runs its own code and returned the Python value {values[0]!r}"
            f" ({type(values[0]).__name__}); a graph would keep the value of the extracted call")
    return None


class _CapturingOutputs(Exception):
    """A module's body collects its submodules' outputs with transformers' hooks
    (``output_attentions=True``, ``output_hidden_states=True``): the collected values cross the
    preserved call signatures of the modules in between, which one graph cannot express."""

    def __init__(self, fqn: str):
        super().__init__(
            "transformers collects outputs of its submodules with hooks here (output_attentions or"
            " output_hidden_states); the module runs its own code and its children are graphs")
        self.fqn = fqn


def _capturing_cause(error: BaseException | None) -> _CapturingOutputs | None:
    """The :class:`_CapturingOutputs` behind ``error`` (export may wrap it), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, _CapturingOutputs):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class _ModuleFailure(Exception):
    def __init__(self, fqn: str, error: BaseException, states: dict[str, list[list[Key]]],
                 more: list[tuple[str, BaseException]] | None = None):
        super().__init__(fqn)
        self.fqn, self.error, self.states = fqn, error, states
        self.more = more or []  # further modules at fault found by the same export


def _caller(module: torch.nn.Module, fqn: str) -> str:
    """Path of the module that calls ``fqn`` (its parent, looking through ModuleList/ModuleDict)."""
    parent = fqn.rpartition(".")[0]
    while parent and isinstance(module.get_submodule(parent), _CONTAINERS):
        parent = parent.rpartition(".")[0]
    return parent


def _export(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], stubs: dict[str, str],
            calls: dict[str, list], dynamic: bool, grad_enabled: bool = False,
            traced: set[str] = frozenset(), frozen: set[str] = frozenset()  # type: ignore[assignment]
            ) -> tuple[torch.export.ExportedProgram, bool, dict[str, list[list[Key]]]]:
    """Export once (dynamic, then static on failure); raise _ModuleFailure naming the innermost
    module that was running when export failed.

    Every module keeps its call signature and threads the state of stateful arguments (see
    :mod:`.state`). ``stubs`` are replaced by their recorded output; one called with a stateful
    argument (only a custom-extraction module can be: a failing one makes its caller opaque)
    keeps a flat signature, since its recorded output cannot carry the state it would have
    written. ``traced`` modules will be opaque although export traces them; inside ``frozen`` ones,
    grad-mode changes are ignored (see :mod:`.capture_checks`). Returns the program, whether it is dynamic, and the state keys of every threaded
    call (``{path: [keys per invocation]}``).
    """
    wrapper = _Wrapper(module)
    flat = {fqn for fqn in stubs if any(state_keys(a, k) for a, k, _ in calls.get(fqn, []))}
    preserved = {n: m for n, m in named_real_modules(module) if not isinstance(m, _CONTAINERS) and n not in flat}
    fqns = tuple(f"model.{n}" if n else "model" for n in preserved)
    threaded = {n: m for n, m in preserved.items() if n not in stubs}
    active: list[str] = []
    handles = []

    collectors: list[Any] = []  # transformers' output collector when each active module was entered

    def enter(fqn: str) -> Callable[..., None]:
        def hook(mod: torch.nn.Module, inputs: Any) -> None:
            collector = active_collector()
            if collector is not None and collectors and collectors[-1] is not collector:
                # the caller's body started collecting outputs with hooks (output_attentions...)
                raise _CapturingOutputs(active[-1])
            active.append(fqn)
            collectors.append(collector)
        return hook

    def leave(mod: torch.nn.Module, inputs: Any, output: Any) -> None:
        active.pop()
        collectors.pop()

    for fqn, sub in named_real_modules(module):
        handles.append(sub.register_forward_pre_hook(enter(fqn)))
        handles.append(sub.register_forward_hook(leave))
    stub_counters: Counter[str] = Counter()
    for fqn in stubs:
        recorded = calls.get(fqn, [])

        def stub(*a: Any, _fqn: str = fqn, _recorded: list = recorded, **k: Any) -> Any:
            i = stub_counters[_fqn]
            stub_counters[_fqn] += 1
            return _stub_output(a, k, _recorded[min(i, len(_recorded) - 1)][2])
        module.get_submodule(fqn).__dict__["forward"] = stub
    try:
        attempts = [True, False] if dynamic else [False]
        last: BaseException | None = None
        states: dict[str, list[list[Key]]] = {}
        for use_dynamic in attempts:
            active.clear()
            collectors.clear()
            stub_counters.clear()
            # size-1 dimensions are specialised by export anyway (0/1 specialisation); leaving them
            # out of the spec saves ~20 % of export time on GPT-2 (2.4 -> 2.0 s, 12 layers)
            shapes = _dynamic_shapes(args, kwargs) if use_dynamic else None
            watch = CaptureWatch(list(named_real_modules(module)), active, set(stubs) | traced)
            try:
                # non-strict export runs the module's Python code, which mutates a cache passed in
                # (with fake tensors): every attempt traces a fresh copy of the inputs
                with states_returned(threaded) as states, watch.watching(frozen):
                    exported = export(wrapper, copy_inputs((args, kwargs)), dynamic_shapes=shapes,
                                      preserve_module_call_signature=fqns, grad_enabled=grad_enabled)
            except Exception as error:  # noqa: BLE001 - any export failure means fallback
                last = error
                capturing = _capturing_cause(error)
                if capturing is not None:  # trying static shapes would not help
                    raise _ModuleFailure(capturing.fqn, capturing, states) from error
                failing = active[-1] if active else ""
                continue
            faults = watch.faults(exported)  # traced, but a graph would differ from the eager code
            if faults:
                raise _ModuleFailure(faults[0][0], faults[0][1], states, faults[1:])
            return exported, use_dynamic, states
        raise _ModuleFailure(failing, last, states)  # type: ignore[arg-type]
    finally:
        for handle in handles:
            handle.remove()
        for fqn in stubs:
            module.get_submodule(fqn).__dict__.pop("forward", None)


def _dim_spec(leaf: Any) -> Any:
    # size-1 dimensions are specialised by export anyway (0/1 specialisation); leaving them
    # out of the spec saves ~20 % of export time on GPT-2 (2.4 -> 2.0 s, 12 layers)
    if isinstance(leaf, torch.Tensor):
        return {i: torch.export.Dim.AUTO for i in range(leaf.dim()) if leaf.shape[i] > 1}
    return None


def _dynamic_shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``Dim.AUTO`` for every dimension of every tensor; a custom pytree argument (a transformers
    ``Cache``) gets the flat list of its leaves' specs, the form export expects for such nodes."""
    def spec(value: Any) -> Any:
        if plain_value(value):
            return pytree.tree_map(_dim_spec, value)
        return [_dim_spec(leaf) for leaf in pytree.tree_leaves(value)]
    return tuple(spec(a) for a in args), {k: spec(v) for k, v in kwargs.items()}


def _resolve_attr(owner: torch.nn.Module, target: str) -> Any:
    value: Any = owner
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _persistent(owner: torch.nn.Module, target: str) -> bool:
    *prefix, name = target.split(".")
    holder = owner.get_submodule(".".join(prefix)) if prefix else owner
    return name not in getattr(holder, "_non_persistent_buffers_set", set())


def _attach(parent: torch.nn.Module, target: str, child: torch.nn.Module, template: torch.nn.Module) -> None:
    """Set ``parent.<target> = child``, creating containers of the same types as in ``template``."""
    *prefix, name = target.split(".")
    holder, original = parent, template
    for part in prefix:
        original = modules_of(original).get(part) if original is not None else None
        existing = modules_of(holder).get(part)
        if existing is None:
            existing = type(original)() if isinstance(original, _CONTAINERS) else torch.nn.Module()
            holder.add_module(part, existing)
        holder = existing
    holder.add_module(name, child)


class _Builder:
    """Builds the mirror hierarchy from an unflattened export."""

    def __init__(self, ctx: _Context, unflattened: torch.nn.Module, stubs: dict[str, str], calls: dict[str, list],
                 input_spec: pytree.TreeSpec | None = None, states: dict[str, list[list[Key]]] | None = None,
                 constants: dict[tuple[str, int], dict[int, Any]] | None = None,
                 example: tuple[tuple[Any, ...], dict[str, Any]] = ((), {})):
        self.ctx, self.unflattened, self.stubs, self.calls = ctx, unflattened, stubs, calls
        self.input_spec = input_spec
        self.states = states or {}
        self.constants = constants or {}  # {(program path, invocation): {output leaf: value}}
        self.example = example  # the extracted call of the root (to record a fallback's calls)
        self.numbers: dict[Node, int] = {}  # {submodule call: its invocation}, see number_calls

    def number_calls(self, holder: torch.nn.Module) -> None:
        """Number every submodule call of the unflattened graphs, from the root graph ``holder``
        down, before any graph is built: invocation ``k`` of a module is its ``k``-th call in
        the program, also when an earlier caller's graph is dead code or fell back to opaque
        half-built (a running count while building would then hand later calls the wrong graph).
        Stubbed modules' children are not numbered (they are extracted separately)."""
        counts: Counter[str] = Counter()

        def walk(fqn: str, graph_holder: torch.nn.Module) -> None:
            graph: Graph = getattr(graph_holder, "graph")
            for node in graph.nodes:
                if node.op != "call_module":
                    continue
                child_fqn = f"{fqn}.{node.target}" if fqn else str(node.target)
                self.numbers[node] = invocation = counts[child_fqn]
                counts[child_fqn] += 1
                if child_fqn not in self.stubs:
                    walk(child_fqn, invocation_graphs(self.unflattened.get_submodule(f"model.{child_fqn}"))[invocation])
        try:
            walk("", holder)
        except Exception:  # noqa: BLE001 - an unexpected structure: count while building instead
            self.numbers.clear()

    def state_keys(self, fqn: str, invocation: int) -> list[Key]:
        """The state keys export recorded for this invocation ([] when it had no stateful argument)."""
        recorded = self.states.get(fqn, [])
        return recorded[invocation] if invocation < len(recorded) else []

    def child(self, fqn: str, module: torch.nn.Module, invocation: int) -> torch.nn.Module:
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
            return self.opaque(fqn, module, invocation, self.stubs[fqn])
        try:
            graphs = invocation_graphs(self.unflattened.get_submodule(f"model.{fqn}"))
            return self.build(fqn, module, graphs[invocation], invocation)
        except ExtractionError:
            raise  # deliberate and loud (a malformed custom graph; a failure under the error option)
        except Exception as error:  # noqa: BLE001 - any other failure means fallback (or a loud error)
            if self.state_keys(fqn, invocation):  # an opaque module cannot hand its cache state back
                raise
            reason = f"building its graph failed: {describe_failure(error)}"
            self.ctx.fail(fqn, reason, error)
            return self.opaque(fqn, module, invocation, reason)

    def recorded_call(self, fqn: str, invocation: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of invocation ``invocation`` of ``fqn`` in the extracted call."""
        if fqn not in self.calls:
            self.calls.update(record_calls(self.ctx.module, {fqn}, *self.example))
        recorded = self.calls.get(fqn, [])
        args, kwargs, _ = recorded[min(invocation, len(recorded) - 1)]
        return args, kwargs

    def opaque(self, fqn: str, module: torch.nn.Module, invocation: int, reason: str) -> OpaqueGraphModule:
        return _opaque(self.ctx, fqn, module, *self.recorded_call(fqn, invocation), reason)

    def custom(self, fqn: str, module: torch.nn.Module, invocation: int) -> torch.nn.Module:
        """The graph of a custom extraction function; opaque when the function raises (as
        graphpatch's ``custom_extraction_functions``), per the warn/error options."""
        try:
            return _custom(self.ctx, fqn, module)
        except _CustomFunctionFailed as failed:
            reason = f"its custom extraction function failed: {describe_failure(failed.error)}"
            self.ctx.fail(fqn, reason, failed.error, fix=_CUSTOM_FIX)
            return self.opaque(fqn, module, invocation, reason)

    def build(self, fqn: str, module: torch.nn.Module, holder: torch.nn.Module,
              invocation: int = 0) -> CompiledGraphModule:
        graph: Graph = holder.graph
        attrs = {str(n.target): _resolve_attr(holder, str(n.target)) for n in graph.nodes if n.op == "get_attr"}
        restore_constant_outputs(graph, self.constants.get((f"model.{fqn}" if fqn else "model", invocation), {}))
        keys = self.state_keys(fqn, invocation)
        if keys:
            write_states_back(graph, attrs, keys)
        arguments = argument_objects(graph, attrs)
        if fqn == "" and self.input_spec is not None:
            prologue = input_prologue(graph)
            if prologue is not None:
                target = str(prologue.args[1].target)
                attrs[target] = self.input_spec
                setattr(holder, target, self.input_spec)
        extras = clean_graph(graph, attrs)
        calls = [n for n in graph.nodes if n.op == "call_module"]
        per_target = Counter(str(n.target) for n in calls)
        local: Counter[str] = Counter()
        children: list[tuple[str, torch.nn.Module]] = []
        call_names: dict[Node, str] = {}
        multi: set[str] = set()
        threaded: list[tuple[Node, list[Key], int]] = []
        for node in calls:
            target = str(node.target)
            child_fqn = f"{fqn}.{target}" if fqn else target
            invocation = self.numbers[node] if node in self.numbers else self.ctx.invocations[child_fqn]
            self.ctx.invocations[child_fqn] = invocation + 1
            child = self.child(child_fqn, module.get_submodule(target), invocation)
            extra = node.meta.get(EXTRA_ARGS_KEY, 0)
            if getattr(child, "exact_signature", True):
                node.args, extra = node.args[extra:], 0
            if self.state_keys(child_fqn, invocation):  # recorded for modules export traced through
                read_states_back(graph, node, self.state_keys(child_fqn, invocation), extra)
                threaded.append((node, self.state_keys(child_fqn, invocation), extra))
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
            node.meta[MODULE_PATH_KEY] = _original_path(self.ctx, module, target)
        forward_state_objects(graph, attrs, threaded, arguments)
        remove_dead_code(graph)
        exact_signature = drop_unused_extras(graph, extras)
        name_nodes(graph, type(module).forward, call_names)
        root: dict[str, Any] = {}
        for node in graph.nodes:
            if node.op == "get_attr":
                target = str(node.target)
                try:  # the module's own tensor (shared); never an op point a bridge registered
                    value = _resolve_attr(module, target)
                except AttributeError:
                    value = None
                root[target] = value if isinstance(value, torch.Tensor) else attrs[target]
        cgm = CompiledGraphModule({**root, **dict(children)}, graph, type(module))
        cgm.__dict__["exact_signature"] = exact_signature
        _retype_containers(cgm, [target for target, _ in children], _renamed_template(module), multi)
        for target, tensor in root.items():
            if isinstance(tensor, torch.Tensor) and not isinstance(tensor, torch.nn.Parameter):
                if not _persistent(module, target):
                    *prefix, name = target.split(".")
                    cgm.get_submodule(".".join(prefix)).register_buffer(name, tensor, persistent=False)
        _keep_unused(self.ctx, fqn, cgm, module)
        _registration_order(cgm, module)
        if self.ctx.options.postprocessing_function is not None:
            self.ctx.options.postprocessing_function(cgm, module)
            cgm.recompile()
        return cgm


#: ``node.meta`` key on a submodule call: the callee's path relative to the caller, as the user
#: spells it (``h.0``, ``graph``), whatever the graph attribute is called (``h.0``, ``graph_``).
MODULE_PATH_KEY = "nnbridge_module_path"


def _original_path(ctx: _Context, module: torch.nn.Module, target: str) -> str:
    holder, parts = module, []
    for part in target.split("."):
        parts.append(ctx.renamed.get(id(holder), {}).get(part, part))
        holder = modules_of(holder)[part]
    return ".".join(parts)


def _retype_containers(cgm: torch.nn.Module, targets: list[str], template: torch.nn.Module,
                       multi: set[str]) -> None:
    """fx creates plain ``nn.Module``s on the way to dotted targets; give them the original container
    types (``ModuleList``/``ModuleDict``), or MultiplyInvokedModule for per-invocation lists."""
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts)):
            path = ".".join(parts[:i])
            original: torch.nn.Module | None = template
            for part in parts[:i]:
                original = modules_of(original).get(part) if original is not None else None
            kind = MultiplyInvokedModule if path in multi else (
                type(original) if isinstance(original, _CONTAINERS) else None)
            current = cgm.get_submodule(path)
            if kind is None or type(current) is kind:
                continue
            retyped = kind()
            modules_of(retyped).update(modules_of(current))
            *prefix, name = path.split(".")
            modules_of(cgm.get_submodule(".".join(prefix)) if prefix else cgm)[name] = retyped


def _renamed_template(module: torch.nn.Module) -> torch.nn.Module:
    """A view of ``module``'s children keyed by their safe names (for container types)."""
    view = torch.nn.Module()
    for name, child in module.named_children():
        modules_of(view)[safe_name(name)] = child
    return view


#: Reason recorded for a submodule the extracted call never ran.
UNUSED_REASON = "not invoked during extraction"
_CUSTOM_FIX = ("Fix the function, remove the module's class from ExtractionOptions.custom_extraction_functions, or"
               " set error_on_compilation_failure=False to fall back to an opaque module.")
_UNUSED_FIX = ("Call it in the example inputs, or set allow_unused_submodules=True (the default unless"
               " error_on_compilation_failure is set) to keep it as an opaque module.")


class NeverCalledError(ExtractionError):
    """A submodule was never called by the example inputs (graphpatch's ``NoRecordedInvocations``)."""


def _user_children(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``module``'s children in registration order, without op points (names as in ``_modules``)."""
    for name, child in modules_of(module).items():
        if child is not None and not isinstance(child, (OpPoint, OpPointContainer)):
            yield name, child


def _unused(ctx: _Context, fqn: str, module: torch.nn.Module, top: bool = True) -> torch.nn.Module:
    """A submodule the extracted call never ran, as graphpatch keeps it: an :class:`OpaqueGraphModule`
    (its own code, parameters and buffers) with its children likewise; containers keep their type.
    With ``allow_unused_submodules`` off it is a compilation failure (see :class:`ExtractionOptions`).

    Raises:
        ExtractionError: ``allow_unused_submodules`` is off and ``error_on_compilation_failure`` on.
    """
    if isinstance(module, _CONTAINERS):
        container = type(module)()
        for name, child in _user_children(module):
            modules_of(container)[name] = _unused(ctx, f"{fqn}.{name}", child, top)
        return container
    if not top:  # inside an unused module: reported with it
        pass
    elif not ctx.options.allow_unused_submodules:
        ctx.fail(fqn, "it was never called by the example inputs", NeverCalledError(
            f"'{ctx.full(fqn)}' was never called when running the example inputs"), fix=_UNUSED_FIX)
    elif ctx.options.warn_on_compilation_failure:  # as graphpatch: told, though allowed
        warn(f"Module '{ctx.full(fqn)}' was never called by the example inputs; it is kept as an opaque module")
    children = {name: _unused(ctx, f"{fqn}.{name}", child, top=False) for name, child in _user_children(module)}
    return OpaqueGraphModule(module, UNUSED_REASON, children, {})


def _keep_unused(ctx: _Context, fqn: str, cgm: torch.nn.Module, module: torch.nn.Module) -> None:
    """Give ``cgm`` every child of ``module`` the graph never calls (see :func:`_unused`), also
    inside ModuleList/ModuleDict containers, so its parameters and buffers are the module's."""
    # a child registered under several names (``self.alias = self.linear``) was called if any name was
    called = {id(child) for name, child in _user_children(module) if name in modules_of(cgm)}

    def fill(holder: torch.nn.Module, original: torch.nn.Module, prefix: str) -> None:
        for name, child in _user_children(original):
            path = f"{prefix}.{name}" if prefix else name
            existing = modules_of(holder).get(name)
            if existing is None and id(child) not in called:
                modules_of(holder)[name] = _unused(ctx, path, child)
            elif isinstance(child, _CONTAINERS) and type(existing) is type(child):
                fill(existing, child, path)
    fill(cgm, module, fqn)


def _registration_order(cgm: torch.nn.Module, module: torch.nn.Module) -> None:
    """Order ``cgm``'s children, parameters and buffers (and those of its ModuleList/ModuleDict
    children) as ``module`` registered them, not as the graph calls them: ``named_parameters()``
    and ``state_dict()`` then list them in the module's order (graphpatch restores it too)."""
    _reorder(parameters_of(cgm), list(parameters_of(module)))
    _reorder(buffers_of(cgm), list(buffers_of(module)))
    _reorder(modules_of(cgm), list(modules_of(module)))
    for name, child in modules_of(cgm).items():
        original = modules_of(module).get(name)
        if isinstance(child, _CONTAINERS) and original is not None and type(child) is type(original):
            _registration_order(child, original)


class _CustomFunctionFailed(Exception):
    """A custom extraction function raised ``error`` (the module then falls back to opaque)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def _custom(ctx: _Context, fqn: str, module: torch.nn.Module) -> CompiledGraphModule:
    """A graph from a user's custom extraction function (graphpatch's custom_extraction_functions).

    Raises:
        _CustomFunctionFailed: the function raised.
        ExtractionError: the graph it returned is malformed (a mistake in the function: always loud).
    """
    try:
        graph = ctx.options.custom_extraction_functions[type(module)](module)
    except Exception as error:  # noqa: BLE001 - the caller falls back to opaque (or raises)
        raise _CustomFunctionFailed(error) from error
    output = next(n for n in graph.nodes if n.op == "output")
    value = output.args[0]
    if not (isinstance(value, tuple) and len(value) == 1):
        raise ExtractionError(
            f"The custom extraction function for {type(module).__name__} (module '{ctx.full(fqn) or '<root>'}')"
            f" returned a graph whose output is {type(value).__name__}, not a 1-tuple; wrap the output as"
            " graph.output((value,)) as graphpatch documents.")
    output.args = (value[0],)
    expected = [p for p in list(inspect.signature(type(module).forward).parameters)[1:]]
    got = [str(n.target) for n in graph.nodes if n.op == "placeholder"]
    if got != expected[: len(got)]:
        raise ExtractionError(
            f"The custom extraction function for {type(module).__name__} (module '{ctx.full(fqn) or '<root>'}')"
            f" has placeholders {got}; they must be named exactly as forward()'s arguments {expected}.")
    for node in graph.nodes:
        node.meta[NAME_KEY] = "output" if node.op == "output" else (
            str(node.target) if node.op == "placeholder" else node.name)
    root = {str(n.target): _resolve_attr(module, str(n.target)) for n in graph.nodes if n.op in ("get_attr", "call_module")}
    cgm = CompiledGraphModule(root, graph, type(module))
    if ctx.options.postprocessing_function is not None:
        ctx.options.postprocessing_function(cgm, module)
        cgm.recompile()
    return cgm


def _opaque(ctx: _Context, fqn: str, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            reason: str) -> OpaqueGraphModule:
    """Opaque fallback: run the original code, extract each called child from its first call."""
    from .dispatcher import GraphDispatcher

    callees = list(direct_callees(module))
    captured: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def grabber(name: str) -> Callable[..., None]:
        return lambda m, a, k: captured.setdefault(name, (copy_inputs(a), copy_inputs(k))) and None
    observed_run(module, args, kwargs, [(child, HookKind.PRE, grabber(name)) for name, child in callees])
    shown = torch.nn.Module()
    swapped = torch.nn.Module()
    dispatchers: dict[str, GraphDispatcher] = {}
    template = _renamed_template(module)
    for name, child in callees:
        child_path = ctx.full(f"{fqn}.{name}" if fqn else name)
        first, *rest = name.split(".")
        safe = ".".join([safe_name(first), *rest])
        original_name = ".".join([ctx.renamed.get(id(module), {}).get(first, first), *rest])
        if name not in captured:
            _attach(shown, safe, _unused(ctx, f"{fqn}.{name}" if fqn else name, child), template)
            _attach(swapped, original_name, child, module)
            continue
        a, k = captured[name]
        dispatcher = GraphDispatcher(child, ctx.options, path=child_path, on_extraction=ctx.on_extraction)
        first_extraction = dispatcher.add_extraction(a, k)
        ctx.opaque.update(first_extraction.opaque)
        _attach(shown, safe, first_extraction.root, template)
        _attach(swapped, original_name, dispatcher, module)
        dispatchers[safe.replace(".", "_")] = dispatcher
    opaque = OpaqueGraphModule(module, reason, dict(modules_of(shown)), dict(modules_of(swapped)))
    opaque.__dict__["child_dispatchers"] = dispatchers
    return opaque
