"""Pick the extraction that fits a call; extract anew (and cache) when a guard fails.

Like Dynamo's guarded cache: an extraction serves a call only when every assumption it baked in
still holds (its *guards*):

- the call's structure (:func:`~.call_structure.structure_key`: arguments, non-tensor values,
  tensor dtypes/devices/ranks/memory layouts, train/eval flags, grad mode, autocast state);
- its sizes (:class:`~.call_structure.ShapeGuard`: dynamic ranges and export's own shape guards);
- the module state (:class:`~.guards.StateGuard`: attribute values of every module and of its
  config, child identity, parameter and buffer identity, dtype, device, shape and
  requires_grad).

A call that eager PyTorch would hand to ``__torch_function__`` code (a tensor subclass's own, an
active ``TorchFunctionMode``) is refused: graph code calls aten operators, which skip it.

A failed guard extracts again from the call. At most ``ExtractionOptions.recompile_limit``
extractions are kept per module (least recently used evicted); when a module keeps being extracted
again, one warning names the module and the guard that failed. :attr:`GraphDispatcher.history`
records every extraction with its reason (see :func:`nnbridge.explain`).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Callable, Hashable
from typing import Any, cast

import torch

from ..compat.torch.export import register_cache_pytrees
from ..compat.torch.pytree import pytree
from ..compat.libc import collection_paused
from ..compat.torch.functorch import (
    plain_examples,
    transforming,
    transforms_suspended,
    wrapped,
    wrapper_kinds,
)
from ..compat.torch.overrides import function_override
from ..errors import NNBridgeError, warn
from ..guards.call_structure import describe_key_change, structure_key, tensor_leaves, with_flags_of, with_grad_mode
from . import extraction as _extraction
from .extraction import Extraction
from .fallback_report import fallback_report
from ..graph.module_tree import real_modules
from ..graph.failures import add_note
from ..graph.graph_module import CompiledGraphModule
from ..graph.codegen import code_generation_deferred
from ..guards.module_state import StateGuard
from ..graph import patch_state
from ..graph.locking import CALL_LOCK
from ..graph.node_path import ROOT_PATH, ModulePath
from ..graph.op_point import OpPoint, OpPointContainer
from ..graph.recipes import apply_recipes, bound_inputs
from ..extract.options import ExtractionOptions
from ..extract.sibling_roots import RootWatch, SiblingLink


@dataclass(frozen=True)
class EvictedExtraction:
    """What :attr:`GraphDispatcher.history` keeps of an extraction evicted by the LRU bound: why it
    was made and which modules were opaque (its graphs are freed)."""

    reason: str
    opaque: dict[str, str]


class WeakCallback:
    """An ``on_extraction`` callback that does not keep its object alive.

    Calls the bound method ``method`` while its object lives and removes itself from ``callbacks``
    when the object is collected: a :class:`~nnbridge.patching.patchable_graph.PatchableGraph` made
    over a bridged model listens to the bridge's extractions without the model keeping it alive.
    """

    def __init__(self, method: Callable[[GraphDispatcher, Extraction], None],
                 callbacks: list[Callable[[GraphDispatcher, Extraction], None]]):
        def remove(_: weakref.WeakMethod) -> None:
            try:
                callbacks.remove(self)
            except ValueError:
                pass
        self.method = weakref.WeakMethod(method, remove)

    def __call__(self, dispatcher: GraphDispatcher, extraction: Extraction) -> None:
        method = self.method()
        if method is not None:
            method(dispatcher, extraction)


def _nnbridge_child(module: torch.nn.Module) -> bool:
    return isinstance(module, (OpPoint, OpPointContainer))


def lookup_outside_dynamo(reason: str) -> Callable[[GraphDispatcher, tuple[Any, ...], dict[str, Any]], Extraction]:
    """``lookup(dispatcher, args, kwargs)``: ``dispatcher.lookup`` run eagerly when Dynamo traces
    the call (``torch.export`` cannot run inside its trace): a graph break, which
    ``torch.compile(..., fullgraph=True)`` refuses, giving ``reason``."""
    @torch.compiler.disable(reason=reason)
    def lookup(dispatcher: GraphDispatcher, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Extraction:
        with CALL_LOCK:
            return dispatcher.lookup(args, kwargs)
    return lookup


_lookup_outside_dynamo = lookup_outside_dynamo(
    "nnbridge extracts this call structure of the module (torch.export), which cannot run inside torch.compile's"
    " trace. Call it once outside torch.compile with these arguments (or build the PatchableGraph with them) before"
    " compiling with fullgraph=True.")


@torch.compiler.disable(reason="a patch context (pg.patch) is open in another thread or asyncio task, so whether"
                               " each patch applies depends on the calling context, which torch.compile cannot check:"
                               " the call runs uncompiled. Leave the other context, or compile without fullgraph=True.")
def _run_outside_dynamo(dispatcher: GraphDispatcher, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``dispatcher(*args, **kwargs)`` run eagerly when Dynamo traces it (a graph break)."""
    return dispatcher(*args, **kwargs)


