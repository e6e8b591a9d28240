"""Example summaries on every graph of an extraction: what ``pg.graph`` shows as shapes.

Statically first (:class:`~.summaries.ExampleSummaries`, an fx ``Interpreter`` pass over export's
metadata, as fx's ``ShapeProp``); when some value is unknown (an opaque module's result), by one
recording run of the example inputs with every op point listened. Example::

    describe_examples(extraction.root, (ids,), {})
    extraction.root.example("softmax")     # torch.Size([1, 4, 8, 8])
"""

from __future__ import annotations

from typing import Any

import torch

from .graph_module import CompiledGraphModule, GraphModuleBase
from .hierarchy import walk
from .op_point import refresh_owners
from .recording import copy_inputs
from .summaries import ExampleSummaries, bind_inputs, recording_listener, summarize


def record_examples(root: GraphModuleBase, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Run ``root`` once on the example inputs with every node listened, storing each node's
    summary in its graph (:meth:`~.graph_module.GraphModuleBase.set_examples`)."""
    listeners = []
    stores: dict[int, tuple[GraphModuleBase, dict[str, Any]]] = {}
    for _, owner, name, sub in walk(root):
        if sub is not None:
            continue
        store = stores.setdefault(id(owner), (owner, {}))[1]
        record = recording_listener(store, name)
        point = owner.op_point(name)
        point.add_listener(record, refresh=False)
        listeners.append((point, record))
    refresh_owners(point for point, _ in listeners)
    try:
        with torch.no_grad():  # on copies: a cache argument would be updated in place
            root(*copy_inputs(args), **copy_inputs(kwargs))
    finally:
        for point, record in listeners:
            point.remove_listener(record, refresh=False)
        refresh_owners(point for point, _ in listeners)
    for owner, store in stores.values():
        owner.set_examples(store)


def static_examples(module: GraphModuleBase, inputs: dict[str, Any]) -> Any:
    """Summaries from export's metadata (:class:`~.summaries.ExampleSummaries`) for a compiled
    graph; the output's summary, or None when some value is unknown (then callers fall back to
    :func:`record_examples`)."""
    if not isinstance(module, CompiledGraphModule):
        return None
    return ExampleSummaries(module, inputs).propagate()


def describe_examples(root: GraphModuleBase, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Store example summaries on every graph of ``root``: statically from export's metadata when
    it describes every value, else by one recording run of the example inputs."""
    inputs = bind_inputs(root, [summarize(a) for a in args], {k: summarize(v) for k, v in kwargs.items()})
    if inputs is None or static_examples(root, inputs) is None:
        record_examples(root, args, kwargs)
