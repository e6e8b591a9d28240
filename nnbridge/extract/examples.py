"""Example summaries on every graph of an extraction: what ``pg.graph`` shows as shapes.

Statically first (:class:`~.summaries.ExampleSummaries`, an fx ``Interpreter`` pass over export's
metadata, as fx's ``ShapeProp``); when some value is unknown (an opaque module's result), by one
recording run of the example inputs with every op point listened. Example::

    describe_examples(extraction.root, (ids,), {})
    extraction.root.example("softmax")     # torch.Size([1, 4, 8, 8])
"""

from __future__ import annotations

from typing import Any

from ..graph.graph_module import CompiledGraphModule, GraphModuleBase, OpaqueGraphModule
from ..graph.hierarchy import NodeIndex, resolve_all, walk
from ..graph.op_point import refresh_owners
from .recording import copy_inputs
from ..graph.summaries import ExampleSummaries, bind_inputs, recording_listener, summarize


def record_examples(root: CompiledGraphModule | OpaqueGraphModule, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> None:
    """Run ``root`` once on the example inputs with every node listened, storing each node's
    summary in the graph ``pg.graph`` shows (:meth:`~.graph_module.GraphModuleBase.set_examples`).

    A node is listened in every extraction of its module (the children of opaque modules extract on
    their own and may hold several). When the run made new extractions (a child whose earlier graph
    came from a no-grad observed run extracts again under grad), nodes they ran are missed: the run
    is repeated once, listening to them too. The run is in the caller's grad mode (the mode the
    example was extracted in), on copies of the inputs (a cache argument would be updated).
    """
    for _ in range(2):
        listeners = []
        stores: dict[int, tuple[GraphModuleBase, dict[str, Any]]] = {}
        index: NodeIndex = {}  # the graphs do not change until the run
        for path, owner, name, sub in walk(root):
            if sub is not None:
                continue
            record = recording_listener(stores.setdefault(id(owner), (owner, {}))[1], name)
            for target, target_name in resolve_all(root, path.split("."), index) or [(owner, name)]:
                point = target.op_point(target_name)
                point.add_listener(record, refresh=False)
                listeners.append((point, record))
        before = len(listeners)
        refresh_owners(point for point, _ in listeners)
        try:
            root(*copy_inputs(args), **copy_inputs(kwargs))
        finally:
            for point, record in listeners:
                point.remove_listener(record, refresh=False)
            refresh_owners(point for point, _ in listeners)
        for owner, store in stores.values():
            owner.set_examples(store)
        missing = any(sub is None and owner.example(name) is None for _, owner, name, sub in walk(root))
        index = {}  # the run may have added extractions
        if not missing or sum(1 for path, _, _, sub in walk(root) if sub is None
                              for _ in resolve_all(root, path.split("."), index)) <= before:
            return


def static_examples(module: GraphModuleBase, inputs: dict[str, Any]) -> Any:
    """Summaries from export's metadata (:class:`~.summaries.ExampleSummaries`) for a compiled
    graph; the output's summary, or None when some value is unknown (then callers fall back to
    :func:`record_examples`)."""
    if not isinstance(module, CompiledGraphModule):
        return None
    return ExampleSummaries(module, inputs).propagate()


def describe_examples(root: CompiledGraphModule | OpaqueGraphModule, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> None:
    """Store example summaries on every graph of ``root``: statically from export's metadata when
    it describes every value, else by one recording run of the example inputs."""
    inputs = bind_inputs(root, [summarize(a) for a in args], {k: summarize(v) for k, v in kwargs.items()})
    if inputs is None or static_examples(root, inputs) is None:
        record_examples(root, args, kwargs)
