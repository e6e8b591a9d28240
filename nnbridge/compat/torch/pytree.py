"""torch's pytree utilities (private modules ``torch.utils._pytree`` and ``torch.fx._pytree``,
torch 2.0 - 2.13): flattening call arguments and outputs the way torch.export does, so specs
compare equal to the ones export records.

Usage: ``from nnbridge.compat.torch.pytree import pytree, fx_pytree``; :func:`node_class` for the
container class of a spec's node; :func:`registered_class` for the class of a value's top node
without flattening it.
"""

from __future__ import annotations

from typing import Any

from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

__all__ = ["fx_pytree", "node_class", "pytree", "registered_class"]


def node_class(spec: Any) -> type | None:
    """The container class of a (non-leaf) ``pytree.TreeSpec`` node: its ``type``, except for a
    namedtuple, whose node type is pytree's ``namedtuple`` function and whose class is the node's
    context (torch 2.13). None when neither is a class."""
    kind, context = spec.type, spec.context
    if isinstance(kind, type):
        return kind
    return context if isinstance(context, type) else None


def registered_class(value: Any) -> type | None:
    """The class ``pytree.tree_flatten(value)`` makes the top node of ``value``'s spec (its
    ``type``) without flattening anything: ``type(value)`` when that exact class is registered
    with pytree (``pytree.SUPPORTED_NODES``, as ``tree_flatten`` looks it up) and is not a
    namedtuple (whose node type is pytree's ``namedtuple`` function); None otherwise (a leaf, a
    namedtuple)."""
    kind = type(value)
    if kind not in pytree.SUPPORTED_NODES or pytree.is_namedtuple_class(kind):
        return None
    return kind
