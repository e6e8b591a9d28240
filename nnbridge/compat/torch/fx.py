"""Shims over ``torch.fx.GraphModule`` behaviour, fx's generated-code cache and fx tracing's
process-wide patches."""

from __future__ import annotations

import builtins
import contextlib
import functools
import linecache
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx._symbolic_trace
import torch.fx.graph_module

from .. import registry


class NoSubmoduleRecompile:
    """Mixin for a ``GraphModule`` subclass whose child graph modules manage their own code.

    torch 2.13's ``GraphModule.recompile`` ends with ``self._recompile_submodules()``, which
    recompiles every child ``GraphModule``; building a hierarchy bottom-up then recompiles each
    subtree once per ancestor. Children here are compiled when built, so the recursion is skipped.
    """

    def _recompile_submodules(self) -> list[tuple[str, torch.fx.graph.PythonCode]]:
        return []


def generated_line_map(code: torch.fx.graph.PythonCode | torch.fx.GraphModule) -> tuple[dict[int, int | None], int]:
    """``(line -> node index, prologue start)`` of fx-generated code: a ``PythonCode`` from
    ``Graph.python_code`` or a ``GraphModule`` after ``recompile`` (``_lineno_map`` and
    ``_prologue_start``, torch 2.1 - 2.13). The node index of a frame at ``lineno`` in the generated
    forward is ``map[lineno - prologue start]``, in ``graph.nodes`` order."""
    return dict(getattr(code, "_lineno_map", None) or {}), int(getattr(code, "_prologue_start", 0))


def keep_tracebacks(graph_module: torch.fx.GraphModule) -> None:
    """Call ``graph_module`` through its class's own ``__call__`` (``nn.Module``'s, or one a
    ``GraphModule`` subclass defines), not torch.fx's wrapper of it.

    ``GraphModule.recompile`` (torch 2.0 - 2.14) installs ``cls.__call__ = call_wrapped`` on the
    module's own class (a ``GraphModuleImpl`` made per instance), whose ``_WrappedCall`` prints the
    generated line to stderr when an error is raised in generated code and re-raises it *without
    its traceback*; nnbridge locates the failing node from that traceback (see
    ``nnbridge.graph.failures``), so the wrapper is removed (the same call otherwise).
    """
    cls = type(graph_module)
    if getattr(vars(cls).get("__call__"), "__name__", None) == "call_wrapped":
        delattr(cls, "__call__")


#: prefix of the file names fx gives generated code (``_EvalCacheLoader._get_key``, torch 2.0 - 2.13);
#: each such name is unique to one compiled source
_GENERATED_PREFIX = "<eval_with_key>."
_RELEASE_LOCK = threading.Lock()
_release_depth = 0
_installed: tuple[Any, Callable[..., Any]] | None = None  # (what registry.uninstall puts back, wrapper) while entered


def _forget_source(filename: str) -> None:
    torch.fx.graph_module._loader.eval_cache.pop(filename, None)
    linecache.cache.pop(filename, None)


def release_source_with(function: Callable[..., Any]) -> None:
    """Drop ``function``'s generated source from fx's cache and ``linecache`` once its code dies.

    torch 2.0 - 2.13 keep the source of every function fx generates for ever: in
    ``torch.fx.graph_module._loader.eval_cache`` and as a ``linecache`` entry, both keyed by the
    unique file name ``<eval_with_key>.N`` (about 100 entries per extraction of a 2-layer GPT-2).
    The entries are removed when the code object dies, not the function: a traceback still holding
    a frame of the code keeps its generated lines printable.
    """
    code = getattr(function, "__code__", None)
    if isinstance(code, types.CodeType) and code.co_filename.startswith(_GENERATED_PREFIX):
        weakref.finalize(code, _forget_source, code.co_filename).atexit = False


def _releasing(method_from_src: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method_from_src)
    def releasing(*args: Any, **kwargs: Any) -> Any:
        method = method_from_src(*args, **kwargs)
        release_source_with(method)
        return method
    return releasing


@contextlib.contextmanager
def generated_code_released() -> Iterator[None]:
    """Within: every function fx generates (``GraphModule.recompile``, torch.export's and
    unflatten's graph modules) gets :func:`release_source_with`.

    fx compiles all generated code through ``torch.fx.graph_module._method_from_src`` (torch 2.0 -
    2.13), which is wrapped for the duration. Re-entrant and thread-safe: the wrapper stays while any
    thread is inside; code another thread generates meanwhile is released the same way.
    """
    global _release_depth, _installed
    fx = torch.fx.graph_module
    with _RELEASE_LOCK:
        if _release_depth == 0 and registry.enabled("generated_code_released"):
            wrapper = _releasing(fx._method_from_src)
            _installed = (registry.install("generated_code_released", fx, "_method_from_src", value=wrapper), wrapper)
        _release_depth += 1
    try:
        yield
    finally:
        with _RELEASE_LOCK:
            _release_depth -= 1
            if _release_depth == 0 and _installed is not None:
                # (only_if: patched again since, theirs is left)
                registry.uninstall("generated_code_released", fx, "_method_from_src", previous=_installed[0],
                                   only_if=_installed[1])
                _installed = None


@contextlib.contextmanager
def fx_patches_confined(wait: contextlib.AbstractContextManager[object]) -> Iterator[None]:
    """Keep the process-wide patches torch.fx makes while tracing to the tracing thread.

    While it traces, fx's ``Tracer.trace`` replaces ``nn.Module.__call__`` and
    ``nn.Module.__getattr__`` on the class, and autowrapped functions in module globals
    (``torch.fx._symbolic_trace._Patcher``, torch 2.0 - 2.13; torch.export's non-strict tracer goes
    through it). Another thread calling any module meanwhile would be recorded into, or corrupt,
    the trace. In the body, every such patch calls the replaced function in other threads instead;
    a module call from another thread first enters ``wait`` (a context manager: the extraction
    lock), so it runs after the trace has put everything back.
    """
    patcher = torch.fx._symbolic_trace._Patcher
    patch, patch_method = patcher.__dict__["patch"], patcher.__dict__["patch_method"]

    def confined(new_fn: Callable[..., Any], original: Callable[..., Any], waits: bool) -> Callable[..., Any]:
        owner = threading.get_ident()

        @functools.wraps(new_fn)
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == owner:
                return new_fn(*args, **kwargs)
            if waits:
                with wait:
                    return original(*args, **kwargs)
            return original(*args, **kwargs)
        return dispatch

    def confined_patch(self: object, frame_dict: dict[str, Any], name: str, new_fn: Callable[..., Any],
                       deduplicate: bool = True) -> None:
        original = frame_dict.get(name, getattr(builtins, name, None))
        if callable(original):
            new_fn = confined(new_fn, original, waits=False)
        return patch(self, frame_dict, name, new_fn, deduplicate)

    def confined_patch_method(self: object, cls: type, name: str, new_fn: Callable[..., Any],
                              deduplicate: bool = True) -> None:
        original = getattr(cls, name)
        new_fn = confined(new_fn, original, waits=issubclass(cls, torch.nn.Module) and name == "__call__")
        return patch_method(self, cls, name, new_fn, deduplicate)

    with registry.replaced("fx_patches_confined", patcher, "patch", value=confined_patch), \
            registry.replaced("fx_patches_confined", patcher, "patch_method", value=confined_patch_method):
        yield
