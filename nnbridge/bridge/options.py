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
            1-tuple (as graphpatch documents). ``get_attr`` targets resolve on the module. Default:
            ``{}``.
        error_on_compilation_failure: Raise :class:`nnbridge.ExtractionError` (original exception
            as ``__cause__``) instead of falling back to an opaque module. Default: ``False``.
        warn_on_compilation_failure: Warn (:class:`nnbridge.NNBridgeWarning`) when a module falls
            back to an opaque module. Default: ``False``.
        postprocessing_function: ``fn(graph_module, original_module)`` called on every extracted
            :class:`CompiledGraphModule`; it may edit ``graph_module.graph`` in place (call
            ``graph_module.recompile()`` afterwards). Default: ``None``.
        skip_compilation: Make every module opaque; only module inputs, outputs, parameters and
            buffers are patchable. Default: ``False``.
        allow_unused_submodules: Keep submodules that the example forward never calls in the
            hierarchy (as opaque modules) instead of dropping them. Default: ``False``.
        dynamic_shapes: Export every tensor dimension as ``torch.export.Dim.AUTO`` so one
            extraction serves other sequence lengths (and batch sizes when the example batch is
            >= 2); dimensions the model fixes stay static. Default: ``True``.
        progress: Show a tqdm progress bar over the extraction stages. Default: ``False``.
        recompile_limit: Most extractions kept per module, one per set of guards (call structure,
            sizes, module state); the least recently used is evicted beyond it, and a warning
            (once) names the module and the failed guard when a module reaches it, as Dynamo's
            ``recompile_limit``. Default: ``8``.
    """

    classes_to_skip_compiling: set[type[torch.nn.Module]] = field(default_factory=set)
    custom_extraction_functions: dict[type[torch.nn.Module], Callable[[torch.nn.Module], Graph]] = (
        field(default_factory=dict)
    )
    error_on_compilation_failure: bool = False
    warn_on_compilation_failure: bool = False
    postprocessing_function: Callable[[GraphModule, torch.nn.Module], None] | None = None
    skip_compilation: bool = False
    allow_unused_submodules: bool = False
    dynamic_shapes: bool = True
    progress: bool = False
    recompile_limit: int = 8
