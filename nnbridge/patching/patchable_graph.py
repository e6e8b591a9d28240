"""``PatchableGraph``: a module's hierarchy of graphs, callable like the module, patchable by NodePath.

Example (graphpatch's TupleOutputModule, seed 000)::

    pg = PatchableGraph(TupleOutputModule(), torch.ones(3, 2))
    pg.graph                                  # the tree of NodePaths with shapes
    with pg.patch({"linear_0.output": [AddPatch(value=torch.ones(1))],
                   "linear_1.output": ZeroPatch()}):
        first, second = pg(torch.ones(3, 2))
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, Protocol, SupportsIndex, cast

import torch
from ..compat.torch.pytree import pytree

from ..compat.torch.hooks import has_user_hooks
from ..compat.torch.forwards import restore_body, swap_body
from ..compat.libc import collection_paused
from ..compat.torch.module_dicts import modules_of
from ..errors import NNBridgeError, NodePathError, PatchError, PatchMapError
from ..graph import hierarchy, patch_state
from ..graph.absence import explain_absence
from ..graph.edits import check_replacement
from . import varargs_paths
from ..dispatch.dispatcher import GraphDispatcher, WeakCallback
from ..dispatch.fallback_report import fallback_report
from ..guards.preservation import preserved_state
from .capture_forwarding import CaptureForwarding
from ..dispatch.extraction import Extraction
from ..graph.module_tree import named_real_modules, refuse_instance_forwards
from ..graph.graph_module import CompiledGraphModule, GraphModuleBase, OpaqueGraphModule
from ..inplace.bridging import bridge_of
from ..extract.examples import describe_examples
from .inspection import NodeView
from ..graph.summaries import summary_children
from ..graph.node_path import NodePath, NodePathStr, dig_key
from ..graph.op_point import OpPoint, refresh_owners
from ..extract.options import ExtractionOptions
from .patches import Patch
from . import saving
from ..store.programs import ProgramSource, Recorder, sources_active

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig


@contextlib.contextmanager
def body_swapped(module: torch.nn.Module, body: Callable[..., Any]) -> Iterator[None]:
    """Calls of ``module`` (hooks, then ``body(module, *args, **kwargs)``) for the duration."""
    swapped = swap_body(module, body)
    try:
        yield
    finally:
        restore_body(swapped)


#: What :meth:`PatchableGraph.patch` takes: ``{NodePath or pg.graph node: patch or [patches]}``.
#: A union of mappings, so that a typed ``dict[str, ZeroPatch]`` or ``dict[str, list[AddPatch]]``
#: checks (a mapping's key type is invariant: ``dict[str, ...]`` is no ``Mapping[str | NodeView, ...]``).
_PatchValue = Patch[Any] | Sequence[Patch[Any]]
PatchMap = Mapping[str, _PatchValue] | Mapping[NodeView, _PatchValue] | Mapping[str | NodeView, _PatchValue]


class _NamedTuple(Protocol):
    """A ``collections.namedtuple`` / ``typing.NamedTuple`` instance, as :class:`_PatchListener` rebuilds one."""

    _fields: tuple[str, ...]

    def _replace(self, **changes: Any) -> Any: ...


class _Generating(Protocol):
    """A transformers generation model (``GenerationMixin``), as :meth:`PatchableGraph.generate` calls it."""

    def generate(self, *args: Any, **kwargs: Any) -> Any: ...


class _PatchListener:
    """One ``(NodePath, patch)`` entry of an open patch context, as an op-point listener.

    Applies ``patch`` only in the thread / task that opened the context (:mod:`.patch_state`), to
    the dug element of a container value when the NodePath digs (rebuilding the container around
    it), on a clone when the patch may write into its input (``Patch.requires_clone``), and checks
    that a tensor is replaced by a tensor of the same shape, dtype and device.
    """

    def __init__(self, node_path: NodePath, patch: Patch):
        self.node_path = node_path
        self.keys = tuple(dig_key(segment) for segment in node_path.dig)
        self.patch = patch

    def __call__(self, value: Any) -> Any:
        # torch.compile cannot read the context variable; a bridged module's body or a graph dispatcher's
        # forward (over a plain model), which every compiled call into the graphs passes, has checked that
        # every open listener is the caller's (see patch_state.all_open_here), else the call runs
        # uncompiled and this is not traced
        if not torch.compiler.is_dynamo_compiling() and not patch_state.is_open(self):
            return value
        return self._apply_patch(value, 0)

    def _apply_patch(self, value: Any, depth: int) -> Any:
        if depth == len(self.keys):
            return self._patched(value)
        key = self.keys[depth]
        new = self._apply_patch(value[key], depth + 1)
        if isinstance(value, tuple):
            position = cast(int, key)  # value[key] indexed a tuple: an int
            if not hasattr(value, "_fields"):
                return value[:position] + (new,) + value[position + 1:]
            named = cast(_NamedTuple, value)
            return named._replace(**{named._fields[position]: new})
        copied = copy.copy(value)  # list, dict or ModelOutput: a new container, same elements
        copied[key] = new
        return copied

    def _patched(self, value: Any) -> Any:
        given = pytree.tree_map_only(torch.Tensor, torch.clone, value) if self.patch.requires_clone else value
        result = self.patch(given)
        if isinstance(value, torch.Tensor):  # (worded only on failure: torch.compile traces no repr)
            check_replacement(value, result, node_path=self.node_path.__str__, edit=self._editor)
        return result

    def _editor(self) -> str:
        return f"Patch {self.patch!r}"


class PatchableGraph(torch.nn.Module):
    """A module compiled into a hierarchy of patchable graphs (graphpatch's PatchableGraph).

    Calling it behaves like the module: outputs are ``torch.equal`` to the module's, gradients
    flow to the module's own parameters (shared, never copied), ``train()``/``eval()`` on the
    original module are honoured (a new call structure is extracted when they change).

    On a model bridged with :func:`nnbridge.bridge`, the PatchableGraph shares the bridge's graphs
    and op points and calling it calls the model, so patches, torch hooks on op points and the
    model's own hooks act in one forward (order: see :mod:`nnbridge.inplace.bridging`).

    Args:
        module: the model; it is not modified.
        *example_args: example positional inputs. For graphpatch compatibility an
            :class:`ExtractionOptions` may come first: ``PatchableGraph(m, ExtractionOptions(), x)``.
        options: :class:`ExtractionOptions` (keyword form).
        **example_kwargs: example keyword inputs.

    Raises:
        ExtractionError: a module has a ``forward`` set on the instance (see
            :func:`~.module_tree.refuse_instance_forwards`); or extraction failed and
            ``error_on_compilation_failure`` is set.
    """

    # children, registered by nn.Module.__setattr__
    _dispatcher: GraphDispatcher
    #: the root graph of the first extraction: what pg.graph, node_paths and NodePath checks use
    _graph_module: CompiledGraphModule | OpaqueGraphModule
    # Plain attributes, written through ``self.__dict__`` so that nn.Module does not register them
    # (``_callee`` would register the bridged model, or the dispatcher a second time, as a child).
    #: the _PatchListener objects of every open patch context (every thread)
    _active: list[_PatchListener]
    #: what a call runs: the bridged model itself, or the dispatcher over a plain model
    _callee: torch.nn.Module
    #: over a plain model ``(path, module)`` of its modules (checked for torch hooks); None over a bridged one
    _modules_of_plain: list[tuple[str, torch.nn.Module]] | None
    #: over a plain model only: the exported programs of the first extraction, for pg.save (see .saving)
    _programs: Recorder
    #: over a plain model only: where the extractions of later calls take their programs from (a
    #: loaded pg's file, put first by :func:`.saving.load`)
    _sources: list[ProgramSource]
    #: over a plain model only: the example call ``(args, kwargs)``, for pg.save
    _example: tuple[tuple[Any, ...], dict[str, Any]]
    #: over a plain model only: the graphs that run transformers' output-capturing hooks (see .capture_forwarding)
    _capture: CaptureForwarding
    #: the module's ``generation_config`` copied on first use (see :attr:`generation_config`)
    _generation_config: GenerationConfig | None

    def __init__(self, module: torch.nn.Module, *example_args: Any, options: ExtractionOptions | None = None,
                 **example_kwargs: Any):
        super().__init__()
        if example_args and isinstance(example_args[0], ExtractionOptions):
            if options is not None:
                raise TypeError("PatchableGraph got ExtractionOptions twice (positionally and as options=); pass one.")
            options, example_args = example_args[0], example_args[1:]
        self.__dict__["_active"] = []  # [_PatchListener] of open patch contexts (every thread)
        # one warning lists the modules that fell back, for the first extraction and the children of
        # opaque modules the recording run extracts again (see nnbridge.dispatch.fallback_report)
        with fallback_report(module):
            bridged = bridge_of(module)
            if bridged is not None:
                # share the bridge's graphs and op points: patches, torch hooks on op points and nnsight
                # then act on the same nodes, and calling pg runs the model (its hooks fire)
                if options is not None:
                    raise TypeError("PatchableGraph over a bridged model uses the bridge's extraction options;"
                                    " pass options to nnbridge.bridge() instead.")
                self._dispatcher = bridged.dispatcher
                # weakly: the bridged model must not keep this PatchableGraph alive
                callbacks = self._dispatcher.on_extraction
                callbacks.append(WeakCallback(self._apply_active, callbacks))
                self.__dict__["_callee"] = module
                self.__dict__["_modules_of_plain"] = None
                first = self._dispatcher.lookup(tuple(example_args), dict(example_kwargs))
            else:
                refuse_instance_forwards(module, "PatchableGraph")
                self.__dict__["_capture"] = CaptureForwarding()
                self._dispatcher = GraphDispatcher(module, options or ExtractionOptions(),
                                                   on_extraction=[self._apply_active])
                self.__dict__["_callee"] = self._dispatcher
                self.__dict__["_modules_of_plain"] = list(named_real_modules(module))
                recorder = Recorder()  # the exported programs, for pg.save (see .saving)
                with sources_active(recorder):
                    first = self._dispatcher.add_extraction(tuple(example_args), dict(example_kwargs))
                self.__dict__["_programs"] = recorder
                # not for extractions later calls make: kept, their programs would keep evicted extractions alive
                self.__dict__["_sources"] = []
                self.__dict__["_example"] = (tuple(example_args), dict(example_kwargs))
            # the recording run may extract children of opaque modules again (under no_grad): pg.save keeps those too
            recording = [self.__dict__["_programs"]] if "_programs" in self.__dict__ else []
            root = first.root
            if not saving.restore_examples(root):  # a load has them from the file
                with preserved_state(list(named_real_modules(module))), sources_active(*recording), \
                        collection_paused():
                    describe_examples(root, tuple(example_args), dict(example_kwargs))
            self._graph_module = root

    def refresh_graph(self) -> None:
        """Look the example call up again after graph surgery changed the model (a guard fails,
        so it is extracted again with the edits): ``pg.graph`` and NodePath checks then show the
        edited graphs. Over a bridged model (no example call kept) the bridge's most recent
        extraction is shown instead."""
        if self._modules_of_plain is None:
            extractions = self._dispatcher.all_extractions()
            if extractions:
                self._graph_module = extractions[-1].root
            return
        args, kwargs = self._example
        root = self._dispatcher.lookup(args, kwargs).root
        if root is not self._graph_module:
            with preserved_state(list(named_real_modules(self._dispatcher.module))), collection_paused():
                describe_examples(root, args, kwargs)
            self._graph_module = root

    # -- saving (see .saving) --------------------------------------------------------------------
    # -> Any: without a path, whatever nnsight's injected (untyped) ``save`` returns; else None
    def save(self, path: str | os.PathLike[str] | IO[bytes] | None = None, *args: Any) -> Any:
        """``pg.save(path)``: write this PatchableGraph to ``path`` (a path, written atomically, or a
        binary file) as one ``torch.save`` file: the model (pickled, weights included) and this
        extraction's archive (exported programs, metadata, example inputs). ``torch.load(path,
        weights_only=False)`` returns the PatchableGraph (trusted files only: it runs the model's
        pickle); ``PatchableGraph.load(path, model)`` rebuilds it over ``model`` without unpickling
        anything; ``torch.load(path)`` (weights_only) refuses, naming both. Without a path,
        nnsight's ``.save()`` (inside a trace) is called.

        Raises:
            SaveLoadError: see :func:`nnbridge.patching.saving.save`.
        """
        if path is None:  # nnsight injects ``save`` on every object: keep it reachable
            return super().save(*args)  # type: ignore[misc]  # nnsight adds save() at run time; Module has none
        saving.save(self, path)
        return None

    @classmethod
    def load(cls, path: str | os.PathLike[str] | IO[bytes], model: torch.nn.Module,
             options: ExtractionOptions | None = None) -> PatchableGraph:
        """The PatchableGraph that ``pg.save(path)`` saved, over ``model`` (the same class, config and
        modules; its own weights are used), without running ``torch.export`` or unpickling the
        saved model. ``options``: those the PatchableGraph was made with.

        Raises:
            SaveLoadError: corrupt/partial file, a torch.save file not written by ``pg.save``,
                another format version, another model or options (see
                :mod:`nnbridge.patching.saving`, which also gives the version policy).
        """
        return saving.load(cls, path, model, options)

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        """Refuses: a PatchableGraph is saved with ``pg.save(f)``, not pickled.

        Raises:
            ValueError: always (``torch.save(pg)``, ``pickle.dumps(pg)``, ``copy.deepcopy(pg)``).
        """
        raise ValueError("A PatchableGraph cannot be pickled (torch.save(pg), pickle, copy.deepcopy): call"
                         " pg.save(f) instead, and load it with torch.load(f, weights_only=False) for a file you"
                         " trust, or nnbridge.PatchableGraph.load(f, model).")

    # -- calling --------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        plain = self._modules_of_plain
        if plain is not None:
            self._refuse_skipped_calls(plain)
        sources = self.__dict__.get("_sources", ())  # a loaded pg's file (see .saving)
        if not sources or torch.compiler.is_dynamo_compiling():
            # (Dynamo cannot read the context variable: under torch.compile a new call structure is
            # extracted outside the trace, by export rather than from the file)
            return self._callee(*args, **kwargs)
        with sources_active(*sources):
            return self._callee(*args, **kwargs)

    def _refuse_skipped_calls(self, plain: list[tuple[str, torch.nn.Module]]) -> None:
        """Over a plain (unbridged) model the graphs replace the model's modules (``plain``: its
        ``(path, module)`` pairs), so torch hooks on those modules would not run (as in graphpatch),
        nor a ``forward`` set on one of them after the PatchableGraph was built: refuse rather than
        silently skip them (see :func:`~.module_tree.refuse_instance_forwards`)."""
        refuse_instance_forwards(self._dispatcher.module, "PatchableGraph", plain,
                                 since=" since the PatchableGraph was built")
        hooked = [path or "<root>" for path, module in plain if has_user_hooks(module)]
        if hooked:
            raise NNBridgeError(
                f"PatchableGraph over an unbridged model: torch hooks are registered on {hooked[:5]}"
                f"{' ...' if len(hooked) > 5 else ''}, and its graphs stand in for those modules, so the hooks would"
                " not run. To combine torch hooks with patches, bridge the model first (nnbridge.bridge(model, *inputs);"
                " then PatchableGraph(model, *inputs) shares its graphs and the hooks fire), or remove the hooks.")

    @property
    def extractions(self) -> list[Extraction]:
        """Every extraction made so far (one per call structure); the first is the one inspected."""
        return self._dispatcher.all_extractions()

    # -- generation (transformers) --------------------------------------------------------------
    @property
    def config(self) -> PretrainedConfig | None:
        """The module's ``config`` (transformers models), as on graphpatch's PatchableGraph."""
        return getattr(self._dispatcher.module, "config", None)

    @property
    def generation_config(self) -> GenerationConfig | None:
        """A copy of the module's ``generation_config``, taken at construction (as graphpatch);
        :meth:`generate` uses it unless given one. None for modules that do not generate."""
        if "_generation_config" not in self.__dict__:
            config = getattr(self._dispatcher.module, "generation_config", None)
            self.__dict__["_generation_config"] = copy.deepcopy(config)
        return self.__dict__["_generation_config"]

    @generation_config.setter
    def generation_config(self, value: GenerationConfig | None) -> None:
        self.__dict__["_generation_config"] = value

    @property
    def generate(self) -> Callable[..., Any]:
        """transformers' ``generate`` with every forward run through this PatchableGraph's graphs,
        so open ``pg.patch`` contexts apply at every step (graphpatch's ``PatchableGraph.generate``).
        Present only when the module generates: ``hasattr(pg, "generate")`` is False otherwise, as
        on graphpatch's PatchableGraph.

        Unlike graphpatch (which turned the cache off), the KV cache is kept (``use_cache`` as the
        module's generation config says): the cache object flows through the graphs. Each new step
        structure (prefill, decode) is extracted once. Over a bridged model this is the model's own
        ``generate``. Arguments and return value: as ``module.generate``; ``generation_config``
        defaults to :attr:`generation_config`.

        Raises:
            AttributeError: the module has no ``generate`` (not a transformers generation model);
                the message says to call the PatchableGraph in a loop instead.
        """
        if not callable(getattr(self._dispatcher.module, "generate", None)):
            raise AttributeError(self._no_generate())
        return self._generate

    def _no_generate(self) -> str:
        return (f"PatchableGraph.generate: {type(self._dispatcher.module).__name__} has no generate() (not a"
                " transformers model with GenerationMixin); call the PatchableGraph in a loop instead.")

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "generate":  # the property raised: keep its message, not torch's generic one
                raise AttributeError(self._no_generate()) from None
            raise

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        module = self._dispatcher.module
        plain = self._modules_of_plain
        if plain is not None:
            self._refuse_skipped_calls(plain)
        own = getattr(module, "generation_config", None)
        if "generation_config" not in kwargs and self.generation_config is not None and (
                own is None or self.generation_config.to_dict() != own.to_dict()):  # changed on pg
            kwargs["generation_config"] = copy.deepcopy(self.generation_config)
        if self._callee is not self._dispatcher:  # a bridged model: its own generate runs the graphs
            self._check_bridged()
            return cast(_Generating, self._callee).generate(*args, **kwargs)
        dispatcher = self._dispatcher
        with body_swapped(module, lambda _module, *a, **k: dispatcher(*a, **k)):
            return cast(_Generating, module).generate(*args, **kwargs)  # checked callable in generate

    # -- inspection -----------------------------------------------------------------------------
    @property
    def graph(self) -> NodeView:
        """The NodePath tree of the first extraction (tab-completes; repr shows shapes)."""
        return NodeView(NodePathStr(""), None, "", graph=self._graph_module, model=self._dispatcher.module)

    def node_paths(self) -> list[str]:
        """Every valid leaf NodePath (dig paths included), in tree order."""
        return leaf_node_paths(self._graph_module)

    def op_point(self, path: str | NodeView) -> OpPoint:
        """The :class:`OpPoint` of a node (for torch hooks). Every extraction (call structure) that
        has a node at this NodePath uses this one op point, so its hooks fire on every call, as
        patches apply to every extraction."""
        node_path = self._validate(str(path))
        owner, name = self._resolve(self._graph_module, node_path)[0]
        point = owner.op_point(name)
        for extraction in self.extractions:
            for other, other_name in self._resolve(extraction.root, node_path):
                other.share_point(other_name, point)
        refresh_owners([point])
        return point

    # -- patching -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def patch(self, patch_map: PatchMap) -> Iterator[PatchableGraph]:
        """Apply patches for the duration of the context (graphpatch's ``PatchableGraph.patch``).

        Args:
            patch_map: ``{NodePath or pg.graph node: patch or [patches]}`` (a dict, or any other
                mapping); on one node patches apply in list order, after those of enclosing contexts.

        Raises:
            NodePathError: (a ``KeyError``, as in graphpatch) paths are unknown, not
                leaves (a graph, or a container value without a ``|`` dig), or dig into nothing;
                every bad path is listed with the closest valid ones. Raised before anything is
                patched; the model does not run.
            PatchMapError: (a ``ValueError`` as in graphpatch, and a ``TypeError``) ``patch_map``
                is not a mapping, or a value is not a Patch or a list of Patches.
        """
        if not isinstance(patch_map, Mapping):
            raise PatchMapError(
                f"pg.patch() takes a dict (or another mapping) {{NodePath: patch or [patches]}}, got"
                f" {type(patch_map).__name__}: {patch_map!r}. Example: pg.patch({{'linear_0.output': ZeroPatch()}}).")
        errors: list[str] = []
        plan: list[tuple[NodePath, Patch]] = []
        for key, value in patch_map.items():
            if not isinstance(key, (str, NodeView)):
                raise PatchMapError(f"pg.patch() keys must be NodePath strings or pg.graph nodes, got {key!r}"
                                    f" ({type(key).__name__}). Example: pg.patch({{'linear_0.output': ZeroPatch()}}).")
            # (checked just below: every element a Patch)
            patches = cast("list[Patch[Any]]", list(value) if isinstance(value, (list, tuple)) else [value])
            bad = [p for p in patches if not isinstance(p, Patch)]
            if bad:
                raise PatchMapError(f"The patches for {str(key)!r} must be Patch objects (ZeroPatch(), AddPatch(value=...),"
                                f" ...) or a list of them; got {bad[0]!r}.")
            try:
                node_path = self._validate(str(key) if isinstance(key, NodeView) else key)
            except NodePathError as error:
                errors.append(str(error))
                continue
            for patch in patches:  # graphpatch's Patch.path: the dig part of the NodePath
                patch.path = ".".join(node_path.dig) or None
            plan.extend((node_path, patch) for patch in patches)
        if errors:
            raise NodePathError("Invalid NodePaths (nothing was patched):\n- " + "\n- ".join(errors))
        self._check_bridged()
        listeners = [_PatchListener(node_path, patch) for node_path, patch in plan]
        added: list[_PatchListener] = []
        # open before attaching and detached before closing: a listener is on an op point only while
        # its context is open (what a compiled graph's check relies on, see patch_state.all_open_here)
        with patch_state.opened(listeners):
            try:
                for listener in listeners:
                    self._listen(listener.node_path, listener, add=True)
                    added.append(listener)
                    self._active.append(listener)
                yield self
            finally:
                for listener in reversed(added):
                    self._listen(listener.node_path, listener, add=False)
                    self._active.remove(listener)

    def _check_bridged(self) -> None:
        """A PatchableGraph made over a bridged model patches the bridge's graphs: they do not
        run once the model is unbridged."""
        if self._callee is not self._dispatcher and bridge_of(self._callee) is None:
            raise PatchError(
                f"pg.patch(): the {type(self._callee).__name__} this PatchableGraph was made over has been unbridged"
                " (nnbridge.unbridge), so its graphs no longer run and patches would do nothing. Bridge it again and"
                " make a new PatchableGraph, or make one over the plain model: PatchableGraph(model, *inputs).")

    def _listen(self, node_path: NodePath, listener: _PatchListener, *, add: bool) -> None:
        # op points are shared by the call structures' graphs: each distinct point once
        points = list({id(p): p for extraction in self.extractions
                       for owner, name in self._resolve(extraction.root, node_path)
                       for p in [owner.op_point(name)]}.values())
        for point in points:
            (point.add_listener if add else point.remove_listener)(listener, refresh=False)
        refresh_owners(points)

    def _apply_active(self, dispatcher: GraphDispatcher, extraction: Extraction) -> None:
        """A new extraction: it shares the op points made so far on the first extraction (torch
        hooks on op points, see :meth:`op_point`); while patch contexts are open, its op points not
        yet listened get the open contexts' listeners (a shared point has them already). Over a
        plain model its graphs also run transformers' output-capturing hooks of the modules they
        stand in for (:mod:`.capture_forwarding`)."""
        if self._modules_of_plain is not None:
            self._capture.add(extraction.root, dispatcher.module)
            self._capture.watch(dispatcher)
        self._share_made_points(dispatcher, extraction)
        if not self._active:
            return
        points = []
        prefix = self._prefix_of(dispatcher)
        for listener in self._active:
            nodes = listener.node_path.nodes
            if nodes[:len(prefix)] != prefix or len(nodes) == len(prefix):
                continue
            for owner, name in self._resolve(extraction.root, NodePath(nodes[len(prefix):], listener.node_path.dig)):
                point = owner.op_point(name)
                if not point.has_listener(listener):
                    point.add_listener(listener, refresh=False)
                    points.append(point)
        refresh_owners(points)

    def _share_made_points(self, dispatcher: GraphDispatcher, extraction: Extraction) -> None:
        first = cast("CompiledGraphModule | OpaqueGraphModule | None", modules_of(self).get("_graph_module"))
        if first is None or self._modules_of_plain is None:  # the first extraction; or a bridge shares them
            return
        made = {f"{path}.{name}" if path else name: point
                for path, graph in [("", first), *((p, sub) for p, _, _, sub in hierarchy.walk(first) if sub)]
                for name, point in graph.named_op_points_made().items()}
        if not made:
            return
        prefix = ".".join(self._prefix_of(dispatcher))
        shared = []
        for path, owner, name, sub in hierarchy.walk(extraction.root):
            point = made.get(f"{prefix}.{path}" if prefix else path) if sub is None else None
            if point is not None:
                owner.share_point(name, point)
                shared.append(point)
        refresh_owners(shared)

    def _prefix_of(self, dispatcher: GraphDispatcher) -> tuple[str, ...]:
        """The NodePath segments of the module a dispatcher serves (the child of an opaque module
        extracts on its own), relative to this graph's root; () for the root's dispatcher."""
        path, own = dispatcher.path, self._dispatcher.path
        if dispatcher is self._dispatcher or not path:
            return ()
        relative = path[len(own) + 1:] if own and path.startswith(f"{own}.") else path
        segments = hierarchy.split_segments(self._graph_module, tuple(relative.split(".")))
        return tuple(segments) if segments else ()

    # -- NodePath validation --------------------------------------------------------------------
    def _resolve(self, root: GraphModuleBase, node_path: NodePath) -> list[tuple[GraphModuleBase, str]]:
        segments = hierarchy.split_segments(root, node_path.nodes)
        return hierarchy.resolve_all(root, segments) if segments else []

    def _validate(self, text: str) -> NodePath:
        root = self._graph_module
        node_path = varargs_paths.canonical(root, NodePath.parse(text))  # graphpatch's "foos|sub_0"
        segments = hierarchy.split_segments(root, node_path.nodes)
        if segments is None:
            raise NodePathError(self._absence(text, node_path.nodes))
        canonical = NodePath(tuple(segments), node_path.dig)
        hits = hierarchy.resolve_all(root, segments)
        if not hits:
            raise NodePathError(
                f"{text!r} is a graph, not a node: patch one of its nodes, e.g. '{'.'.join(segments)}.output'.")
        owner, name = hits[0]
        summary = owner.example(name)
        for depth, segment in enumerate(node_path.dig):
            keys = [k for k, _ in summary_children(summary)]
            if segment not in keys:
                where = str(NodePath(canonical.nodes, node_path.dig[:depth]))
                raise NodePathError(f"{text!r}: cannot dig {segment!r} into {where!r}; valid: {keys or 'none (a leaf)'}.")
            summary = dict(summary_children(summary))[segment]
        if summary_children(summary):
            keys = [k for k, _ in summary_children(summary)]
            raise NodePathError(
                f"{text!r} is not a leaf: its value is a container; dig into it with '|', e.g. "
                f"'{canonical}{'.' if node_path.dig else '|'}{keys[0]}' (choices: {keys}).")
        return canonical

    def _absence(self, text: str, nodes: tuple[str, ...]) -> str:
        """Why ``text`` is not a node (see :func:`absence_message`)."""
        return absence_message(self._graph_module, text, nodes, model=self._dispatcher.module)


def leaf_node_paths(root: GraphModuleBase) -> list[str]:
    """Every valid leaf NodePath (dig paths included) of the hierarchy under ``root``, in tree order."""
    paths = []
    for path, owner, name, sub in hierarchy.walk(root):
        if sub is not None:
            continue
        summary = owner.example(name)
        paths.extend(_leaf_paths(path, summary, first=True))
    return paths


def absence_message(root: GraphModuleBase, text: str, nodes: tuple[str, ...], *, model: torch.nn.Module) -> str:
    """Why ``text`` (segments ``nodes``) is not a node of the hierarchy under ``root``, extracted
    from ``model`` (:func:`~nnbridge.graph.absence.explain_absence`): the module its longest valid
    prefix names runs eagerly, or its attention implementation has no such op, or the closest valid
    NodePaths."""
    found = hierarchy.deepest(root, nodes)
    graph, resolved, missing = found if found is not None else (None, [], 0)
    children = hierarchy.children(graph) if graph is not None else []
    where = f"{'.'.join(resolved) or '<root>'} ({graph.original_type.__name__})" if graph is not None else ""
    return explain_absence(
        f"{text!r} is not a node", nodes[missing] if nodes else text, where=where,
        ops=[name for name, _ in children], model=model,
        opaque=graph.reason if isinstance(graph, OpaqueGraphModule) else None,
        original=graph.original if isinstance(graph, OpaqueGraphModule) else None,
        submodules=[name for name, sub in children if sub is not None], paths=leaf_node_paths(root), asked=text,
        hint=hierarchy.alias_hint(root, nodes))


def _leaf_paths(path: str, summary: Any, first: bool) -> list[str]:
    kids = summary_children(summary)
    if not kids:
        return [path]
    sep = "|" if first else "."
    return [p for key, value in kids for p in _leaf_paths(f"{path}{sep}{key}", value, first=False)]
