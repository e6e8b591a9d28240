"""Shims over private ``torch.export`` / ``torch.fx`` internals used by extraction.

Every private torch attribute nnbridge touches lives in this package, one small named shim each,
so a torch upgrade breaks in one place. Verified on torch 2.13.0.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import re
import sys
import threading
import warnings
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch.fx import _lazy_graph_module

from .. import registry
from .duck_sizing import duck_sized as duck_sized_dims
from .fake_tensors import fake_tensor_cache_off
from .pytree import pytree
from .stack_traces import helper_frames_recorded
from .tracepoints import string_arguments_traced, tracepoint_bookkeeping_skipped
from .unbacked import unbacked_bindings_pass_narrowed

# torch.export.unflatten the *module* is shadowed by the function of the same name.
_unflatten_module = sys.modules["torch.export.unflatten"]


@contextlib.contextmanager
def no_module_deduplication() -> Iterator[None]:
    """Keep one graph per module invocation in ``torch.export.unflatten``.

    torch >= 2.5 merges repeated calls whose graphs are identical into one submodule
    (``_deduplicate_modules``); nnbridge patches invocations independently, as graphpatch's
    MultiplyInvokedModule did, so de-duplication is switched off for the duration.
    """
    with registry.replaced("no_module_deduplication", _unflatten_module, "_deduplicate_modules",
                           value=lambda partitions: {}):
        yield


@contextlib.contextmanager
def quiet_torch_export() -> Iterator[None]:
    """Silence two warnings torch 2.13's own export/unflatten code emits on every call.

    ``isinstance(treespec, LeafSpec)`` (FutureWarning from torch's pytree internals) and
    "Attempted to insert a get_attr Node with no underlying reference" (unflatten inserts its
    ``_spec_N`` attributes after creating the nodes) say nothing the user can act on.
    """
    # torch._export.non_strict_utils logs "0/1 specialized; Dim.AUTO was specified..." for every
    # size-1 dimension: expected, since nnbridge marks every dimension Dim.AUTO on purpose.
    logger = logging.getLogger("torch._export.non_strict_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node", category=UserWarning)
            # a tensor cached on a module in forward: nnbridge makes that module opaque instead
            warnings.filterwarnings("ignore", message=r"The tensor attributes? .* assigned during export",
                                    category=UserWarning)
            yield
    finally:
        logger.setLevel(level)


class _DistinctConversions(torch.overrides.TorchFunctionMode):
    """Make tensor conversions return a new tensor object while torch.export traces.

    ``x.to(x.dtype)``, ``x.float()`` on a float tensor, ``x.contiguous()`` on a contiguous one...
    return ``x`` itself. Export's proxy tracking then relabels ``x`` with the conversion's node,
    so a value created inside a submodule (``input_layernorm``'s ``to``) leaks into the caller
    (``residual``), and unflatten (torch 2.13) treats it as a functionalized mutation and writes it
    back with ``aten.copy_``: numerically a no-op, but an in-place write that breaks autograd.
    Converting an ``aten.alias`` of ``x`` instead gives the result a node of its own.
    """

    _CONVERSIONS = frozenset({torch.Tensor.to, torch.Tensor.float, torch.Tensor.double, torch.Tensor.half,
                              torch.Tensor.bfloat16, torch.Tensor.type_as, torch.Tensor.contiguous,
                              torch.Tensor.cpu, torch.Tensor.type, torch.Tensor.int, torch.Tensor.long,
                              torch.Tensor.bool})

    def __torch_function__(self, func: Callable[..., Any], types: Collection[type], args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func in self._CONVERSIONS and args and isinstance(args[0], torch.Tensor):
            args = (torch.ops.aten.alias.default(args[0]), *args[1:])
        return func(*args, **(kwargs or {}))


def export(module: torch.nn.Module, args: tuple[Any, ...], *, dynamic_shapes: Any,
           preserve_module_call_signature: tuple[str, ...], grad_enabled: bool = False,
           duck_sized: Collection[torch.Tensor] = ()) -> torch.export.ExportedProgram:
    """``torch.export.export(strict=False)`` under the grad mode of the call being extracted (a
    ``torch.is_grad_enabled()`` branch takes the same side as eager; under ``torch.no_grad()``,
    ``@torch.no_grad`` rotary-embedding code is inlined instead of becoming a higher-order op), with
    conversions kept from aliasing (see :class:`_DistinctConversions`) and stack traces that reach
    into the helper functions a forward calls (see :mod:`.stack_traces`).

    ``duck_sized``: input tensors (leaves of ``args``) whose dynamic dimensions of equal size share
    one symbol (see :mod:`.duck_sizing`); only used with ``dynamic_shapes``."""
    with no_partial_graph_on_stderr(), quiet_torch_export(), torch.set_grad_enabled(grad_enabled), \
            _DistinctConversions(), shape_envs_released(), string_arguments_traced(), helper_frames_recorded(), \
            tracepoint_bookkeeping_skipped(), unbacked_bindings_pass_narrowed(), fake_tensor_cache_off(), \
            duck_sized_dims(duck_sized if dynamic_shapes else ()):
        return torch.export.export(module, args, strict=False, dynamic_shapes=dynamic_shapes,
                                   preserve_module_call_signature=preserve_module_call_signature)


@contextlib.contextmanager
def no_partial_graph_on_stderr() -> Iterator[None]:
    """Keep the graph traced so far off stderr when an export fails.

    torch 2.13's ``torch.export._trace`` prints ``exception.partial_fx_graph`` (the graph up to the
    failing op, 50-100 lines for a small model) to ``sys.stderr`` before re-raising, once in each of
    its nested ``_export`` wrappers; nnbridge then falls back to an opaque module, which is meant to
    be quiet (``ExtractionOptions.warn_on_compilation_failure`` asks for a warning naming the
    reason instead). Everything written to stderr meanwhile is held and written out afterwards,
    minus that graph; the exception keeps it (``partial_fx_graph``) and the fallback's reason is
    recorded for :func:`nnbridge.explain`. Extractions hold nnbridge's process-wide lock, so
    another thread's stderr output is only delayed. It also silences ``torch.export._trace``'s
    logged "exportdb" hint for classified errors (the error itself is raised and recorded).
    """
    held = io.StringIO()
    logger = logging.getLogger("torch.export._trace")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    error: BaseException | None = None
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException as exc:
        error = exc
        raise
    finally:
        logger.setLevel(level)
        text = held.getvalue()
        seen: set[int] = set()
        while error is not None and id(error) not in seen:  # torch may re-raise it wrapped
            seen.add(id(error))
            partial = getattr(error, "partial_fx_graph", None)
            if partial is not None:
                text = text.replace(f"{partial}\n", "")  # printed once per nested _export wrapper
            error = error.__cause__ or error.__context__
        if text:
            sys.stderr.write(text)


@contextlib.contextmanager
def shape_envs_released() -> Iterator[None]:
    """Let the ``ShapeEnv`` of every export made in the body be freed with its graphs.

    Non-strict export (torch 2.13, ``torch._export.non_strict_utils.make_fake_inputs``) makes a
    ``ShapeEnv(tracked_fakes=[])`` and appends the fake inputs to ``tracked_fakes``; those fake
    tensors hold the ``ShapeEnv`` through the ``SymNode``s of their symbolic sizes, which sit in C++
    (``TensorImpl`` sizes) where the garbage collector does not see them: a cycle ``gc`` cannot
    free, so every extraction would leave its ``ShapeEnv``, fake inputs and symbols alive for ever
    (one per export in ``gc.get_objects()``). ``tracked_fakes`` is read while export produces its
    guards; after the export returns (or raises) it is emptied. Only exports made by this thread
    are touched (``make_fake_inputs`` is wrapped in ``torch.export._trace`` for the duration).
    """
    trace = importlib.import_module("torch.export._trace")
    original, owner, made = trace.make_fake_inputs, threading.get_ident(), []

    def recording(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if threading.get_ident() == owner:
            made.append(result[0])  # (fake_mode, fake_args, fake_kwargs, ...)
        return result

    try:
        with registry.replaced("shape_envs_released", trace, "make_fake_inputs", value=recording, only_if_ours=True):
            yield
    finally:
        for fake_mode in made:
            shape_env = getattr(fake_mode, "shape_env", None)
            if shape_env is not None and shape_env.tracked_fakes:
                shape_env.tracked_fakes.clear()


def forget_export_state() -> None:
    """Drop what torch.export and its shape environments keep in process-wide state after a trace
    (called after each extraction; the state listed is what ``gc.get_referrers`` walks from a
    deleted bridged model and from the ``ShapeEnv``s left after it reach on torch 2.13).

    - Non-strict export fills ``torch.fx.experimental.proxy_tensor.
      _FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT`` with the traced graph's nodes for its fake-tensor
      leak check and clears it only when the next export traces. Those nodes reach the exported
      program, its unflattened modules and, through them, the model: a model deleted after its last
      extraction stayed alive until some other export. Only the export call that filled it reads it.
    - ``ShapeEnv``'s memoized methods (``functools.lru_cache`` on the class: ``_inner_evaluate_expr``,
      ``simplify``, ``size_hint``...) key on ``self``, so they can hold an extraction's ``ShapeEnv``
      with its symbols and guards (a referrer walk found ``_inner_evaluate_expr``'s cache holding
      one); the caches are pure memoization, emptied here.
    """
    from torch.fx.experimental import proxy_tensor
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT.clear()
    for attribute in vars(ShapeEnv).values():
        clear = getattr(attribute, "cache_clear", None)
        if callable(clear):
            clear()


@contextlib.contextmanager
def unused_calls_kept() -> Iterator[None]:
    """Keep the module calls whose outputs nothing uses in ``torch.export.unflatten``.

    torch 2.13's unflatten first removes the program's effect tokens (``_remove_effect_tokens``),
    which ends with ``graph.eliminate_dead_code()`` on the program's own graph, in place. That drops
    every call whose outputs the caller never reads (``out = self.c(x); return out[1]`` where ``c``
    returns one call of its linear per output) while ``module_call_graph`` still lists the call, so
    unflatten then fails looking its module up (``'InterpreterModule' object has no attribute
    'c_linear@2'``). Within, a program without effect tokens (no token inputs or outputs, no
    ``with_effects`` or ``invoke_subgraph`` node in any of its graphs) is left as it is, so the
    call stays in its caller's graph, run with its output unused as eager runs it; a program with
    tokens goes through torch's own pass (and such a call still fails, see
    :class:`UnusedCallOutputError`).
    """
    original = _unflatten_module._remove_effect_tokens

    def tokens_removed(exported: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
        return original(exported) if _has_effect_tokens(exported) else exported

    with registry.replaced("unused_calls_kept", _unflatten_module, "_remove_effect_tokens", value=tokens_removed):
        yield


def _has_effect_tokens(exported: torch.export.ExportedProgram) -> bool:
    """Whether ``_remove_effect_tokens`` would change ``exported`` other than by removing dead code."""
    signature = exported.graph_signature
    if signature.input_tokens or signature.output_tokens:
        return True
    effectful = {torch.ops.higher_order.with_effects, torch.ops.higher_order.invoke_subgraph}
    return any(node.target in effectful for module in exported.graph_module.modules()
               if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes)


def unflatten(exported: torch.export.ExportedProgram) -> torch.nn.Module:
    """``torch.export.unflatten`` with one graph per invocation, whose modules generate their
    Python code only when first run or read (see :func:`_code_generated_lazily`), and with the
    calls whose outputs the caller drops kept (see :func:`unused_calls_kept`).

    torch 2.13.0's unflatten prints a leftover debug line ("Checking mutability ...") for every
    functionalized buffer mutation; its stdout is swallowed here.
    """
    with no_module_deduplication(), unused_calls_kept(), _code_generated_lazily(), \
            contextlib.redirect_stdout(io.StringIO()), quiet_torch_export(), _state_on_meta(exported):
        try:
            return torch.export.unflatten(exported)
        except AttributeError as error:
            lost = _lost_call(error)
            if lost is None:
                raise
            # the first line is what an extraction failure quotes (200 characters): cause and guide first
            raise UnusedCallOutputError(
                f"call {lost!r} lost by torch.export.unflatten: its caller never uses (some of) its outputs"
                " (docs/graphpatch.md, 'A child call whose outputs the caller drops')\nUse every output of the"
                " call in the caller, or let the caller run opaque (classes_to_skip_compiling, or"
                " error_on_compilation_failure=False): its children are still graphs.") from error


class UnusedCallOutputError(RuntimeError):
    """``torch.export.unflatten`` (torch 2.13) failed on a module call whose outputs the caller does
    not use, in a program with effect tokens (without them the call is kept, see
    :func:`unused_calls_kept`): torch's token pass drops those outputs as dead code
    (``o = self.c(x); return o[1]`` where ``c`` returns one linear call per output), the call's
    module is then lost while unflatten rebuilds the calls, and looking it up raises ``AttributeError: 'InterpreterModule' object has no attribute 'c_linear@2'``
    (or ``... no attribute '_ty'`` when the first call's outputs are the unused ones)."""


def _lost_call(error: AttributeError) -> str | None:
    """The call name torch's unflatten could not find (``"c_linear@2"``, ``"_ty"``), or None when
    ``error`` is another AttributeError."""
    match = re.fullmatch(r"'(?:InterpreterModule|Module)' object has no attribute '([^']*@\d+|_ty)'", str(error))
    return match.group(1) if match else None


@contextlib.contextmanager
def _code_generated_lazily() -> Iterator[None]:
    """torch 2.13's unflatten ``finalize`` of each ``InterpreterModule`` (and of the
    ``UnflattenedModule``) makes a ``torch.fx.GraphModule`` of its graph, which generates and
    compiles the graph's Python code at once; nnbridge builds its own graph modules from the graphs
    and never runs that code. Within, ``finalize`` makes torch's lazy graph module instead (as
    Inductor's passes do), which generates the code only when it is run or read. The modules run
    through ``torch.fx.Interpreter`` (unflatten's default), which reads the graph, not that code.
    """
    classes = (_unflatten_module.InterpreterModule, _unflatten_module.UnflattenedModule)

    def finalize(self: Any) -> None:  # torch 2.13's, with a lazy graph module
        self.__dict__["graph_module"] = _lazy_graph_module._LazyGraphModule(self, self.graph)
        self.graph.lint()
        if isinstance(self, _unflatten_module.InterpreterModule):
            self.arg_names = [node.target for node in self.graph.nodes if node.op == "placeholder"]
    with contextlib.ExitStack() as stack:
        for cls in classes:
            stack.enter_context(registry.replaced("lazy_unflatten_code", cls, "finalize", value=finalize))
        yield


@contextlib.contextmanager
def _state_on_meta(exported: torch.export.ExportedProgram) -> Iterator[None]:
    """Parameters and persistent buffers as meta tensors while unflattening: torch 2.13's
    ``UnflattenedModule`` clones every one of them (a second copy of the weights, about a second on
    12-layer GPT-2), and nnbridge's graphs use the module's own tensors instead. Tied tensors stay
    tied (one meta tensor per original). Lifted constants are kept: graphs may use them."""
    state = exported._state_dict
    metas: dict[int, torch.Tensor] = {}

    def meta(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in metas:
            empty = torch.empty_like(tensor, device="meta")
            metas[id(tensor)] = torch.nn.Parameter(empty, tensor.requires_grad) if isinstance(
                tensor, torch.nn.Parameter) else empty
        return metas[id(tensor)]
    exported._state_dict = {name: meta(t) if isinstance(t, torch.Tensor) else t for name, t in state.items()}
    try:
        yield
    finally:
        exported._state_dict = state


#: the prefix torch 2.13's non-strict export gives the keys of ``node.meta["nn_module_stack"]``
_STACK_KEY_PREFIX = "L__self__"


def empty_module_calls(exported: torch.export.ExportedProgram) -> list[str]:
    """The preserved-signature module calls (``module_call_graph`` fqns, ``"model.drop"``,
    ``"model.lin@1"`` for a second call) for which export recorded no node: ``nn.Identity`` or
    any forward returning its inputs. torch 2.13's unflatten makes no submodule for such a call
    but looks one up for its signature (``AssertionError: Attribute 'drop' not found in model``).
    A node's ``nn_module_stack`` names the calls running when it was recorded: its values' paths
    (without the call index) and its keys (``"L__self__model.lin@1"``, with it)."""
    recorded: set[str] = set()
    for node in exported.graph.nodes:
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            recorded.add(path)
            if key.startswith(_STACK_KEY_PREFIX):
                recorded.add(key[len(_STACK_KEY_PREFIX):])
    return [entry.fqn for entry in exported.module_call_graph
            if entry.fqn and entry.signature is not None and entry.fqn not in recorded]


def uncalled_module_names(exported: torch.export.ExportedProgram) -> set[str]:
    """The preserved-signature fqns (``"model.layers.0"``) whose signature recorded neither inputs nor
    outputs: a module object preserved under several names that the code never called through
    this one (export records each call under the name it went through only). torch 2.13's
    unflatten makes an empty submodule for it."""
    return {entry.fqn for entry in exported.module_call_graph
            if entry.fqn and entry.signature is not None and not entry.signature.inputs and not entry.signature.outputs}


def invocation_graphs(unflattened: torch.nn.Module) -> list[torch.nn.Module]:
    """The per-invocation graph modules behind one unflattened submodule.

    A module called once is an ``InterpreterModule``; one called several times is an
    ``InterpreterModuleDispatcher`` whose ``_call_modules`` are in call order (torch 2.5+).

    Each returned module owns its graph again (``graph.owning_module``): torch 2.13 unflatten
    generates an InterpreterModule's code through a GraphModule made before it merged repeated call
    names, so that GraphModule owns the graph and holds stale children (``c_linear@2``,
    ``c_linear@3`` for the second call of a module that calls ``c_linear`` twice) while the graph
    calls ``c_linear``: ``graph.lint()`` and attribute look-ups through the owner then fail.
    """
    if isinstance(unflattened, _unflatten_module.InterpreterModuleDispatcher):
        holders = list(unflattened._call_modules)
    else:
        holders = [unflattened]
    for holder in holders:
        graph = getattr(holder, "graph", None)
        if isinstance(graph, torch.fx.Graph):
            graph.owning_module = holder
    return holders


def constant_outputs(exported: torch.export.ExportedProgram) -> dict[tuple[str, int], dict[int, Any]]:
    """The Python constants each preserved module call returned next to its tensors.

    ``torch.export.unflatten`` (torch 2.13) leaves ``None`` in a module graph's output where the
    call's signature has a ``ConstantArgument`` (``return x * 2, 3``; ``return out, self.n``): the
    value lives only in ``exported.module_call_graph``, where export names a module's first call
    ``path`` and its call number k >= 1 (counted from 0) ``path@k`` (unflatten's ``_call_name``,
    torch 2.5 - 2.13).

    Returns:
        ``{(module path as in the program, e.g. "model.h.0", invocation from 0): {output leaf
        index: value}}``, only for calls that returned constants.
    """
    from torch.export.graph_signature import ConstantArgument

    found: dict[tuple[str, int], dict[int, Any]] = {}
    for entry in exported.module_call_graph:
        if entry.signature is None:
            continue
        constants = {i: out.value for i, out in enumerate(entry.signature.outputs)
                     if isinstance(out, ConstantArgument)}
        if constants:
            path, _, call = entry.fqn.partition("@")
            found[(path, int(call) if call else 0)] = constants
    return found


def register_cache_pytrees(model: torch.nn.Module) -> None:
    """Let torch.export flatten transformers' ``Cache`` objects (``use_cache=True``).

    transformers 5.x ships the registration in ``transformers.exporters.exporter_dynamo``; models
    that are not transformers models, or older transformers, need nothing.
    """
    try:
        from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model
    except ImportError:
        return
    try:
        register_cache_pytrees_for_model(model)  # type: ignore[arg-type]  # typed PreTrainedModel; any module works
    except Exception:  # a non-transformers module: nothing to register
        return
    _remember_context_classes(model)


#: ``{path: class}``: the classes transformers' cache pytree contexts name (``"module:Qualname"``),
#: resolved once outside any trace (bounded by the number of cache classes; see
#: :func:`_remember_context_classes`)
_CONTEXT_CLASSES: dict[str, type] = {}


def _remember_context_classes(model: torch.nn.Module) -> None:
    """Make transformers' cache pytree unflattening (``exporter_dynamo._path_to_class``, which
    imports the class named in the context with ``importlib.import_module``) answer from
    :data:`_CONTEXT_CLASSES`, filled here with every cache and cache-layer class, so that
    ``torch.compile`` can trace a graph rebuilding a ``DynamicCache`` (Dynamo cannot trace
    ``importlib.import_module``; with ``fullgraph=True`` it raised). Idempotent."""
    try:
        from transformers import cache_utils
        from transformers.exporters import exporter_dynamo
    except ImportError:
        return
    original = exporter_dynamo.__dict__.get("_path_to_class")
    to_path = exporter_dynamo.__dict__.get("_class_to_path")
    if original is None or to_path is None:
        return
    if not hasattr(original, "__nnbridge_original__"):
        def _path_to_class(path: str) -> type:
            cls = _CONTEXT_CLASSES.get(path)
            if cls is None:
                cls = _CONTEXT_CLASSES[path] = original(path)
            return cls

        _path_to_class.__nnbridge_original__ = original  # type: ignore[attr-defined]
        _path_to_class.__doc__ = original.__doc__
        registry.install("cache_context_classes", exporter_dynamo, "_path_to_class", value=_path_to_class)
    classes: list[type] = [value for value in vars(cache_utils).values()
                           if isinstance(value, type) and value.__module__ == cache_utils.__name__]
    classes += [value for value in vars(sys.modules.get(type(model).__module__, cache_utils)).values()
                if isinstance(value, type) and exporter_dynamo.is_cache_class(value)]
    seen: set[type] = set(classes)
    stack: list[type] = list(classes)
    while stack:  # and the subclasses of each (a cache class of another module)
        subclasses: list[type] = stack.pop().__subclasses__()
        for subclass in subclasses:
            if subclass not in seen:
                seen.add(subclass)
                stack.append(subclass)
    for cls in seen:
        _CONTEXT_CLASSES.setdefault(to_path(cls), cls)


def forward_from_source(source: str, globals_: dict[str, Any]) -> Callable[..., Any]:
    """Compile fx-generated ``forward`` source into a function, keeping it linecache-visible.

    ``torch.fx.graph_module._forward_from_src`` registers the source with linecache so tracebacks
    through generated code show the generated line (torch 2.0 - 2.13). The source is dropped from
    fx's cache and ``linecache`` when the function's code dies (see
    :func:`nnbridge.compat.torch.fx.release_source_with`).
    """
    from torch.fx.graph_module import _forward_from_src

    from .fx import release_source_with

    forward = _forward_from_src(source, globals_, None)
    release_source_with(forward)
    return forward


def rename_nodes(graph: torch.fx.Graph, names: dict[torch.fx.Node, str]) -> None:
    """Give ``graph``'s nodes fresh names from a new namespace, in graph order.

    Export numbers node names globally (layer 1's softmax is ``softmax_1``); nnbridge numbers them
    per graph. ``torch.fx.Graph._graph_namespace`` (torch 2.0 - 2.13) must be reset or the old global
    names would block the local ones. Names that are Python keywords or builtins (``input``,
    ``pow``) get a numeric suffix from fx; the display names live in ``node.meta``.
    """
    namespace = torch.fx.graph._Namespace()
    namespace.create_name("self", object())  # generated code's method argument (BERT has `attention.self`)
    graph._graph_namespace = namespace
    for node in graph.nodes:
        node.name = namespace.create_name(names.get(node, node.name), node)


def copy_spec(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    """A deep copy of a pytree ``TreeSpec`` (torch 2.13's copy path warns about ``LeafSpec``)."""
    import copy

    with quiet_torch_export():
        return copy.deepcopy(spec)


def export_guards(exported: torch.export.ExportedProgram) -> list[str]:
    """The shape guards export recorded while tracing (``x.size()[1] % 2 == 0``), as Python
    expressions over ``L``: ``{forward argument name: value}`` of the exported root's call.

    ``ExportedProgram._guards_code`` (torch 2.9 - 2.13) is what ``ExportedProgram.module()`` compiles
    into its ``_guards_fn``; range constraints are not in it (see ``ShapeGuard``).
    """
    return list(getattr(exported, "_guards_code", None) or [])


def compile_guards(codes: list[str]) -> Callable[[dict[str, Any]], bool]:
    """``check(L) -> bool``: whether every guard expression of :func:`export_guards` holds.

    The expressions use SymPy's printed helpers (``FloorDiv``, ``Mod``...); they are evaluated in
    ``torch.fx.experimental.symbolic_shapes.SYMPY_INTERP``, the namespace torch's own
    ``_guards_fn`` uses (torch 2.9 - 2.13).
    """
    import math

    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    source = " and ".join(f"({code})" for code in codes) or "True"
    namespace = {**SYMPY_INTERP, "math": math, "inf": float("inf"), "torch": torch}
    return eval(f"lambda L: bool({source})", namespace)  # noqa: S307 - torch's own guard code


class _Node:
    """A pytree node of a call as export's guard sources address it: ``node[key]`` and
    ``node.attribute`` give its child (a leaf itself, another node as a :class:`_Node`), by the
    key its pytree key path entry holds (``MappingKey.key``, ``SequenceKey.idx``,
    ``GetAttrKey.name``: torch 2.2 - 2.13 ``torch.utils._pytree``). The children come from the
    node's registered ``flatten_with_keys`` (the one ``tree_flatten_with_path`` calls) on the
    first read, so a guard reading one leaf of a cache argument does not walk the whole call."""

    __slots__ = ("_tree", "_children")

    def __init__(self, tree: Any):
        self._tree: Any = tree
        self._children: dict[Any, Any] | None = None

    def _read(self) -> dict[Any, Any]:
        if self._children is None:
            handler = pytree.SUPPORTED_NODES[pytree._get_node_type(self._tree)]
            if handler.flatten_with_keys_fn is None:  # (as tree_flatten_with_path refuses it)
                raise ValueError(f"no flatten_with_keys_fn for {type(self._tree).__name__}")
            entries, _ = handler.flatten_with_keys_fn(self._tree)
            # (a child whose type pytree has no handler for is a leaf, as in tree_flatten_with_path)
            self._children = {_entry_key(entry): _Node(child) if pytree._get_node_type(child) in pytree.SUPPORTED_NODES
                              else child for entry, child in entries}
        return self._children

    def __getitem__(self, key: Any) -> Any:
        return self._read()[key]

    def __getattr__(self, name: str) -> Any:
        if name in _Node.__slots__:  # (not set yet: an object made without __init__, as Dynamo's polyfill makes it)
            raise AttributeError(name)
        try:
            return self._read()[name]
        except KeyError:
            raise AttributeError(name) from None


def _entry_key(entry: Any) -> Any:
    return getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", None)))


def guard_view(value: Any) -> Any:
    """``value`` (a call's ``{"args": ..., "kwargs": ...}``) as export's guard sources see it:
    ``L['kwargs']['past_key_values'][0]`` is the first leaf of a cache object (its flattened
    children), not ``cache[0]`` (see :class:`_Node`). Each node is flattened when a guard first
    reads into it: building the whole view (``tree_flatten_with_path`` of the call, which
    flattens a ``Cache`` argument twice) would be a visible share of a bridged decode step, whose
    guard reads one leaf of the cache."""
    return _Node(value)
