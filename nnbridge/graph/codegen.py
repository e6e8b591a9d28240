"""Code generation for compiled graph modules: the Python ``forward`` generated from a graph.

- :func:`routed_forward`: the code of a graph in which chosen nodes pass their values through
  their op points (the plain code is fx's own, :meth:`~.graph_module.CompiledGraphModule.recompile`);
- :func:`fast_forward`: a generated ``forward`` calling aten operators directly;
- :func:`code_generation_deferred`: graph modules built or recompiled within generate their code
  once, when first needed, instead of at every ``recompile``.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torch.fx import Graph, Node

from ..compat.torch.export import forward_from_source
from ..compat.torch.fast_ops import bindings_fit, with_fast_ops
from .failures import register
from .metadata import node_name, update_node_meta
from .op_point import route, through

if TYPE_CHECKING:  # annotations only: graph_module imports this module
    from .graph_module import CompiledGraphModule

#: the graph modules whose code generation waits, inside :func:`code_generation_deferred`
#: (``{id: module}``); None outside it
_deferred: dict[int, CompiledGraphModule] | None = None


def deferring() -> bool:
    """Whether code generation waits (inside :func:`code_generation_deferred`)."""
    return _deferred is not None


def defer(module: CompiledGraphModule) -> None:
    """Let ``module`` generate its code later (see :func:`code_generation_deferred`); its ``forward``
    becomes :func:`generate_then_forward`."""
    assert _deferred is not None
    _deferred[id(module)] = module
    type(module).forward = generate_then_forward


def undefer(module: CompiledGraphModule) -> None:
    """Stop ``module`` waiting for its code generation (it generates its code now)."""
    if _deferred is not None:
        _deferred.pop(id(module), None)


def waiting(module: CompiledGraphModule) -> bool:
    """Whether ``module``'s code generation waits."""
    return _deferred is not None and id(module) in _deferred


def generate_then_forward(self: CompiledGraphModule, *args: Any, **kwargs: Any) -> Any:
    """A deferred graph module's ``forward``: generate its code (which replaces this forward), then run it."""
    self._generate_code()
    return type(self).forward(self, *args, **kwargs)


@contextlib.contextmanager
def code_generation_deferred() -> Iterator[None]:
    """Within: a :class:`~.graph_module.CompiledGraphModule` built or recompiled generates its Python
    code when first needed (its first call, reading ``code``) or when the body ends, once, instead
    of at each ``recompile``. An in-place bridge rewrites every new graph right after extraction
    (call sites, live tensor reads) and recompiles it, so each graph's code would be generated
    twice, and fx's code generation is a sizeable share of ``bridge()`` (hundreds of graphs). On
    exit every graph still waiting generates its code, also when the body raised (then quietly: the
    body's error is the one raised). Re-entrant (an inner one leaves it to the outer one); used
    under nnbridge's call lock (:meth:`~.dispatcher.GraphDispatcher.add_extraction`), so the state
    is process-wide.
    """
    global _deferred
    if _deferred is not None:
        yield
        return
    _deferred = {}
    try:
        yield
    except BaseException:
        _generate_waiting(quiet=True)
        raise
    _generate_waiting(quiet=False)


def _generate_waiting(quiet: bool) -> None:
    global _deferred
    waiting = list((_deferred or {}).values())
    _deferred = None
    for module in waiting:
        try:
            module._generate_code()
        except Exception:  # noqa: BLE001 - only while another error propagates
            if not quiet:
                raise


def fast_forward(forward: Callable[..., Any], graph: Graph) -> Callable[..., Any]:
    """``forward`` (generated from ``graph``) calling aten operators without
    ``OpOverload.__call__``, and the most common ones through their Python bindings when every call
    of the graph fits them (see :func:`~nnbridge.compat.torch.fast_ops.with_fast_ops`); ``forward``
    itself when it is not a generated function."""
    if not isinstance(forward, types.FunctionType) or forward is generate_then_forward:
        return forward
    return with_fast_ops(forward, bindings_fit((node.target, node.args, node.kwargs)
                                               for node in graph.nodes if node.op == "call_function"))


def routed_forward(module: CompiledGraphModule, routed: frozenset[str], *, asking: bool = False
                   ) -> Callable[..., Any]:
    """The ``forward`` generated from a copy of ``module``'s graph in which the value of each node
    named in ``routed`` (``output``: the returned value) passes through its op point
    ``self._nnbridge_ops.<name>``: handed to :func:`~.op_point.through` (which calls it and checks
    the value it hands on), or, ``asking``, to :func:`~.op_point.route`, which does so only when
    something listens. A placeholder's value is routed after the last
    placeholder. The code is registered for failure notes (see :mod:`.failures`)."""
    graph = Graph()
    val_map: dict[Node, Node] = {}
    output_value = graph.graph_copy(module.graph, val_map)
    output_node = graph.output(output_value)
    copies = {node_name(node): val_map[node] for node in module.graph.nodes if node.op != "output"}
    last_placeholder = None
    for node in graph.nodes:
        if node.op == "placeholder":
            last_placeholder = node
    for name in sorted(routed):
        target = f"_nnbridge_ops.{name}"
        if name == "output":
            with graph.inserting_before(output_node):
                routed_value = _through_point(graph, target, output_node.args[0], asking=asking)
            update_node_meta(routed_value, name=name, routed=True)
            output_node.args = (routed_value,)
            continue
        node = copies[name]
        anchor = last_placeholder if node.op == "placeholder" else node
        with graph.inserting_after(anchor):
            routed_node = _through_point(graph, target, node, asking=asking)
        # a failure in a patch or hook names the op and its source line (see .failures)
        update_node_meta(routed_node, name=name, routed=True)
        routed_node.meta["stack_trace"] = node.meta.get("stack_trace")
        node.replace_all_uses_with(routed_node, delete_user_cb=lambda user: user is not routed_node)
    code = graph.python_code(root_module="self")
    forward = forward_from_source(code.src, code.globals)
    register(module, forward, graph, code=code)
    return forward


def _through_point(graph: Graph, target: str, value: Any, *, asking: bool) -> Node:
    """A node passing ``value`` through the op point at ``target`` (see :func:`routed_forward`)."""
    point = graph.get_attr(target)
    with graph.inserting_after(point):  # fx inserts each new node right after the anchor
        return graph.call_function(route if asking else through, (point, value))
