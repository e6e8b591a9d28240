"""``ExtractionOptions.custom_extraction_functions``: the user's own graph for a module class.

As graphpatch: the function returns a ``torch.fx.Graph`` whose placeholders are named as the
module's ``forward()`` arguments; a function that raises falls back to opaque (or warns or raises,
per the options), a malformed graph raises. Example::

    options = ExtractionOptions(custom_extraction_functions={MyBlock: lambda m: my_graph})
"""

from __future__ import annotations

import inspect

import torch

from .assembly import resolve_attr
from .context import ExtractionContext
from ..graph.graph_module import CompiledGraphModule
from ..graph.metadata import update_node_meta
from ..graph.node_path import ModulePath
from ..errors import ExtractionError


#: What a custom extraction function's failure message tells the user to do.
CUSTOM_FIX = ("Fix the function, remove the module's class from ExtractionOptions.custom_extraction_functions, or"
              " set error_on_compilation_failure=False to fall back to an opaque module.")


class CustomFunctionFailed(Exception):
    """A custom extraction function raised ``error`` (the module then falls back to opaque)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def custom_graph(ctx: ExtractionContext, fqn: ModulePath, module: torch.nn.Module) -> CompiledGraphModule:
    """A graph from a user's custom extraction function (graphpatch's custom_extraction_functions).

    Raises:
        CustomFunctionFailed: the function raised.
        ExtractionError: the graph it returned is malformed (a mistake in the function: always loud).
    """
    try:
        graph = ctx.options.custom_extraction_functions[type(module)](module)
    except Exception as error:  # noqa: BLE001 - the caller falls back to opaque (or raises)
        raise CustomFunctionFailed(error) from error
    output = next(n for n in graph.nodes if n.op == "output")
    value = output.args[0]
    if not (isinstance(value, tuple) and len(value) == 1):
        raise ExtractionError(
            f"The custom extraction function for {type(module).__name__} (module '{ctx.full(fqn) or '<root>'}')"
            f" returned a graph whose output is {type(value).__name__}, not a 1-tuple; wrap the output as"
            " graph.output((value,)) as graphpatch documents.")
    output.args = (value[0],)
    expected = [p for p in list(inspect.signature(type(module).forward).parameters)[1:]]
    got = [str(n.target) for n in graph.nodes if n.op == "placeholder"]
    if got != expected[: len(got)]:
        raise ExtractionError(
            f"The custom extraction function for {type(module).__name__} (module '{ctx.full(fqn) or '<root>'}')"
            f" has placeholders {got}; they must be named exactly as forward()'s arguments {expected}.")
    for node in graph.nodes:
        update_node_meta(node, name="output" if node.op == "output" else (
            str(node.target) if node.op == "placeholder" else node.name))
    root = {str(n.target): resolve_attr(module, str(n.target)) for n in graph.nodes if n.op in ("get_attr", "call_module")}
    cgm = CompiledGraphModule(root, graph, type(module))
    if ctx.options.postprocessing_function is not None:
        ctx.options.postprocessing_function(cgm, module)
        cgm.recompile()
    return cgm
