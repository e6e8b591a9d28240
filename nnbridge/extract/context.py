"""What one extraction produces and what its steps share.

:class:`Extraction` is the record a dispatcher keeps per call structure; :class:`ExtractionContext`
carries the options, the NodePath prefix, the opaque fallbacks recorded so far and the factory of
the dispatchers an opaque module's children are called through, from step to step of
:func:`nnbridge.dispatch.extraction.extract`. Example::

    ctx = ExtractionContext(model, ExtractionOptions(), "", [], child_dispatcher)
    ctx.fail("transformer.h.0", "GuardOnDataDependentSymNode: ...", error)   # opaque, or raises
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..guards.call_structure import ShapeGuard
from ..graph.graph_module import CompiledGraphModule, OpaqueGraphModule
from ..graph.metadata import ExtractionHolder
from ..graph.node_path import ModulePath
from ..guards.module_state import StateGuard
from .options import ExtractionOptions
from .sibling_roots import RootWatch, SharedRoot, SiblingLink
from ..errors import ExtractionError, NNBridgeWarning, warn

def describe_failure(error: BaseException) -> str:
    """One-line reason for a failed export (``GuardOnDataDependentSymNode: ...``)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


@dataclass
class Extraction:
    """One extraction of a module for one call structure.

    Attributes:
        root: the extracted root (:class:`CompiledGraphModule` or :class:`OpaqueGraphModule`).
        guard: the tensor sizes it accepts.
        opaque: ``{module path: reason}`` for every module that fell back to opaque.
        fallbacks: ``{module path: reason}`` of the modules in ``opaque`` that are opaque because
            something failed (export, a capture check, building, a custom function, an unused
            submodule under ``allow_unused_submodules=False``), not by the options' design; the
            children of opaque modules included.
        example: summaries (``torch.Size`` for tensors) of the call it was extracted from.
        inputs: ``{forward argument name: (sizes, dtype, device)}`` of that call's tensor
            arguments (the root graph's placeholders carry these names), set by the dispatcher.
        state: the module state it bakes in (:class:`~nnbridge.guards.module_state.StateGuard`), set by
            the dispatcher that made it.
        reason: why it was made: ``"first call"``, or the guard that failed for the call.
        shared: set when it is a representative's whose siblings may build their graphs from it
            (:class:`~.sibling_roots.SharedRoot`, see :mod:`.sibling_roots`).
        serves_no_grad: its graphs also serve calls made with grad disabled: it was extracted with
            grad enabled, its root is a graph, and the eager run before its export saw no code
            read grad mode (see :mod:`nnbridge.compat.torch.grad_reads`). Its ops then run as the
            eager code would under ``torch.no_grad()``, and modules that change grad mode run
            their own code.
    """

    root: CompiledGraphModule | OpaqueGraphModule
    guard: ShapeGuard
    opaque: dict[str, str] = field(default_factory=dict)
    example: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    inputs: dict[str, tuple[torch.Size, torch.dtype, torch.device]] = field(default_factory=dict)
    state: StateGuard | None = None
    reason: str = "first call"
    shared: SharedRoot | None = None
    fallbacks: dict[str, str] = field(default_factory=dict)
    serves_no_grad: bool = False


class ChildDispatcher(ExtractionHolder, Protocol):
    """What an opaque module's child is called through: extracts it per call structure
    (:class:`~nnbridge.dispatch.dispatcher.GraphDispatcher`)."""

    def add_extraction(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Extraction: ...

    def lookup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Extraction:
        """The extraction serving this call: a kept one whose guards hold, else a new one."""

    def pair(self, watch: RootWatch | None, sibling: SiblingLink | None) -> None:
        """Make it a representative whose export is watched, or a sibling of another dispatcher
        (see :mod:`.sibling_roots`), for its next extractions."""


#: ``(child module, its NodePath) -> ChildDispatcher``: supplied by the dispatcher layer, so
#: extraction does not import it (the dispatcher calls :func:`extract`).
ChildDispatcherFactory = Callable[[torch.nn.Module, ModulePath], ChildDispatcher]


class ExtractionContext:
    def __init__(self, module: torch.nn.Module, options: ExtractionOptions, path: ModulePath,
                 *, on_extraction: list[Callable[[Any, Extraction], None]],
                 child_dispatcher: ChildDispatcherFactory):
        self.module = module
        self.child_dispatcher = child_dispatcher
        self.options = options
        self.path = path
        self.on_extraction = on_extraction
        self.opaque: dict[str, str] = {}
        self.fallbacks: dict[str, str] = {}  # the failures among them (see Extraction.fallbacks)
        self.invocations: Counter[str] = Counter()
        self.renamed: dict[int, dict[str, str]] = {}
        self.grad_enabled = torch.is_grad_enabled()  # graphs follow the grad mode of the extracted call
        # a representative root's built graphs, {(path, invocation): BuiltTemplate} (see .sibling_roots)
        self.templates: dict[tuple[str, int], Any] = {}
        # {module path: reason} of the modules holding a shared module at a container entry, and the
        # modules called with a stateful argument when there are any (see .shared_names)
        self.shared_entries: dict[str, str] = {}
        self.stateful: list[str] = []

    @property
    def by_name(self) -> bool:
        """Whether the module is exported with every name of its shared modules kept (see
        :mod:`.shared_names`)."""
        return bool(self.shared_entries) and not self.stateful

    def full(self, fqn: ModulePath) -> ModulePath:
        return ModulePath(".".join(p for p in (self.path, fqn) if p))

    def fail(self, fqn: ModulePath, reason: str, error: BaseException | None, *, fix: str | None = None) -> None:
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
        if error is not None:
            self.fallbacks[where] = reason
