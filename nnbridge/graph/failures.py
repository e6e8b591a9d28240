"""Say where in a graph a failure happened: the NodePath of the op and the model source line.

A failure inside generated graph code shows fx's generated line (``add_3 = torch.ops.aten.add...``).
Each compiled forward is registered on its graph module with its line map, its nodes' NodePath
names and export's ``stack_trace``; :func:`add_note` adds a note (``BaseException.add_note``; the
exception's type and message are unchanged) naming the innermost graph node in the traceback::

    RuntimeError: The size of tensor a (12) must match the size of tensor b (6) ...
    nnbridge: raised at NodePath 'model.layers_0.self_attn.add' (call_function aten.add.Tensor), from
      File ".../modeling_llama.py", line 195, in eager_attention_forward
        attn_weights = attn_weights + attention_mask
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.fx import Graph, GraphModule
from torch.fx.graph import PythonCode

from ..compat.torch.fx import generated_line_map
from .metadata import GraphMeta, node_meta
from .node_path import from_module_path

if TYPE_CHECKING:  # annotations only: graph_module imports this module
    from .graph_module import GraphModuleBase

_NOTED = "_nnbridge_noted"


class _Generated:
    def __init__(self, graph: Graph, code: PythonCode | GraphModule):
        self.lines, self.prologue = generated_line_map(code)
        self.nodes = [(node_meta(node).name, "route" if node_meta(node).routed else node.op,
                       str(node.target), node.meta.get("stack_trace")) for node in graph.nodes]


def _meta(owner: object) -> GraphMeta | None:
    meta = getattr(owner, "__dict__", {}).get("graph_meta")
    return meta if isinstance(meta, GraphMeta) else None


def register(owner: GraphModuleBase, function: Callable[..., Any], graph: Graph,
             *, code: PythonCode | GraphModule) -> None:
    """Remember on ``owner`` (a graph module; in its :attr:`GraphMeta.generated`, so the map lives
    with its graph) that ``function``, one of its generated forwards, was compiled from ``graph``
    with fx's ``code``/``GraphModule``, so failures in it can be located."""
    owner.graph_meta.generated[function.__code__] = _Generated(graph, code)


def _innermost(error: BaseException) -> tuple[_Generated, int, object] | None:
    """The innermost generated-forward frame of the traceback: its entry, node index and ``self``."""
    found = None
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
        meta = _meta(owner) if owner is not None else None
        entry = meta.generated.get(frame.f_code) if meta is not None else None
        if entry is not None:
            index = entry.lines.get(tb.tb_lineno - entry.prologue)
            if index is not None and index < len(entry.nodes):
                found = (entry, index, owner)
        tb = tb.tb_next
    return found


def describe(error: BaseException) -> str | None:
    """The note for ``error``: the NodePath of the innermost graph node it passed through and the
    model source line export recorded for it; None when no graph code is in the traceback."""
    found = _innermost(error)
    if found is None:
        return None
    entry, index, owner = found
    name, op, target, stack = entry.nodes[index]
    meta = _meta(owner)
    prefix = from_module_path(meta.node_path) if meta is not None else ""
    path = f"{prefix}.{name}" if prefix else name
    what = {"route": "in a patch or hook on this op", "call_module": f"in its submodule {target}"}.get(op, f"{op} {target}")
    note = f"nnbridge: raised at NodePath '{path}' ({what})"
    if stack:
        lines = [line for line in str(stack).rstrip().splitlines() if line.strip()]
        note += ", from\n" + "\n".join(lines[-2:])
    return note


def add_note(error: BaseException) -> None:
    """Add :func:`describe`'s note to ``error`` (once per exception, however many graph entry
    points it leaves). Called from ``except`` blocks, which cost nothing on the normal path."""
    if getattr(error, _NOTED, False):
        return
    note = describe(error)
    if note is not None:
        error.add_note(note)
    try:
        setattr(error, _NOTED, True)
    except AttributeError:
        pass