class GraphDispatcher(torch.nn.Module):
    """Runs ``module``'s graphs: the extraction whose guards hold for the call (see module docstring).

    Args:
        module: the original module (not registered as a child; parameters are shared).
        options: extraction options for every extraction.
        path: NodePath of the module in its hierarchy (for messages).
        on_extraction: ``callback(dispatcher, extraction)`` run on each new extraction (applying
            open patches, linking a bridge); the list is shared with the dispatchers of opaque
            modules' children in the same tree. A listener that must not be kept alive by the
            model registers a :class:`WeakCallback`.
    """

    # Plain attributes, written through ``self.__dict__`` so that nn.Module does not register them
    # (``module`` would become a child and its parameters this dispatcher's own).
    #: the original module (not a child; parameters shared)
    module: torch.nn.Module
    options: ExtractionOptions
    #: NodePath of ``module`` in its hierarchy ("" for a root)
    path: ModulePath
    #: ``callback(dispatcher, extraction)`` run on each new extraction (shared within one tree)
    on_extraction: list[Callable[[GraphDispatcher, Extraction], None]]
    #: structure key -> the extractions kept for it, oldest first
    extractions: dict[Hashable, list[Extraction]]
    #: ``id(extraction)`` -> ``(structure key, extraction)``, least recently used first
    _recency: OrderedDict[int, tuple[Hashable, Extraction]]
    #: every extraction made, in order; evicted ones as :class:`EvictedExtraction`
    history: list[Extraction | EvictedExtraction]
    #: whether the thrashing warning was given
    _warned: bool
    #: whether transformers' ``Cache`` pytrees were registered (see :meth:`structure_key`)
    _pytrees_registered: bool
    #: ``module`` and its submodules (op points excluded): whose train/eval flags key a call
    flag_modules: list[torch.nn.Module]
    #: set when ``module`` is the representative of its siblings (see :mod:`.sibling_roots`)
    watch: RootWatch | None
    #: set when ``module`` is a sibling: its extractions are built from its representative's when they fit
    sibling: SiblingLink | None
    #: NodePath -> the dispatcher of a child of an opaque module in its extractions, kept across
    #: extractions: a later extraction whose opaque module calls the child alike is served by the
    #: child's extractions (their guards hold), not extracted again. One dict for the whole tree
    #: of child dispatchers below a dispatcher (keys are full NodePaths): a decoder layer called by
    #: the stack extracted as a stub of the root's graph (prefill) and by the stack extracted on its
    #: own under an opaque root (a decode step) keeps one dispatcher
    kept_children: dict[str, GraphDispatcher]

    def __init__(self, module: torch.nn.Module, options: ExtractionOptions, *, path: ModulePath = ROOT_PATH,
                 on_extraction: list[Callable[[GraphDispatcher, Extraction], None]] | None = None):
        super().__init__()
        self.__dict__["module"] = module
        self.__dict__["options"] = options
        self.__dict__["path"] = path
        self.__dict__["on_extraction"] = on_extraction if on_extraction is not None else []
        self.__dict__["extractions"] = {}
        self.__dict__["_recency"] = OrderedDict()
        self.__dict__["history"] = []
        self.__dict__["_warned"] = False
        self.__dict__["flag_modules"] = real_modules(module)
        # structure keys flatten caches: :meth:`structure_key` registers them before the first key
        # (not here: the registration imports torch's Dynamo and transformers' exporters, seconds
        # that a model only ever run eagerly, see .envoys.op_reads, never needs)
        self.__dict__["_pytrees_registered"] = False
        self.__dict__["watch"] = None
        self.__dict__["sibling"] = None
        self.__dict__["kept_children"] = {}

    def pair(self, watch: RootWatch | None, sibling: SiblingLink | None) -> None:
        """Make ``module`` the representative of its siblings (its exports watch ``watch``'s
        attributes) or a sibling (``sibling``: its extractions are built from one of its
        representative's dispatcher's when that fits the call; see :mod:`.sibling_roots`)."""
        self.__dict__["watch"] = watch
        self.__dict__["sibling"] = sibling

    def all_extractions(self) -> list[Extraction]:
        """Every extraction kept (not evicted), first one first."""
        return [e for group in self.extractions.values() for e in group]

    def add_extraction(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                       key: Hashable | None = None, *, reason: str = "first call") -> Extraction:
        """Extract for this call and cache the result under its structure key.

        Inside a torch.func transform (``grad``, ``jacrev``, ``jvp``, ``hessian``...) the extraction
        runs outside the transforms, from plain tensors holding the inputs' logical values (see
        :mod:`nnbridge.compat.torch.functorch`); the caller runs the graphs on the transformed tensors.
        Inputs batched by ``vmap`` are extracted inside the transforms.

        Args:
            args, kwargs: the call.
            key: its structure key (computed when None).
            reason: why (recorded in :attr:`history`; a failed guard's description).

        Raises:
            NNBridgeError: inside a torch.func transform that transforms the module's parameters or
                buffers (``torch.func.functional_call``), or inside ``vmap`` of a gradient transform
                (per-sample gradients) for a call structure not extracted yet.
        """
        key = self.structure_key(args, kwargs) if key is None else key
        # inside torch.func.grad, jvp...: extracted outside the transforms (vmap'd inputs: inside them,
        # as graph code may call an operator functorch cannot batch; see compat.torch.functorch)
        if transforming():
            self._refuse_transformed_state()
            kinds = wrapper_kinds((args, kwargs))
            if "vmap" not in kinds:
                args, kwargs = plain_examples((args, kwargs))
                with transforms_suspended():
                    return self._add_extraction(args, kwargs, key, reason=reason)
            if "autograd" in kinds:
                where = self.path or type(self.module).__name__
                raise NNBridgeError(
                    f"Module '{where}' ({type(self.module).__name__}) cannot be extracted inside torch.func.vmap of a"
                    " gradient transform (grad, vjp, jvp: e.g. per-sample gradients): extraction copies its inputs"
                    " with requires_grad_(), which functorch refuses there. Call the model once outside the"
                    " transforms with one sample's arguments (same structure: requires_grad, grad mode), or"
                    " nnbridge.bridge(model, *example_inputs), then transform it.")
        return self._add_extraction(args, kwargs, key, reason=reason)

    def _refuse_transformed_state(self) -> None:
        """Raise when the module's parameters or buffers are a torch.func transform's tensors
        (``torch.func.functional_call`` with transformed parameters): extraction reads and binds
        the module's own tensors, which exist only inside the transform.

        Raises:
            NNBridgeError: naming the module and the transformed tensors.
        """
        named = [*self.module.named_parameters(), *self.module.named_buffers()]
        transformed = [name for name, tensor in named if wrapped(tensor)]
        if transformed:
            where = self.path or type(self.module).__name__
            raise NNBridgeError(
                f"Module '{where}' ({type(self.module).__name__}) cannot run its graphs inside a torch.func transform"
                f" that transforms its parameters or buffers ({', '.join(transformed[:3])}; e.g."
                " torch.func.functional_call): its graphs are extracted from, and guarded by, the module's own"
                " tensors, and the transform's exist only inside it (a new set per call). Transform the inputs"
                " only, or run the unbridged model (nnbridge.unbridge(model)).")

    def _add_extraction(self, args: tuple[Any, ...], kwargs: dict[str, Any], key: Hashable, *,
                        reason: str) -> Extraction:
        # each graph's code is generated once, after the callbacks (an in-place bridge's link) edited
        # it; no cyclic garbage collection meanwhile (see .compat.allocator)
        # one warning lists the modules that fell back, for this extraction and those it triggers
        # (see .fallback_report); with warn_on_compilation_failure each was warned about already
        with fallback_report(self.module) as report, collection_paused(), code_generation_deferred():
            extraction = self._from_representative(args, kwargs)
            if extraction is None:
                extraction = extract(self.module, args, kwargs, options=self.options, path=self.path,
                                     on_extraction=self.on_extraction, watch=self.watch, children=self.kept_children)
            extraction.reason = reason
            inputs = bound_inputs(self.module, args, kwargs)
            extraction.inputs = {name: (value.shape, value.dtype, value.device) for name, value in inputs.items()
                                 if isinstance(value, torch.Tensor)}
            # graph surgery's edits, before the guards record the tree and a bridge links the graphs
            if apply_recipes(self.module, extraction.root, options=self.options, reason=reason, inputs=inputs):
                extraction.serves_no_grad = False  # (the edits' code was not in the eager run that looked for reads)
            modules = real_modules(self.module)  # children may have been replaced or added (graph surgery)
            if list(map(id, modules)) != list(map(id, self.flag_modules)):
                # later calls are keyed with the new tree's flags: so is this extraction
                key = with_flags_of(key, modules)
                self.__dict__["flag_modules"] = modules
            extraction.state = StateGuard(self.module, opaque=self._opaque_ids(extraction), skip=_nnbridge_child,
                                          path=self.path)
            if isinstance(extraction.root, CompiledGraphModule):
                extraction.root.set_entry_check(_EntryCheck(extraction, key, self.structure_key, module=self.module,
                                                            path=self.path, options=self.options, dispatcher=self))
            self.extractions.setdefault(key, []).append(extraction)
            self._recency[id(extraction)] = (key, extraction)
            self.history.append(extraction)
            self._evict()
            for callback in list(self.on_extraction):
                callback(self, extraction)
            if not self.options.warn_on_compilation_failure:
                report.add(extraction.fallbacks)
        return extraction

    def _from_representative(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Extraction | None:
        """An extraction built from one of the representative's that serves this call (the most
        recently used first), or None (see :mod:`.sibling_roots`)."""
        if self.sibling is None or not self.sibling.alike(self.module):
            return None
        representative = cast(GraphDispatcher, self.sibling.representative)
        for _, candidate in reversed(representative._recency.values()):
            # (its state guard: the representative is as it was exported)
            if candidate.shared is not None and candidate.state is not None and candidate.state.holds():
                extraction = _extraction.extract_sibling(
                    self.module, args, kwargs, options=self.options, source=candidate.shared, index=self.sibling.index,
                    child_dispatcher=_child_dispatchers(self.options, self.on_extraction, self.kept_children),
                    path=self.path, on_extraction=self.on_extraction)
                if extraction is not None:
                    return extraction
        return None

    def structure_key(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                      flat: tuple[list[Any], Any] | None = None) -> Hashable:
        """The structure key of a call to this dispatcher's module (see
        :func:`~.call_structure.structure_key`, which takes ``flat``); transformers' ``Cache``
        classes are registered as pytrees before the first one, so a cache argument is keyed by its
        contents' structure."""
        self._register_pytrees()
        return structure_key(self.flag_modules, args, kwargs, flat=flat)

    def _register_pytrees(self) -> None:
        if not self._pytrees_registered:
            register_cache_pytrees(self.module)
            self.__dict__["_pytrees_registered"] = True

    def lookup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Extraction:
        """The extraction serving this call, extracting one if no cached one's guards hold.

        Raises:
            NNBridgeError: eager PyTorch would hand the call to ``__torch_function__`` code (a
                tensor subclass's own, an active ``TorchFunctionMode``), which graph code skips
                (see :mod:`nnbridge.compat.torch.overrides`); not checked while torch compiles or exports.
        """
        key, extraction = self._find(args, kwargs)
        if extraction is not None:
            return extraction
        if not self.history:
            return self.add_extraction(args, kwargs, key)
        reason = self._why(key, args, kwargs)
        self._warn_if_thrashing(reason)
        return self.add_extraction(args, kwargs, key, reason=reason)

    def find(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Extraction | None:
        """The cached extraction serving this call, or None (nothing is extracted). While Dynamo
        traces (``torch.compile``), a model never extracted has nothing to find: its cache pytrees
        are registered by the first extraction, outside the trace.

        Raises:
            NNBridgeError: as :meth:`lookup`.
        """
        if not self.history and torch.compiler.is_dynamo_compiling():
            return None
        return self._find(args, kwargs)[1]

    def _find(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Hashable, Extraction | None]:
        """``(structure key of this call, the cached extraction serving it or None)``."""
        self._register_pytrees()
        flat = pytree.tree_flatten((args, kwargs))  # (one walk of a cache argument for both)
        tensors = [leaf for leaf in flat[0] if isinstance(leaf, torch.Tensor)]
        if not torch.compiler.is_compiling():
            self._refuse_function_overrides(tensors)
        key = self.structure_key(args, kwargs, flat)
        call = (args, kwargs)
        found = self._serving(self.extractions.get(key), tensors, call)
        if found is None and not torch.is_grad_enabled():
            # a graph extracted with grad enabled from code that reads no grad mode serves the
            # same call under torch.no_grad() (see Extraction.serves_no_grad)
            found = self._serving(self.extractions.get(with_grad_mode(key, True)), tensors, call, no_grad=True)
        return key, found

    def _serving(self, candidates: list[Extraction] | None, tensors: list[torch.Tensor],
                 call: tuple[tuple[Any, ...], dict[str, Any]], *, no_grad: bool = False) -> Extraction | None:
        """The first of ``candidates`` whose guards hold for the call (with ``no_grad``: of those
        that serve calls made with grad disabled), or None."""
        for extraction in candidates or ():
            if no_grad and not extraction.serves_no_grad:
                continue
            # every cached extraction has the state guard add_extraction gave it
            if extraction.guard.matches(tensors, call) and cast(StateGuard, extraction.state).holds():
                # (recency only orders eviction; not kept while Dynamo traces the call)
                if len(self._recency) > 1 and not torch.compiler.is_dynamo_compiling():
                    self._recency.move_to_end(id(extraction))
                return extraction
        return None

    def _refuse_function_overrides(self, tensors: list[torch.Tensor]) -> None:
        """Raise when eager PyTorch would run ``__torch_function__`` code for this call that the
        graphs' aten calls skip (see :mod:`nnbridge.compat.torch.overrides`)."""
        cause = function_override(tensors)
        if cause is not None:
            where = self.path or type(self.module).__name__
            raise NNBridgeError(
                f"Module '{where}' ({type(self.module).__name__}) cannot run its graphs for this call: {cause}. Graph"
                " code calls aten operators, which skip __torch_function__, so its results could differ from eager"
                " PyTorch. Pass plain tensors (x.as_subclass(torch.Tensor)), leave the mode before calling, or run"
                " the unbridged model (nnbridge.unbridge).")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():  # torch.compile traces through: Dynamo cannot enter a lock
            if not patch_state.all_open_here():
                # whether each patch applies depends on the calling context (see patch_state's
                # listeners), which the compiled code cannot check: the call runs uncompiled
                return _run_outside_dynamo(self, args, kwargs)
            # a call structure never extracted is extracted outside the trace (torch.export cannot run
            # inside it): a graph break, which fullgraph=True reports with the reason below
            extraction = self.find(args, kwargs)
            return self._run(args, kwargs, extraction or _lookup_outside_dynamo(self, args, kwargs))
        with CALL_LOCK:
            return self._run(args, kwargs, self.lookup(args, kwargs))

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any], extraction: Extraction) -> Any:
        root = extraction.root
        try:
            if isinstance(root, CompiledGraphModule):
                return root.run_unchecked(*args, **kwargs)
            return root(*args, **kwargs)
        except BaseException as error:
            add_note(error)
            raise

    # -- guards ---------------------------------------------------------------------------------
    def _opaque_ids(self, extraction: Extraction) -> set[int]:
        """``id``s of the modules of ``extraction`` that run eagerly."""
        ids: set[int] = set()
        for path in extraction.opaque:
            if path in ("<root>", self.path):
                ids.add(id(self.module))
                continue
            relative = path[len(self.path) + 1:] if self.path and path.startswith(self.path + ".") else path
            try:
                ids.add(id(self.module.get_submodule(relative)))
            except AttributeError:
                continue  # a renamed (reserved-name) child: guarded like a graph, which is stricter
        return ids

    def discard(self, keep: Callable[[Extraction], bool]) -> None:
        """Drop the kept extractions ``keep`` refuses (graph surgery removed an edit they hold):
        the next call that needs one extracts again. :attr:`history` keeps why each was made."""
        for ident, (key, extraction) in list(self._recency.items()):
            if not keep(extraction):
                del self._recency[ident]
                self._forget(key, extraction)

    def _why(self, key: Hashable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """Which guard of the most recently used extraction fails for this call."""
        candidates = self.extractions.get(key)
        if not candidates:
            if not self._recency:
                return "new call structure"
            last_key = next(reversed(self._recency.values()))[0]
            return describe_key_change(last_key, key)
        extraction = candidates[-1]
        tensors = tensor_leaves(args, kwargs)
        if not extraction.guard.matches(tensors, (args, kwargs)):
            return extraction.guard.failed(tensors, (args, kwargs))
        return cast(StateGuard, extraction.state).what_changed() or "module state changed"  # set by add_extraction

    def _evict(self) -> None:
        limit = max(1, self.options.recompile_limit)
        while len(self._recency) > limit:
            _, (key, oldest) = self._recency.popitem(last=False)
            self._forget(key, oldest)

    def _forget(self, key: Hashable, extraction: Extraction) -> None:
        """Drop ``extraction`` (already out of the recency order) from its key's group; history
        keeps why it was made, not its graphs (else dropped graphs live on)."""
        group = self.extractions.get(key, [])
        group[:] = [e for e in group if e is not extraction]
        if not group:
            self.extractions.pop(key, None)
        self.history[:] = [EvictedExtraction(e.reason, dict(e.opaque)) if e is extraction else e
                           for e in self.history]

    def _warn_if_thrashing(self, reason: str) -> None:
        if self._warned or len(self.history) < max(1, self.options.recompile_limit):
            return
        self.__dict__["_warned"] = True
        where = self.path or type(self.module).__name__
        warn(f"Module '{where}' ({type(self.module).__name__}) has been extracted {len(self.history) + 1} times"
             f" (ExtractionOptions.recompile_limit={self.options.recompile_limit}; the least recently used"
             f" extractions are evicted). Last guard that failed: {reason}. Calls that keep changing it extract"
             " again each time; keep it fixed, or see nnbridge.explain(model) for every re-extraction.")


class _EntryCheck:
    """A root graph's check of a call made to it directly (``extraction.root(x)``, not through a
    dispatcher): a call with the extraction's call structure that passes its size guard (and its
    module-state guard, once the dispatcher gave it one) runs the graph; any other call runs
    through a graph extracted for it, as graphpatch's ``extract()`` graphs ran any call: its
    dispatcher's (``dispatcher``), or for a graph of :func:`extract` one made on the first such
    call (``module``, ``options``, ``path``)."""

    def __init__(self, extraction: Extraction, key: Hashable, key_of: Callable[[tuple[Any, ...], dict[str, Any]], Hashable],
                 *, module: torch.nn.Module, path: ModulePath, options: ExtractionOptions,
                 dispatcher: GraphDispatcher | None = None):
        self.guard, self.state, self.key, self.key_of = extraction.guard, extraction.state, key, key_of
        self.serves_no_grad = extraction.serves_no_grad
        self.module, self.path, self.options, self.dispatcher = module, path, options, dispatcher

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> GraphDispatcher | None:
        """None when the graph serves the call, else the dispatcher that runs it."""
        key = self.key_of(args, kwargs)
        if key == self.key or self.serves_no_grad and with_grad_mode(key, True) == self.key:
            tensors = tensor_leaves(args, kwargs)
            if self.guard.matches(tensors, (args, kwargs)) and (self.state is None or self.state.holds()):
                return None
        if self.dispatcher is None:
            self.dispatcher = GraphDispatcher(self.module, self.options, path=self.path)
        return self.dispatcher


def extract(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            *, options: ExtractionOptions | None = None, path: ModulePath = ROOT_PATH,
            on_extraction: list[Callable[[GraphDispatcher, Extraction], None]] | None = None,
            watch: RootWatch | None = None, children: dict[str, GraphDispatcher] | None = None) -> Extraction:
    """Extract ``module`` for the call ``module(*args, **kwargs)``; the children of its opaque
    modules are called through :class:`GraphDispatcher`\\ s (extracted per call structure).

    As :func:`nnbridge.dispatch.extraction.extract` (arguments, result and errors), which this wires
    to the dispatcher layer; ``children`` (:attr:`GraphDispatcher.kept_children`) keeps the children's
    dispatchers for later extractions. Example::

        extraction = extract(model, (input_ids,), {})
        extraction.root.transformer.h[0].attn      # CompiledGraphModule
    """
    options = options or ExtractionOptions()
    callbacks = on_extraction if on_extraction is not None else []
    extraction = _extraction.extract(module, args, kwargs, options=options,
                                     child_dispatcher=_child_dispatchers(options, callbacks, children), path=path,
                                     on_extraction=callbacks, watch=watch)
    if isinstance(extraction.root, CompiledGraphModule):
        modules = real_modules(module)

        def key_of(a: tuple[Any, ...], k: dict[str, Any]) -> Hashable:
            return structure_key(modules, a, k)
        extraction.root.set_entry_check(_EntryCheck(extraction, key_of(args, kwargs), key_of, module=module, path=path,
                                                    options=options))
    return extraction


def _child_dispatchers(options: ExtractionOptions, callbacks: list[Callable[[GraphDispatcher, Extraction], None]],
                       children: dict[str, GraphDispatcher] | None
                       ) -> Callable[[torch.nn.Module, ModulePath], GraphDispatcher]:
    """The factory of an opaque module's children's dispatchers: the one ``children`` keeps for the
    child's NodePath when it dispatches that module object, else a new one (kept there, and
    keeping its own children there too)."""
    def child_dispatcher(child: torch.nn.Module, child_path: ModulePath) -> GraphDispatcher:
        known = children.get(child_path) if children is not None else None
        if known is not None and known.module is child:
            return known
        made = GraphDispatcher(child, options, path=child_path, on_extraction=callbacks)
        if children is not None:
            children[child_path] = made
            made.__dict__["kept_children"] = children  # shared down the tree
        return made
    return child_dispatcher
