"""transformers' output-capturing hooks, run by the graphs that stand in for their modules.

transformers 5 collects ``output_attentions`` / ``output_hidden_states`` with forward hooks on the
original attention and decoder-layer modules (see :mod:`nnbridge.compat.transformers.output_capturing`). A
:class:`~.patchable_graph.PatchableGraph` over a plain model calls graph modules in place of those
modules, so the hooks would never fire and the model's decorated forward would find nothing
collected. :class:`CaptureForwarding` gives a graph a forward hook that runs its original module's
capturing hooks (read at call time), with the graph's positional arguments and output, as the
original call would, once its original module holds such hooks.

Only those graphs get the hook: a graph with a torch hook takes ``nn.Module``'s slower call path
at every call, and a model that never captures never holds capturing hooks. transformers installs
them lazily, inside the first forward that captures: that forward runs the decorated module's own
code (it is opaque, see :mod:`nnbridge.extract.eager_checks`), which calls its children through
their graph dispatchers. So the forwarding is brought up to date (:meth:`CaptureForwarding.sync`)
before each call of a dispatcher (a forward pre-hook on each) and after each extraction, whenever a
torch hook was registered anywhere since the last time (:func:`~nnbridge.compat.torch.hooks.hook_registrations`).

While Dynamo traces a call (``torch.compile``) the pre-hook does nothing: the check would guard the
compiled code on that process-wide counter, which compiling itself moves (AOT autograd registers
hooks), so every call would compile again. There the forwarding is brought up to date after each
extraction (a call structure never extracted is extracted outside the trace, and transformers
installs its hooks in that extraction's eager runs) and before each uncompiled call.

An in-place bridge needs none of this: parent graphs call the user's modules themselves, so their
hooks fire (:mod:`.in_place`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..compat.torch.hooks import capturing_hooks, hook_registrations
from ..graph.graph_module import CompiledGraphModule, GraphModuleBase
from ..graph.locking import CALL_LOCK
from ..graph.metadata import node_meta

_FORWARDED = "_nnbridge_capturing_forwarded"
#: marks a graph :meth:`CaptureForwarding.add` collected, and a dispatcher :meth:`CaptureForwarding.watch` hooked
_COLLECTED = "_nnbridge_capturing_collected"
_WATCHED = "_nnbridge_capturing_watched"


class CaptureForwarding:
    """The graphs of one :class:`~.patchable_graph.PatchableGraph` over a plain model, each with the
    module it stands in for, forwarded once that module holds transformers' capturing hooks.
    Example::

        forwarding = CaptureForwarding()
        forwarding.add(extraction.root, model)   # each new extraction (and its child graphs)
        forwarding.watch(dispatcher)             # each graph dispatcher: brought up to date before its calls
    """

    def __init__(self) -> None:
        #: ``(graph, original module)`` of the graphs not forwarded yet, each graph held weakly (the
        #: dispatchers own the extractions: an evicted one must be freed)
        self._waiting: list[tuple[weakref.ref[GraphModuleBase], torch.nn.Module]] = []
        #: :func:`hook_registrations` at the last full look, or -1 (none yet)
        self._seen = -1

    def add(self, graph: GraphModuleBase, module: torch.nn.Module) -> None:
        """Watch ``graph`` (standing in for ``module``; the root graph of an extraction, a compiled or
        opaque graph module) and, recursively, its child graphs; forward those whose modules hold
        capturing hooks now. A graph already watched is skipped (graphs are shared by several
        callers: kept child dispatchers, reused extractions)."""
        self._collect(graph, module)
        self._seen = -1
        self.sync()

    def _collect(self, graph: GraphModuleBase, module: torch.nn.Module) -> None:
        if graph.__dict__.get(_COLLECTED):
            return
        graph.__dict__[_COLLECTED] = True
        self._waiting.append((weakref.ref(graph), module))
        if isinstance(graph, CompiledGraphModule):
            for node in graph.graph.nodes:
                if node.op == "call_module":
                    self._collect(graph.child_graph(node), module.get_submodule(node_meta(node).module_path or ""))
        # an opaque graph's children are called through their own dispatchers, whose extractions
        # are added on their own (PatchableGraph's on_extraction callback reaches child dispatchers)

    def sync(self) -> None:
        """Forward every waiting graph whose module now holds capturing hooks; nothing to do (one
        comparison) when no torch hook was registered anywhere since the last look."""
        if not self._waiting or hook_registrations() == self._seen:
            return
        waiting = []
        for ref, module in self._waiting:
            graph = ref()
            if graph is None:  # its extraction was evicted and freed
                continue
            if capturing_hooks(module):
                _forward(graph, module)
            else:
                waiting.append((ref, module))
        self._waiting = waiting
        self._seen = hook_registrations()  # (after _forward's own registrations)

    def watch(self, dispatcher: torch.nn.Module) -> None:
        """Bring the forwarding up to date before each call of ``dispatcher`` (a graph dispatcher of
        this PatchableGraph's tree), by a forward pre-hook on it (once)."""
        if dispatcher.__dict__.get(_WATCHED):
            return
        dispatcher.__dict__[_WATCHED] = True

        def before_call(_dispatcher: torch.nn.Module, _args: tuple[Any, ...]) -> None:
            if torch.compiler.is_dynamo_compiling():
                return  # see the module docstring
            with CALL_LOCK:  # one thread forwards a graph: two would each register its hook
                self.sync()

        in_sync = hook_registrations() == self._seen
        torch.nn.Module.register_forward_pre_hook(dispatcher, before_call)
        if in_sync:  # (this registration forwards nothing)
            self._seen = hook_registrations()


def _forward(graph: GraphModuleBase, module: torch.nn.Module) -> None:
    """Give ``graph`` a forward hook running ``module``'s capturing hooks after each call (once)."""
    if graph.__dict__.get(_FORWARDED):
        return
    graph.__dict__[_FORWARDED] = True

    def run_original_hooks(_graph: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        for hook in capturing_hooks(module):
            hook(module, args, output)  # transformers' hooks return None (they only collect)

    torch.nn.Module.register_forward_hook(graph, run_original_hooks)  # type: ignore[arg-type]  # graphs are Modules
