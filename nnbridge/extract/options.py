"""Extraction options, as graphpatch's ``ExtractionOptions`` (keyword-only dataclass)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule


@dataclass(kw_only=True)
class ExtractionOptions:
    """Options controlling how a module is turned into a hierarchy of graphs.

    Attributes:
        classes_to_skip_compiling: Module classes left as :class:`OpaqueGraphModule`: only their
            inputs, outputs, parameters and buffers are patchable; their children are still
            extracted. Default: ``set()``.
        custom_extraction_functions: ``{module type: fn(module) -> torch.fx.Graph}``. The graph's
            placeholders must be named exactly as ``forward()``'s arguments and its output must be a
            1-tuple (as graphpatch documents). ``get_attr`` targets resolve on the module. A
            function that raises is a compilation failure (as graphpatch: the module falls back to
            opaque, per the warn/error options); a malformed graph raises
            :class:`nnbridge.ExtractionError`. Default: ``{}``.
        error_on_compilation_failure: Raise :class:`nnbridge.ExtractionError` naming the module
            (original exception as ``__cause__``) instead of falling back to an opaque module when a
            module cannot be exported, its graph would differ from its code (grad-mode changes,
            side effects, Dynamo's ``graph_break()``), building its graph module raises, or its
            custom extraction function raises. Default: ``False``.
        warn_on_compilation_failure: Warn (:class:`nnbridge.NNBridgeWarning`) for each module that
            falls back to an opaque module, as graphpatch. When ``False``, one warning per
            extraction lists them all in a table (module path, cause); none when nothing fell back
            (see :mod:`nnbridge.dispatch.fallback_report`). Default: ``False``.
        postprocessing_function: ``fn(graph_module, original_module)`` called on every extracted
            :class:`CompiledGraphModule`; it may edit ``graph_module.graph`` in place (call
            ``graph_module.recompile()`` afterwards). Default: ``None``.
        skip_compilation: Make every module opaque; only module inputs, outputs, parameters and
            buffers are patchable. Default: ``False``.
        allow_unused_submodules: Whether a submodule the example forward never calls is a normal
            condition: it stays in the hierarchy as an :class:`OpaqueGraphModule` (its own code;
            its parameters and buffers kept, so ``named_parameters()``/``state_dict()`` of the
            graphs match the module's). When False it is a compilation failure: with
            ``error_on_compilation_failure`` extraction raises :class:`nnbridge.ExtractionError`
            naming it, else it is kept opaque all the same (and warned about with
            ``warn_on_compilation_failure``). Default: ``True`` unless
            ``error_on_compilation_failure`` is set ("strict mode"), as graphpatch's
            ``allow_unused_submodules``.
        dynamic_shapes: Export every tensor dimension as ``torch.export.Dim.AUTO`` so one
            extraction serves other sequence lengths (and batch sizes when the example batch is
            >= 2); dimensions the model fixes stay static. Default: ``True``.
        dynamic_dims: With ``dynamic_shapes``, the dimensions of the extracted call's positional
            arguments exported as ``torch.export.Dim.AUTO``: one entry per positional argument, a
            tuple of dimension indices for a tensor (the others stay static) or ``None`` (none: a
            static tensor, or any other value); keyword arguments keep every dimension dynamic. Only the call of the
            module given to :class:`PatchableGraph` follows it (its submodules' own extractions
            do not). For a submodule extracted alone that should get the graphs its model's
            extraction gives it: the model's inputs fix some of its dimensions (a hidden size),
            which export would otherwise read as symbols (``sym_size`` nodes). ``None`` (every
            dimension of size >= 2). Raises :class:`ValueError` when malformed, and
            :class:`nnbridge.ExtractionError` at extraction when it does not fit the call (another
            number of positional arguments, dimensions for a non-tensor, an index past a tensor's
            rank). Default: ``None``.
        progress: Show a tqdm bar on stderr naming the extraction's stage (exporting, writing the
            cache, building graphs): ``True`` always, ``False`` never, ``None`` when stderr is a
            terminal and the module has at least ``nnbridge.extract.progress.AUTO_MODULES`` (100)
            submodules, the estimate of an extraction longer than a couple of seconds. Default:
            ``None``.
        recompile_limit: Most extractions kept per module, one per set of guards (call structure,
            sizes, module state); the least recently used is evicted beyond it, and a warning
            (once) names the module and the failed guard when a module reaches it, as Dynamo's
            ``recompile_limit``. Default: ``8``.
        reuse_layers: Export one representative of identical ``ModuleList`` entries (decoder layers
            of one class, config and call) and build the others' graphs from its graph, each over
            its own parameters, buffers and op points (see :mod:`nnbridge.extract.reuse_plan`). Applies
            to entries called once each, without a stateful argument or with a transformers
            ``DynamicCache`` of which each writes its own layer (``layer_idx``, the default
            ``use_cache=True``); anything else, or any doubt found while exporting (an attribute
            that differs between layers read otherwise than as the cache layer index, another cache
            layer touched), means per-layer export, with the same graphs. Default: ``True``.
    """

    classes_to_skip_compiling: set[type[torch.nn.Module]] = field(default_factory=set)
    custom_extraction_functions: dict[type[torch.nn.Module], Callable[[torch.nn.Module], Graph]] = (
        field(default_factory=dict)
    )
    error_on_compilation_failure: bool = False
    warn_on_compilation_failure: bool = False
    postprocessing_function: Callable[[GraphModule, torch.nn.Module], None] | None = None
    skip_compilation: bool = False
    allow_unused_submodules: bool | None = None
    dynamic_shapes: bool = True
    dynamic_dims: tuple[tuple[int, ...] | None, ...] | None = None
    progress: bool | None = None
    recompile_limit: int = 8
    reuse_layers: bool = True

    def __post_init__(self) -> None:
        if self.allow_unused_submodules is None:  # graphpatch's default: lenient unless strict
            self.allow_unused_submodules = not self.error_on_compilation_failure
        if self.dynamic_dims is not None:
            self.dynamic_dims = _checked_dims(self.dynamic_dims)


def _checked_dims(dims: object) -> tuple[tuple[int, ...] | None, ...]:
    """``dynamic_dims`` as tuples, or ValueError naming the entry at fault and the form expected."""
    form = ("dynamic_dims must be a tuple with one entry per positional argument: a tuple of non-negative"
            " dimension indices for a tensor, None for any other value (e.g. ((1,), None))")
    if not isinstance(dims, (tuple, list)):
        raise ValueError(f"{form}; got {dims!r}")
    checked: list[tuple[int, ...] | None] = []
    for position, entry in enumerate(dims):
        if entry is None:
            checked.append(None)
            continue
        if not isinstance(entry, (tuple, list)) or not all(
                isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in entry):
            raise ValueError(f"{form}; entry {position} is {entry!r}")
        checked.append(tuple(sorted(set(entry))))
    return tuple(checked)
