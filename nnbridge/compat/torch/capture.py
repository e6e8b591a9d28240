"""Shims that let extraction notice what torch.export cannot capture faithfully (torch 2.13.0).

- :func:`tensor_version`: a tensor's in-place version counter (private ``Tensor._version``).
- :func:`autograd_function_calls`: report every custom ``torch.autograd.Function.apply`` while
  tracing; export inlines the Function's forward and drops its backward.
- :func:`grad_mode_frozen`: ignore grad-mode changes while a given module is traced.
- :func:`grad_mode_changes`: report every grad-mode change in an eager run (to find the modules
  above before exporting).
- :func:`graph_break_calls`: report every ``torch._dynamo.graph_break()`` while tracing; non-strict
  export runs it as the no-op it is in eager code, so the module would silently become one graph.
- :func:`compile_queries`: report ``torch.compiler.is_compiling()`` / ``is_exporting()`` asked by
  a model's own code while tracing: both are True under export and False in eager code, so a
  branch on them would keep its compiled side in the graph.
- :func:`mode_regions`: the grad-mode / autocast regions export recorded as higher-order ops
  (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``) or as ``_set_grad_enabled`` calls.
- :func:`layout_reads`, :func:`constant_uses`: strides and storage offsets export kept as symbols,
  and the tensor constants it lifted, each with the module using it.
- :func:`native_fast_path`: a module call eager code may run as a native fast path a trace skips.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from typing import Any
from collections.abc import Callable, Iterator

import torch

from .. import registry
from .pytree import pytree


def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor._version``: bumped by every in-place write (torch 1.x - 2.13)."""
    return tensor._version


@contextlib.contextmanager
def autograd_function_calls(on_apply: Callable[[type], None]) -> Iterator[None]:
    """Call ``on_apply(function_class)`` on every ``torch.autograd.Function.apply`` in the body.

    ``apply`` is a classmethod defined on ``torch.autograd.Function`` (torch 2.0 - 2.14) that
    subclasses inherit; it is replaced for the body's duration and restored on exit. Only calls in
    the thread that entered the body are reported.
    """
    function = torch.autograd.Function
    original = function.__dict__["apply"]
    thread = threading.get_ident()

    def apply(cls: type, *args: object, **kwargs: object) -> object:
        if threading.get_ident() == thread:
            on_apply(cls)
        # (bound to ``cls`` by the descriptor: a ``classmethod`` up to torch 2.13, a C-level
        # ``classmethod_descriptor`` from 2.14)
        return original.__get__(None, cls)(*args, **kwargs)

    with registry.replaced("autograd_function_apply", function, "apply", value=classmethod(apply)):
        yield


@contextlib.contextmanager
def _grad_setter_replaced(setter: Callable[[Callable[[bool], None], bool], None]) -> Iterator[None]:
    """Route every ``torch._C._set_grad_enabled(enabled)`` of the body's thread through
    ``setter(original, enabled)``, which decides whether to call the original. Every grad-mode
    change ends there (``torch.no_grad()``, ``torch.enable_grad()``, their decorators,
    ``torch.set_grad_enabled``; torch 2.0 - 2.13). Restored on exit; other threads are untouched."""
    original = torch._C._set_grad_enabled
    thread = threading.get_ident()

    def set_grad_enabled(enabled: bool) -> None:  # torch._C._set_grad_enabled's signature
        if threading.get_ident() != thread:
            original(enabled)
        else:
            setter(original, enabled)

    with registry.replaced("set_grad_enabled", torch._C, "_set_grad_enabled", value=set_grad_enabled):
        yield


def grad_mode_changes(on_change: Callable[[], None], *,
                      on_enable: Callable[[], None] | None = None) -> contextlib.AbstractContextManager[None]:
    """Call ``on_change()`` before every grad-mode change in the body (a call of
    ``torch._C._set_grad_enabled`` with a value other than the current mode), in the thread that
    entered it, and ``on_enable()`` before every call enabling grad while it is enabled already
    (``torch.enable_grad()`` under grad mode: a change for a call made under ``torch.no_grad()``);
    the call itself happens as usual."""
    def setter(original: Callable[[bool], None], enabled: bool) -> None:
        if bool(enabled) != torch.is_grad_enabled():
            on_change()
        elif enabled and on_enable is not None:
            on_enable()
        original(enabled)
    return _grad_setter_replaced(setter)


