"""What nnbridge stores on fx nodes and on graph modules: one declared record each.

As graphpatch kept its ``NodeMeta``/``GraphMeta``: every node of an extracted graph carries one
:class:`NodeMeta` under ``node.meta["nnbridge"]`` (fx's own keys such as ``val`` and
``stack_trace`` stay where torch puts them) and every graph module one :class:`GraphMeta` as its
``graph_meta`` attribute. Nothing else of nnbridge's lives in ``node.meta`` or a module's
``__dict__``. Example::

    meta = node_meta(node)
    meta.name, meta.example        # "softmax", torch.Size([1, 4, 8, 8])
    graph.graph_meta.node_path     # "transformer.h_0.attn"
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.fx import Node

if TYPE_CHECKING:  # annotations only: these modules import this one
    from .graph_module import GraphModuleBase
    from .failures import _Generated
    from .graph_module import CompiledGraphModule, OpaqueGraphModule
    from .state import Path, SpecCheck

class HeldExtraction(Protocol):
    """One extraction of a module, as the graph layer sees it: its root graph module."""

    @property
    def root(self) -> GraphModuleBase: ...


class ExtractionHolder(Protocol):
    """What an opaque module's child is called through: it keeps one extraction per call
    structure (implemented by :class:`nnbridge.dispatch.dispatcher.GraphDispatcher`)."""

    @property
    def module(self) -> torch.nn.Module: ...

    def all_extractions(self) -> list[Any]:
        """Every extraction held, oldest first (each a :class:`HeldExtraction`)."""
        ...


#: ``node.meta`` key of a node's :class:`NodeMeta`.
NODE_META_KEY = "nnbridge"


@dataclass(frozen=True)
class NodeMeta:
    """nnbridge's record of one fx node. Frozen: fx's graph copies share ``meta`` dicts shallowly,
    so a record is replaced (:func:`update_node_meta`), never changed in place.

    Attributes:
        name: the node's NodePath segment within its graph (``softmax``, ``add_1``, ``h_0``).
        routed: the node passes another node's value through its op point (routing copies).
        module_path: for a ``call_module`` node, the callee's path relative to the caller as the user
            spells it (``h.0``, ``graph``), whatever the graph attribute is called (``h.0``,
            ``graph_``); a bridge links its call sites by it.
        extra_args: for a ``call_module`` node, how many leading arguments it passes its callee's
            graph before the module's own (inputs ``torch.export.unflatten`` added, which the graph
            reads, see :func:`~nnbridge.extract.cleanup.drop_unused_extras`); 0 when the callee
            takes exactly its module's arguments.
        example: the value's summary on the example inputs (``torch.Size`` for a tensor,
            containers of summaries; see :mod:`.summaries`); None when unknown.
    """

    name: str
    routed: bool = False
    module_path: str | None = None
    extra_args: int = 0
    example: Any = None


def node_meta(node: Node) -> NodeMeta:
    """``node``'s record; a node nnbridge has not named yet gets one named as fx named it."""
    meta = node.meta.get(NODE_META_KEY)
    return meta if isinstance(meta, NodeMeta) else NodeMeta(node.name)


def node_name(node: Node) -> str:
    """``node``'s NodePath segment within its graph."""
    return node_meta(node).name


def update_node_meta(node: Node, **changes: Any) -> NodeMeta:
    """Replace ``node``'s record by a copy with ``changes`` (field names of :class:`NodeMeta`).

    Raises:
        TypeError: a name in ``changes`` is not a field of :class:`NodeMeta`.
    """
    meta = dataclasses.replace(node_meta(node), **changes)
    node.meta[NODE_META_KEY] = meta
    return meta


@dataclass
class GraphMeta:
    """nnbridge's record of one graph module (``graph_module.graph_meta``).

    Attributes:
        node_path: the module's NodePath from the extracted root, with the dispatcher's prefix
            (for failure notes, see :mod:`.failures`).
        examples: ``{op point name: summary}`` of an opaque module's inputs, parameters and output
            on the example call (compiled graphs keep theirs in :attr:`NodeMeta.example`).
        exact_signature: the graph accepts exactly the original ``forward``'s arguments (else an
            in-place bridge calls it through the original body).
        child_dispatchers: for an opaque module, ``{child name: dispatcher}`` of the children its
            code calls (each may hold several extractions).
        graph_children: for a bridged graph, ``{call_module node name: graph}`` after the bridge
            rewired its call sites to the user's modules (None until then).
        bridged_module: the user's module whose body a bridge runs through this graph.
        state_specs: a bridge's cached pytree specs of the state arguments it threads (caches).
        argument_names: a bridge's cached placeholder names.
        generated: ``{code object of a generated forward: its line and node map}`` for locating
            failures in generated code (:mod:`.failures`).
        aliases: a compiled graph's ``{variable alias: canonical node name}`` (``attn_weights_2``:
            ``softmax``), computed on first use from the nodes' stack traces (:mod:`.aliases`);
            None until then.
        untouched: the paths of the cache layers of its state argument that its code never touched
            while exported (:func:`~.state.states_returned`), compared by type only before each
            call; None when unknown (every layer is compared).
        reused_from: the NodePath of the representative layer whose graph this one was built
            from (:mod:`~nnbridge.extract.reuse_plan`, ``ExtractionOptions.reuse_layers``); None when
            exported itself.
        examples_due: computes example summaries still owed to this graph (an in-place bridge
            computes them on first read, see :meth:`~.in_place.Bridge.examples_due`); None when
            nothing is owed.
    """

    node_path: str = ""
    examples: dict[str, Any] = field(default_factory=dict)
    exact_signature: bool = True
    child_dispatchers: dict[str, ExtractionHolder] = field(default_factory=dict)
    graph_children: dict[str, CompiledGraphModule | OpaqueGraphModule] | None = None
    bridged_module: torch.nn.Module | None = None
    state_specs: list[tuple[int | str, SpecCheck]] | None = None
    argument_names: list[str] | None = None
    generated: dict[types.CodeType, _Generated] = field(default_factory=dict)
    aliases: dict[str, str] | None = None
    reused_from: str | None = None
    untouched: frozenset[Path] | None = None
    examples_due: Callable[[], None] | None = None
