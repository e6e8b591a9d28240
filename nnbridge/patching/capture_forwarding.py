"""transformers' output-capturing hooks, run by the graphs that stand in for their modules.

transformers 5 collects ``output_attentions`` / ``output_hidden_states`` with forward hooks on the
original attention and decoder-layer modules (see :mod:`nnbridge.compat.transformers.output_capturing`). A
:class:`~.patchable_graph.PatchableGraph` over a plain model calls graph modules in place of those
modules, so the hooks would never fire and the model's decorated forward would find nothing
collected. :func:`forward_capturing_hooks` gives each graph a forward hook that runs its original
module's capturing hooks, read at call time (transformers installs them lazily, on the first call
that captures), with the graph's positional arguments and output, as the original call would.

An in-place bridge needs none of this: parent graphs call the user's modules themselves, so their
hooks fire (:mod:`.in_place`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..compat.torch.hooks import capturing_hooks
from ..graph.graph_module import CompiledGraphModule, GraphModuleBase
from ..graph.metadata import node_meta

_FORWARDED = "_nnbridge_capturing_forwarded"


def forward_capturing_hooks(graph: GraphModuleBase, module: torch.nn.Module) -> None:
    """Make ``graph`` (standing in for ``module``) and, recursively, its child graphs run their
    original modules' output-capturing hooks after each call. A graph already done is skipped
    (graphs are shared by several callers: kept child dispatchers, reused extractions).

    Args:
        graph: the root graph of an extraction (a compiled or opaque graph module).
        module: the original module it was extracted from.
    """
    if graph.__dict__.get(_FORWARDED):
        return
    graph.__dict__[_FORWARDED] = True

    def run_original_hooks(_graph: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        for hook in capturing_hooks(module):
            hook(module, args, output)  # transformers' hooks return None (they only collect)

    torch.nn.Module.register_forward_hook(graph, run_original_hooks)  # type: ignore[arg-type]  # graphs are Modules
    if isinstance(graph, CompiledGraphModule):
        for node in graph.graph.nodes:
            if node.op == "call_module":
                forward_capturing_hooks(graph.child_graph(node), module.get_submodule(node_meta(node).module_path or ""))
    # an opaque graph's children are called through their own dispatchers, whose extractions get
    # this on their own (PatchableGraph's on_extraction callback reaches child dispatchers)