def grad_mode_frozen(when: Callable[[], bool]) -> contextlib.AbstractContextManager[None]:
    """Ignore grad-mode changes (``torch.no_grad()``, ``torch.enable_grad()``, their decorators)
    while ``when()`` is true, for the body's duration (see :func:`_grad_setter_replaced`). While
    it is in place, torch.export does not record grad-mode changes in the graph, so find them
    all (:func:`mode_regions`) before using this. Other threads' changes are never ignored."""
    def setter(original: Callable[[bool], None], enabled: bool) -> None:
        if not when():
            original(enabled)
    return _grad_setter_replaced(setter)


#: Global name, in ``torch._dynamo.decorators``, of the callback :func:`graph_break_calls` installs.
_GRAPH_BREAK_HOOK = "_nnbridge_graph_break_hook"


def _reporting_graph_break(msg: str = "") -> None:  # body becomes torch._dynamo.graph_break's
    _nnbridge_graph_break_hook(msg)  # type: ignore[name-defined]  # noqa: F821 - resolved in torch's module


@contextlib.contextmanager
def graph_break_calls(on_break: Callable[[str], None]) -> Iterator[None]:
    """Call ``on_break(msg)`` on every ``torch._dynamo.graph_break(msg)`` in the body.

    ``graph_break`` is a plain function with an empty body in ``torch._dynamo.decorators``
    (torch 2.0 - 2.13); user code usually imports it by name (``from torch._dynamo import
    graph_break``), so its ``__code__`` is swapped (every reference sees it) for one calling a
    global set in that module, and both are restored on exit. Only calls in the thread that entered
    the body are reported.
    """
    from torch._dynamo import decorators

    function = decorators.graph_break
    thread = threading.get_ident()

    def hook(msg: str = "") -> None:
        if threading.get_ident() == thread:
            on_break(msg)

    with registry.replaced("graph_break", decorators, _GRAPH_BREAK_HOOK, value=hook), \
            registry.code_replaced("graph_break", function, _reporting_graph_break.__code__):
        yield


#: Global names, in ``torch.compiler``, of the callbacks :func:`compile_queries` installs.
_IS_COMPILING_HOOK, _IS_EXPORTING_HOOK = "_nnbridge_is_compiling_hook", "_nnbridge_is_exporting_hook"
#: Modules whose functions only forward the question (``torch._dynamo.is_compiling``,
#: transformers' ``is_torchdynamo_compiling``): the code asking is their caller.
_FORWARDERS = frozenset({"torch._dynamo.external_utils", "torch._utils", "transformers.utils.import_utils"})
#: Packages trusted to keep both sides of such a branch equal (their own tests compare compiled with
#: eager runs), and nnbridge's and nnsight's own questions. transformers' sdpa attention is the known
#: exception: for a one-token grouped-query step with a mask, eager code packs the query's heads and a
#: trace repeats keys and values (1 ulp apart). Answering eager's False there does not help: a trace
#: never skips a passed mask (it cannot read its values), and the packed heads with a mask of all
#: ones differ from eager's skipped mask (``enable_gqa``), where the repeat is exact; the branch eager
#: takes depends on the mask's values, which one graph cannot follow.
_TRUSTED = frozenset({"torch", "transformers", "nnbridge", "nnsight"})


def _reporting_is_compiling() -> bool:  # body becomes torch.compiler.is_compiling's
    return _nnbridge_is_compiling_hook()  # type: ignore[name-defined]  # noqa: F821


def _reporting_is_exporting() -> bool:  # body becomes torch.compiler.is_exporting's
    return _nnbridge_is_exporting_hook()  # type: ignore[name-defined]  # noqa: F821


