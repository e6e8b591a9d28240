"""``nnbridge.explain``: which modules are graphs, which run eagerly and why, what each extraction
guards on, and every re-extraction with the guard that caused it (as Dynamo's ``explain``).

Example::

    nnbridge.bridge(model, ids)
    model.config.use_cache = False
    model(ids)                            # a guard fails: extracted again
    print(nnbridge.explain(model))
    # GPT2LMHeadModel: 2 extractions kept (recompile_limit 8)
    #   extraction history:
    #     1. first call
    #     2. attribute 'use_cache' of config of <root> (GPT2Config) changed True -> False
    #   ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..errors import NNBridgeError
from ..graph import hierarchy
from ..dispatch.dispatcher import GraphDispatcher
from ..dispatch.extraction import Extraction
from ..compat.nnsight.models import wrapped_module
from ..graph.graph_module import CompiledGraphModule, GraphModuleBase, OpaqueGraphModule
from ..inplace.bridging import bridge_of
from ..graph.kinds import ModuleKind
from ..graph.node_path import ModulePath
from ..extract.options import ExtractionOptions


@dataclass
class ModuleReport:
    """One module of an extraction: ``kind`` is ``ModuleKind.GRAPH`` or ``ModuleKind.OPAQUE`` (runs
    eagerly); they equal the strings ``"graph"`` and ``"opaque"``."""

    path: str
    module_type: str
    kind: ModuleKind
    reason: str | None = None


@dataclass
class Explanation:
    """What :func:`explain` found (``str()`` draws it as a tree).

    Attributes:
        name: the model's class name.
        recompile_limit: extractions kept per module.
        history: ``(module path, reason)`` of every extraction made so far, in order, for the model
            and for the children of its opaque modules (each has a dispatcher of its own).
        guards: what the explained extraction depends on, one line each.
        modules: every module of the explained extraction, in tree order.
    """

    name: str
    recompile_limit: int
    history: list[tuple[ModulePath, str]] = field(default_factory=list)
    guards: list[str] = field(default_factory=list)
    modules: list[ModuleReport] = field(default_factory=list)

    @property
    def opaque(self) -> dict[str, str]:
        """``{module path: reason}`` of the modules that run eagerly."""
        return {m.path: m.reason or "" for m in self.modules if m.kind == ModuleKind.OPAQUE}

    def __str__(self) -> str:
        kept = sum(1 for _ in self.history)
        lines = [f"{self.name}: {kept} extraction{'s' if kept != 1 else ''} made"
                 f" (recompile_limit {self.recompile_limit} kept per module)", "  extraction history:"]
        lines += [f"    {i}. {path or '<root>'}: {reason}" for i, (path, reason) in enumerate(self.history, 1)]
        lines.append("  guards of the explained extraction:")
        lines += [f"    - {guard}" for guard in self.guards]
        lines.append("  modules:")
        for report in self.modules:
            depth = report.path.count(".") + 1 if report.path else 0
            what = "graph" if report.kind == ModuleKind.GRAPH else f"opaque (runs eagerly): {report.reason}"
            lines.append(f"    {'  ' * depth}{report.path or '<root>'} ({report.module_type}): {what}")
        return "\n".join(lines)


def _dispatcher_of(target: object) -> GraphDispatcher:
    from .patchable_graph import PatchableGraph

    if isinstance(target, PatchableGraph):
        return target._dispatcher
    wrapped = wrapped_module(target)  # an nnsight / nnbridge envoy's model
    module = target if wrapped is None else wrapped
    state = bridge_of(module) if isinstance(module, torch.nn.Module) else None
    if state is not None:
        return state.dispatcher
    if isinstance(module, torch.nn.Module):
        return GraphDispatcher(module, ExtractionOptions())
    raise NNBridgeError(f"nnbridge.explain() takes a module, a bridged model, a PatchableGraph or an nnbridge"
                        f" envoy; got {type(target).__name__}.")


def _dispatchers(dispatcher: GraphDispatcher) -> list[GraphDispatcher]:
    """``dispatcher`` and those of every opaque module's children below it, depth first."""
    found = [dispatcher]
    for extraction in dispatcher.all_extractions():
        for module in extraction.root.modules():
            if isinstance(module, OpaqueGraphModule):
                for child in module.graph_meta.child_dispatchers.values():
                    if all(child is not d for d in found):
                        found.extend(d for d in _dispatchers(cast(GraphDispatcher, child)) if all(d is not f for f in found))
    return found


def _guards(extraction: Extraction) -> list[str]:
    guard = extraction.guard
    dynamic = [f"{i}:{d}" for i, dims in enumerate(guard.dims) for d, rule in enumerate(dims) if not isinstance(rule, int)]
    lines = ["call structure: argument structure, non-tensor argument values, tensor dtypes/devices/ranks/memory"
             " layouts, train/eval flags, grad mode, autocast state, aliasing between tensor arguments",
             f"sizes: {len(guard.dims)} tensor inputs; dynamic dimensions (tensor:dim) {dynamic or 'none'}"]
    if guard.code:
        lines.append(f"export's shape guards: {guard.code}")
    if extraction.state is not None:
        lines += [f"module state: {line}" for line in extraction.state.describe()]
    return lines


def _modules(extraction: Extraction, prefix: str) -> list[ModuleReport]:
    root = extraction.root
    reports = [_report(prefix, root)]
    for path, _, _, sub in hierarchy.walk(root):
        if sub is not None:
            reports.append(_report(f"{prefix}.{path}" if prefix else path, sub))
    return reports


def _report(path: str, module: GraphModuleBase | torch.nn.Module) -> ModuleReport:
    original = module.original_type if isinstance(module, GraphModuleBase) else type(module)
    if isinstance(module, CompiledGraphModule):
        return ModuleReport(path, original.__name__, ModuleKind.GRAPH)
    return ModuleReport(path, original.__name__, ModuleKind.OPAQUE, getattr(module, "reason", None))


def explain(target: object, *args: Any, **kwargs: Any) -> Explanation:
    """Explain how nnbridge runs ``target``, as Dynamo's ``explain`` does for its traces.

    Args:
        target: a model bridged with :func:`nnbridge.bridge`, a :class:`PatchableGraph`, an
            ``nnbridge.NNsight``/``LanguageModel`` envoy, or a plain module (extracted on the spot,
            not modified).
        *args: a call's positional arguments; its extraction is explained (made if no cached
            one's guards hold, which is then recorded in the history). Without a call, the most
            recently made extraction is explained.
        **kwargs: the call's keyword arguments.

    Returns:
        An :class:`Explanation`; ``print()`` it for the tree.

    Raises:
        NNBridgeError: ``target`` is none of the above, or nothing was extracted yet and no call is given.
    """
    dispatcher = _dispatcher_of(target)
    if args or kwargs:
        extraction = dispatcher.lookup(tuple(args), dict(kwargs))
    elif dispatcher.history:
        kept = dispatcher.all_extractions()
        extraction = max(kept, key=lambda e: next(i for i, h in enumerate(dispatcher.history) if h is e))
    else:
        raise NNBridgeError(f"{type(dispatcher.module).__name__} has not been extracted yet: pass a call,"
                            " nnbridge.explain(model, *inputs), or run the model once.")
    history = [(d.path, e.reason) for d in _dispatchers(dispatcher) for e in d.history]
    return Explanation(type(dispatcher.module).__name__, dispatcher.options.recompile_limit, history,
                       _guards(extraction), _modules(extraction, dispatcher.path))
