"""A sibling layer's graph made to read and write its own cache layer (layer reuse with a cache).

Its one job: :func:`rebind_cache_state`. A sibling called with a transformers ``Cache`` gets a
copy of its representative's graph (see :mod:`.reuse_plan`, :mod:`.sibling_graphs`), whose
:func:`~.state.read_state` / :func:`~.state.write_state` nodes address the representative's cache
layer; they are moved to the sibling's layer, and the cache spec checked before each call becomes
the sibling's (:class:`~.reuse_plan.CacheRebinding`). Anything else the graph does with the cache
makes extraction start again without reuse (:class:`~.reuse_plan.ReuseFallback`). Example::

    rebind_cache_state(gm, plan.caches["layers.1"], "layers.1")
"""

from __future__ import annotations

import operator
from typing import Any, cast

import torch
from torch.fx import Node

from ..graph.state import read_state, write_state
from ..compat.torch.pytree import pytree
from .reuse_plan import CacheRebinding, ReuseFallback


def _mentions(spec: Any, kind: type) -> bool:
    return isinstance(spec, pytree.TreeSpec) and (spec.type is kind or any(_mentions(c, kind) for c in spec.children()))


def _sizes_only(read: Node) -> dict[int, list[Node]]:
    """Positions of a :func:`~.state.read_state` node's values that are unused or only give
    symbolic sizes (``sym_size``), each with its ``getitem`` nodes (none when unused)."""
    getitems: dict[int, list[Node]] = {}
    only: dict[int, bool] = {}
    for user in read.users:
        if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)):
            return {}
        k = user.args[1]
        getitems.setdefault(k, []).append(user)
        only[k] = only.get(k, True) and all(
            u.op == "call_function" and str(getattr(u.target, "__name__", u.target)).startswith("sym_size")
            for u in user.users)
    return {k: getitems.get(k, []) for k in range(len(cast(tuple, read.args[2]))) if only.get(k, True)}


def _same_sizes(read: Node, getitems: list[Node], own: int) -> bool:
    """Whether every size read from ``getitems`` (values of another cache layer) equals, in the
    representative's export, the size of the value at position ``own`` (its own layer's, read at
    the same time), so the sibling may take it from its own layer. Sizes of other layers are equal
    to the own layer's only when the call began (the export's guards); layers updated before this
    one ran have grown since, so the other layer's size would be wrong for a later sibling."""
    mine = [u for u in read.users if u.args[1] == own]
    own_val = mine[0].meta.get("val") if mine else None
    if not isinstance(own_val, torch.Tensor):
        return False
    for getitem in getitems:
        for user in getitem.users:
            dim = user.args[1] if len(user.args) > 1 else None
            val = getitem.meta.get("val")
            if not isinstance(dim, int) or not isinstance(val, torch.Tensor) or val.dim() != own_val.dim() \
                    or str(val.shape[dim]) != str(own_val.shape[dim]):
                return False
    return True


def rebind_cache_state(gm: torch.fx.GraphModule, rebinding: CacheRebinding, name: str) -> None:
    """Make a sibling's graph module (built from its representative's graph) read and write its own
    cache layer: the state paths of its :func:`~.state.read_state` / :func:`~.state.write_state`
    nodes move from layer ``rep_index`` to ``index``, and their cache spec (checked before each
    call) becomes the sibling's. Recompiles ``gm``.

    Raises:
        ReuseFallback: the graph touches the cache otherwise (a whole-cache flatten or assignment,
            another layer, a spec other than the representative's at its call): only a full
            extraction would be exact.
    """
    kind = rebinding.rep_spec.type
    changed = False
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, str(node.target), None)
            if not _mentions(value, kind):
                continue
            if value != rebinding.rep_spec or any(
                    user.target not in (read_state, write_state) or user.args[1] is not node for user in node.users):
                raise ReuseFallback(f"'{name}' uses its cache other than by reading and writing its own layer")
            setattr(gm, str(node.target), rebinding.spec)
            changed = True
        elif node.op == "call_function" and node.target in (read_state, write_state):
            positions = (2,) if node.target is read_state else (3,)
            sizes_only = _sizes_only(node) if node.target is read_state else {}
            new_args = list(node.args)
            for i in positions:
                moved = []
                paths = list(node.args[i])
                for k, path in enumerate(paths):
                    if path and path[0] == "layers":
                        if len(path) >= 2 and path[1] == (rebinding.rep_index,):
                            path = ("layers", (rebinding.index,), *path[2:])
                        elif k in sizes_only and not any(getitem.users for getitem in sizes_only[k]):
                            pass  # read but unused: the graph does not depend on it
                        else:
                            # a size taken from another layer: the sibling takes it from its own
                            own = ("layers", (rebinding.rep_index,), *path[2:])
                            if k not in sizes_only or own not in paths \
                                    or not _same_sizes(node, sizes_only[k], paths.index(own)):
                                raise ReuseFallback(f"'{name}' reads or writes a cache layer other than its own:"
                                                    f" {path}")
                            path = ("layers", (rebinding.index,), *path[2:])
                    moved.append(path)
                new_args[i] = tuple(moved)
            if node.target is write_state and node.args[2]:
                raise ReuseFallback(f"'{name}' deletes parts of its cache")
            node.args = tuple(new_args)
            changed = True
        elif node.op == "call_function" and any(_mentions(a, kind) for a in node.args):
            raise ReuseFallback(f"'{name}' uses its cache other than by reading and writing its own layer")
    if changed:
        gm.recompile()