def _asking_code(frame: types.FrameType | None) -> str | None:
    """``module.qualname`` of the code that asked (past forwarding helpers), None when it is
    trusted (see :data:`_TRUSTED`)."""
    while frame is not None and frame.f_globals.get("__name__") in _FORWARDERS:
        frame = frame.f_back
    if frame is None:
        return None
    module = str(frame.f_globals.get("__name__", ""))
    if module.split(".")[0] in _TRUSTED:
        return None
    return f"{module}.{frame.f_code.co_qualname}"


@contextlib.contextmanager
def compile_queries(on_query: Callable[[str, str], None]) -> Iterator[None]:
    """Call ``on_query(question, asking code)`` when code outside torch, transformers, nnbridge and
    nnsight asks ``torch.compiler.is_compiling()`` or ``torch.compiler.is_exporting()`` (also
    through ``torch._dynamo.is_compiling`` or transformers' ``is_torchdynamo_compiling``) in the
    body and gets True, as it does while torch.export traces: eager code gets False, so a graph
    would keep the other side of a branch on it.

    Both are plain functions of ``torch.compiler`` (torch 2.3 - 2.13); their ``__code__`` is
    swapped for one calling a global set in that module (every reference sees it) and restored on
    exit. Answers are unchanged. Only questions in the thread that entered the body are reported.
    """
    import torch.compiler as compiler

    thread = threading.get_ident()
    swapped = [(compiler.is_compiling, _reporting_is_compiling, _IS_COMPILING_HOOK, "torch.compiler.is_compiling()"),
               (compiler.is_exporting, _reporting_is_exporting, _IS_EXPORTING_HOOK, "torch.compiler.is_exporting()")]
    originals = [function.__code__ for function, *_ in swapped]

    def hook(answer: Callable[[], bool], question: str) -> Callable[[], bool]:
        def asked() -> bool:
            result = answer()
            if result and threading.get_ident() == thread:
                asking = _asking_code(sys._getframe(2))
                if asking is not None:
                    on_query(question, asking)
            return result
        return asked
    with contextlib.ExitStack() as stack:
        for (function, template, name, question), original in zip(swapped, originals):
            answer = types.FunctionType(original, function.__globals__, function.__name__)
            stack.enter_context(registry.replaced("compile_queries", compiler, name, value=hook(answer, question)))
            stack.enter_context(registry.code_replaced("compile_queries", function, template.__code__))
        yield


def _mode_targets() -> dict[object, str]:
    targets: dict[object, str] = {torch._C._set_grad_enabled: "grad"}
    higher = torch.ops.higher_order
    for name, kind in (("wrap_with_set_grad_enabled", "grad"), ("wrap_with_autocast", "autocast")):
        if hasattr(higher, name):
            targets[getattr(higher, name)] = kind
    for name in ("_enter_autocast", "_exit_autocast"):
        target = getattr(torch.amp.autocast_mode, name, None)
        if target is not None:
            targets[target] = "autocast"
    return targets


def layout_reads(exported: torch.export.ExportedProgram) -> list[tuple[str, str]]:
    """``[(module path, op name)]`` for every stride or storage offset of a tensor export kept as a
    symbol (``x.stride(0)``, ``x.storage_offset()`` of a non-contiguous or offset input).

    torch 2.13's ``torch.export.unflatten`` hands a preserved-signature submodule the tensor itself
    where such a symbol is used (checked on plain torch: ``lin(x) * x.stride(0)`` unflattens to
    ``lin(x) * x``), so a graph of that module would compute something else than its code, silently.
    The path is the innermost module holding every use of the symbol (export hoists the read
    itself to the graph's inputs, outside any module; ``@k`` suffixes removed).
    """
    targets: dict[object, str] = {torch.ops.aten.sym_stride.int: "sym_stride",
                                  torch.ops.aten.sym_storage_offset.default: "sym_storage_offset"}
    found = []
    for node, name in _calls_to(exported, targets):
        found.append((_holding_every_use(node, _innermost(node)), name))
    return found


