"""What :func:`~.passes.apply_passes` accepts as a pass, and how each kind is run on one graph.

A *pass* edits one ``torch.fx.GraphModule``. Four kinds, as torch's ATen-IR guide writes them:

- a function ``fn(graph_module)`` that edits ``graph_module.graph`` in place; it may return None,
  a ``GraphModule`` (the edited one, or a new one) or a ``PassResult``;
- an ``fx.Transformer`` subclass (the class: one instance is made per graph,
  ``Cls(graph_module).transform()``);
- a ``torch.fx.passes.infra.pass_base.PassBase`` instance (``p(graph_module)``);
- a ``torch.fx.passes.infra.pass_manager.PassManager`` (``pm(graph_module)``, its own checks
  included).

:func:`pass_runner` turns any of them into a :class:`PassRunner`; running it gives a
:class:`PassOutcome`: the module holding the edited graph and, for a ``Transformer``, which new
node stands for which old one (so the new node keeps the old one's name and metadata). Example::

    outcome = pass_runner(ReplaceAddWithMul).run(graph_module)
    outcome.graph_module.graph      # the rebuilt graph
    outcome.origins                 # {new mul node: old add node, ...}
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.fx import GraphModule, Node, Proxy, Transformer
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.fx.passes.infra.pass_manager import PassManager

from ..errors import PassCheckError

#: what a caller may pass as a pass (see the module docstring)
Pass = Callable[[GraphModule], Any] | type[Transformer] | PassBase | PassManager


@dataclass
class PassOutcome:
    """A pass's result on one graph.

    Attributes:
        graph_module: the module holding the edited graph (the one given, or the one returned).
        origins: ``{node of the edited graph: node of the graph before}`` for nodes a pass rebuilt
            (``fx.Transformer``); nodes edited in place are themselves and are not listed.
    """

    graph_module: GraphModule
    origins: dict[Node, Node] = field(default_factory=dict)


@dataclass(frozen=True)
class PassRunner:
    """One pass, ready to run on any number of graphs.

    Attributes:
        name: the pass's name in errors (``replace_add_with_mul``, ``ReplaceAddWithMul``,
            ``PassManager(a, b)``).
        run: ``run(graph_module) -> PassOutcome``.
    """

    name: str
    run: Callable[[GraphModule], PassOutcome]


def _name(item: Any) -> str:
    return getattr(item, "__name__", None) or type(item).__name__


def _returned(graph_module: GraphModule, result: Any) -> PassOutcome:
    """The outcome of a pass that returned ``result`` (None, a GraphModule or a PassResult; other
    values, such as ``replace_pattern``'s list of matches, mean an edit in place)."""
    if isinstance(result, PassResult) or (hasattr(result, "graph_module") and hasattr(result, "modified")):
        result = result.graph_module
    return PassOutcome(result if isinstance(result, GraphModule) else graph_module)


def _run_function(function: Callable[[GraphModule], Any]) -> Callable[[GraphModule], PassOutcome]:
    def run(graph_module: GraphModule) -> PassOutcome:
        return _returned(graph_module, function(graph_module))
    return run


def _run_transformer(cls: type[Transformer]) -> Callable[[GraphModule], PassOutcome]:
    def run(graph_module: GraphModule) -> PassOutcome:
        transformer = cls(graph_module)
        origins: dict[Node, Node] = {}
        run_node = transformer.run_node

        def recording(node: Node) -> Any:
            # the node a Transformer returns for ``node`` stands for it (a one-to-X pass returns the
            # last of its nodes; a one-to-none pass returns an earlier node's, already mapped)
            result = run_node(node)
            if isinstance(result, Proxy) and result.node not in origins:
                origins[result.node] = node
            return result
        transformer.run_node = recording  # type: ignore[method-assign, assignment]  # this instance records its nodes
        result = transformer.transform()
        return PassOutcome(result, origins)
    return run


def pass_runner(item: Any) -> PassRunner:
    """The :class:`PassRunner` of ``item`` (one of the kinds in the module docstring).

    Raises:
        PassCheckError: ``item`` is not a pass (check ``argument``): an ``fx.Transformer``
            instance (pass its class), another class (pass an instance), or not callable.
    """
    if isinstance(item, PassManager):
        names = ", ".join(_name(p) for p in item.passes)
        return PassRunner(f"PassManager({names})", _run_function(item))
    if isinstance(item, PassBase):
        return PassRunner(type(item).__name__, _run_function(item))
    if isinstance(item, type):
        if issubclass(item, Transformer):
            return PassRunner(item.__name__, _run_transformer(item))
        raise PassCheckError(
            f"apply_passes: the pass {item.__name__} is a class but not an fx.Transformer subclass; pass an instance"
            f" ({item.__name__}(...)) if it is a PassBase or callable, or a function fn(graph_module).",
            pass_name=item.__name__, check="argument")
    if isinstance(item, Transformer):
        raise PassCheckError(
            f"apply_passes: the pass is an instance of the fx.Transformer {type(item).__name__}, bound to one graph;"
            f" pass the class ({type(item).__name__}) instead: apply_passes makes one per graph.",
            pass_name=type(item).__name__, check="argument")
    if callable(item):
        parameters = _parameters(item)
        if parameters is not None and parameters < 1:
            raise PassCheckError(
                f"apply_passes: the pass {_name(item)} takes no argument; a pass is called with one, the graph"
                " module: def my_pass(graph_module): ...", pass_name=_name(item), check="argument")
        return PassRunner(_name(item), _run_function(item))
    raise PassCheckError(
        f"apply_passes: {item!r} ({type(item).__name__}) is not a pass; pass a function fn(graph_module), an"
        " fx.Transformer subclass, a PassBase instance or a PassManager.", check="argument")


def _parameters(function: Callable[..., Any]) -> int | None:
    """How many positional arguments ``function`` can take (None when unknown or unbounded)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    kinds = [p.kind for p in signature.parameters.values()]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return None
    return sum(kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for kind in kinds)

