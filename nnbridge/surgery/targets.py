"""What graph surgery edits: a bridged model, a PatchableGraph, or an nnbridge nnsight model.

:func:`target_of` says which model holds the edits (recipes live on its modules), which graphs
show the current NodePaths (the most recent extraction), and which dispatchers hold extractions
an edit makes stale. Example::

    target = target_of(pg)
    target.model, target.root, target.options
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from ..compat.nnsight.models import wrapped_module
from ..dispatch.dispatcher import GraphDispatcher
from ..dispatch.extraction import Extraction
from ..errors import SurgeryError
from ..extract.options import ExtractionOptions
from ..graph.graph_module import GraphModuleBase, OpaqueGraphModule
from ..inplace.bridging import Bridge, bridge_of
from ..patching.patchable_graph import PatchableGraph

#: What each verb says a target must be.
TARGETS = ("a model bridged with nnbridge.bridge(model, *inputs), a PatchableGraph, or an nnbridge"
           " NNsight/LanguageModel")


@dataclass
class Target:
    """One edited model and the front-end it was reached through.

    Attributes:
        model: the model whose modules hold the edits (and the inserted modules).
        pg: the PatchableGraph, when the target is one (its ``pg.graph`` is refreshed after an edit).
        bridge: the model's bridge, when it is bridged.
    """

    model: torch.nn.Module
    pg: PatchableGraph | None
    bridge: Bridge | None

    @property
    def dispatcher(self) -> GraphDispatcher:
        """The dispatcher of the whole model."""
        if self.pg is not None:
            return self.pg._dispatcher
        return cast(Bridge, self.bridge).dispatcher

    @property
    def options(self) -> ExtractionOptions:
        return self.dispatcher.options

    def root(self, what: str) -> GraphModuleBase:
        """The root graph of the most recent extraction (its NodePaths are the sites).

        Raises:
            SurgeryError: nothing is extracted yet (``what``: the verb, for the message).
        """
        if self.pg is not None:
            return self.pg._graph_module
        extractions = self.dispatcher.all_extractions()
        if not extractions:
            raise SurgeryError(
                f"{what}: {type(self.model).__name__} has no extracted graphs yet, so its NodePaths are unknown. Bridge"
                " it with example inputs (nnbridge.bridge(model, *inputs)) or call it once first.")
        return extractions[-1].root

    def dispatchers(self) -> list[GraphDispatcher]:
        """Every dispatcher holding extractions of the model or of one of its modules."""
        found: list[GraphDispatcher] = []
        pending = [self.dispatcher] if self.bridge is None else [self.dispatcher, *self.bridge.dispatchers.values()]
        while pending:
            dispatcher = pending.pop()
            if any(dispatcher is d for d in found):
                continue
            found.append(dispatcher)
            pending.extend(dispatcher.kept_children.values())
            for extraction in dispatcher.all_extractions():
                for module in extraction.root.modules():
                    if isinstance(module, OpaqueGraphModule):
                        pending.extend(cast(GraphDispatcher, d) for d in module.graph_meta.child_dispatchers.values())
        return found

    def extractions(self) -> list[Extraction]:
        """Every extraction kept by :meth:`dispatchers`."""
        return [e for d in self.dispatchers() for e in d.all_extractions()]

    def refresh(self) -> None:
        """After an edit: a PatchableGraph shows the edited graphs (its example call is extracted
        again); a bridged model extracts again on its next call (a guard fails: its tree changed)."""
        if self.pg is not None:
            self.pg.refresh_graph()


def target_of(target: Any, what: str) -> Target:
    """The :class:`Target` ``target`` names.

    Raises:
        SurgeryError: ``target`` is none of :data:`TARGETS` (a plain module: bridge it first).
    """
    if isinstance(target, PatchableGraph):
        return Target(target._dispatcher.module, target, bridge_of(target._dispatcher.module))
    wrapped = wrapped_module(target)
    module = target if wrapped is None else wrapped
    if isinstance(module, torch.nn.Module):
        if wrapped is not None and bridge_of(module) is None:  # an nnbridge envoy bridges on first need
            nnbridge_model = getattr(target, "_nnbridge_model", None)
            if callable(nnbridge_model):
                nnbridge_model()
        state = bridge_of(module)
        if state is not None:
            return Target(module, None, state)
        raise SurgeryError(f"{what}: {type(module).__name__} is not bridged. Graph surgery edits {TARGETS}; call"
                           " nnbridge.bridge(model, *example_inputs) first.")
    raise SurgeryError(f"{what} takes {TARGETS}; got {type(target).__name__}.")