def constant_uses(exported: torch.export.ExportedProgram) -> list[tuple[str, torch.Tensor, bool]]:
    """``[(module path, value, fresh)]`` for every tensor constant export lifted (a tensor the code
    reached other than as a parameter, buffer or input: ``self.weights[0]`` of a list attribute, or
    one it made from Python data, ``torch.tensor([1.0, 2.0])``), with the innermost module holding
    every use of it (as :func:`layout_reads`). export lifts a tensor the code read detached
    (``requires_grad=False``), sharing the original's storage and version counter; ``fresh`` is
    True when every use is ``aten.lift_fresh_copy`` (how export records a tensor made from data in
    the traced code, whose values that code decides)."""
    kinds = torch.export.graph_signature.InputKind
    targets = {spec.arg.name: spec.target for spec in exported.graph_signature.input_specs
               if spec.kind == kinds.CONSTANT_TENSOR and spec.target is not None}
    found = []
    for node in exported.graph_module.graph.nodes:
        if node.op != "placeholder" or node.name not in targets:
            continue
        value = exported.constants.get(targets[node.name])
        if not isinstance(value, torch.Tensor):
            continue
        fresh = bool(node.users) and all(user.target is torch.ops.aten.lift_fresh_copy.default for user in node.users)
        found.append((_holding_every_use(node, ""), value, fresh))
    return found


def _holding_every_use(node: torch.fx.Node, unused: str) -> str:
    """The innermost module holding every use of ``node`` (``unused`` when it has none)."""
    paths = [_innermost(user) for user in node.users] or [unused]
    common = paths[0].split(".") if paths[0] else []
    for path in paths[1:]:
        parts = path.split(".") if path else []
        while common != parts[:len(common)]:
            common.pop()
    return ".".join(common)


#: torch 2.13 modules whose eager forward may take a native fast path that a trace does not take
#: (their check ``torch.overrides.has_torch_function`` holds for export's tensors, so the graph
#: gets the Python slow path, whose numbers differ): the op each calls instead.
_NATIVE_FAST_PATHS = {
    torch.nn.MultiheadAttention: "torch._native_multi_head_attention",
    torch.nn.TransformerEncoderLayer: "torch._transformer_encoder_layer_fwd",
    torch.nn.TransformerEncoder: "nested tensors (torch._nested_tensor_from_mask)",
}


def native_fast_path(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The native op ``module``'s eager call may run instead of its Python code (torch 2.13's
    fast paths of ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and
    ``nn.TransformerEncoder``: in eval mode, with grad disabled or nothing requiring grad), or
    None. Conservative: the other conditions of torch's check (``need_weights``, masks, dtypes)
    are not replicated, so it may name a call that takes the slow path after all."""
    op = _NATIVE_FAST_PATHS.get(type(module))
    if op is None or module.training or getattr(module, "use_nested_tensor", True) is False:
        return None
    if not torch.is_grad_enabled():
        return op
    leaves = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    if any(t.requires_grad for t in (*leaves, *module.parameters())):
        return None
    return op


def _calls_to(exported: torch.export.ExportedProgram, targets: dict[object, str]) -> Iterator[tuple[torch.fx.Node, str]]:
    """``(node, targets[node.target])`` for each call of one of ``targets`` in ``exported``'s graph."""
    for node in exported.graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        try:
            kind = targets.get(node.target)
        except TypeError:  # unhashable target
            kind = None
        if kind is not None:
            yield node, kind


def _innermost(node: torch.fx.Node) -> str:
    """The innermost module of ``node``'s ``nn_module_stack`` (``@k`` removed); "" when none."""
    stack = [entry for entry in node.meta.get("nn_module_stack", {}).values()
             if not str(entry[0]).startswith("_empty_nn_module_stack")]
    return str(stack[-1][0]).split("@")[0] if stack else ""


def mode_regions(exported: torch.export.ExportedProgram) -> list[tuple[str, str]]:
    """``[(module path, "grad" | "autocast")]`` for every grad-mode or autocast change export kept.

    The path is the innermost module of the node's ``nn_module_stack`` as the export root names it
    (``model.model.rotary_emb``; invocation suffixes ``@1`` removed); ``""`` when export recorded
    no module.
    """
    found = []
    for node, kind in _calls_to(exported, _mode_targets()):
        found.append((_innermost(node), kind))
    return found
