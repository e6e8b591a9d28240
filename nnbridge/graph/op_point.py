"""Op points: one identity ``nn.Module`` per graph node, the single hook point for every front-end.

A :class:`CompiledGraphModule`'s generated code routes a node's value through the node's op point
only while something listens to it (a patch listener, a torch hook on the op point). While nothing
listens the graph runs its plain generated code: an unpatched forward does no per-node work.

Three words, three things: a point is *listened* when a patch listener or torch hook is on it
(known ahead, so the plain code routes it); a value is *wanted* when :attr:`OpPoint.wanted` says
a running trace waits for it (known only at run time, so the code run under a trace *asks*
:func:`route` per node); a node is *routed* when its value passes through its point. *Guards*
are something else: an extraction's validity checks (:mod:`.dispatcher`).

Example::

    point = pg.op_point("transformer.h_0.attn.softmax")
    handle = point.register_forward_hook(lambda mod, args, out: out * 0)   # routed from now on
    handle.remove()                                                        # and unrouted again
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils.hooks import RemovableHandle

from ..compat.torch.hooks import has_module_hooks, value_hooks
from .edits import check_replacement
from .node_path import from_module_path
from .summaries import describe

if TYPE_CHECKING:
    from .graph_module import GraphModuleBase

Listener = Callable[[Any], Any]


#: every op point that has a patch listener or a torch hook registered through its methods (see
#: :attr:`OpPoint.listened`), weakly held: while it is empty no point of any model is listened, so
#: :meth:`~nnbridge.inplace.bridging.Bridge.listened` answers before every trace without a scan
LISTENED: weakref.WeakSet[OpPoint] = weakref.WeakSet()


class OpPoint(torch.nn.Module):
    """Identity module standing for the value of one graph node.

    Calling it passes the value through its listeners in order (each returns the new value), inside
    ``Module.__call__``, so torch forward/pre-forward hooks registered on it see and may replace the
    value with torch's own hook semantics.

    Attributes:
        node_name: the node's name within its graph (``softmax``, ``add_1``, ``weight``).
        wanted: class-wide ``wanted(point) -> bool``, asked by :func:`route` while a trace runs:
            whether something other than this point's listeners and torch hooks wants the op's
            value. Never, until a front-end installs its test (the envoy layer installs nnsight's:
            a running trace parks at, skips or caches one of the op's locations).
        editing_trace: class-wide ``editing_trace(point) -> path or None``, asked only to word an
            edit's error: the op's path in a running trace that may have edited its value (the
            envoy layer installs nnsight's, ``model.transformer.h.0.attn.softmax``); None when no
            trace runs, or no front-end installed one.
    """

    wanted: ClassVar[Callable[[OpPoint], bool]] = staticmethod(lambda point: False)
    editing_trace: ClassVar[Callable[[OpPoint], str | None]] = staticmethod(lambda point: None)
    _owners: list[weakref.ref[GraphModuleBase]]
    _listeners: list[Listener]
    _hooked: bool

    def __init__(self, owner: GraphModuleBase, node_name: str) -> None:
        super().__init__()
        self.node_name = node_name
        self.__dict__["_owners"] = [weakref.ref(owner)]
        self.__dict__["_listeners"] = []
        self.__dict__["_hooked"] = False  # torch hooks registered through the methods below

    def add_owner(self, owner: GraphModuleBase) -> None:
        """Share this point with another graph (the same node of another call structure)."""
        self._owners.append(weakref.ref(owner))
        owner.refresh_routing()

    def owners(self) -> list[GraphModuleBase]:
        """The graphs that route this node through this point while it is listened."""
        return [owner for owner in (ref() for ref in self._owners) if owner is not None]

    def forward(self, value: Any) -> Any:
        for listener in self._listeners:
            value = listener(value)
        return value

    @property
    def listened(self) -> bool:
        """Whether a listener or a torch hook needs the node's value routed through this point."""
        return bool(self._listeners) or self._hooked

    def add_listener(self, listener: Listener, *, refresh: bool = True) -> None:
        """Append ``listener`` (value -> value) and route the node through this point.

        With ``refresh=False`` the owner's routing is not updated (bulk changes: call
        ``refresh()`` once afterwards).
        """
        self._listeners.append(listener)
        self._note_listened()
        if refresh:
            self.refresh()

    def has_listener(self, listener: Listener) -> bool:
        """Whether ``listener`` (this very object) is attached."""
        return any(existing is listener for existing in self._listeners)

    def remove_listener(self, listener: Listener, *, refresh: bool = True) -> None:
        """Remove one occurrence of ``listener``; stop routing when nothing listens any more."""
        for i, existing in enumerate(self._listeners):
            if existing is listener:
                del self._listeners[i]
                break
        self._note_listened()
        if refresh:
            self.refresh()

    def _note_listened(self) -> None:
        if self.listened:
            LISTENED.add(self)
        else:
            LISTENED.discard(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copied or unpickled point that has listeners or torch hooks is in :data:`LISTENED` too."""
        super().__setstate__(state)
        self._note_listened()

    def refresh(self) -> None:
        """Recompute the owning graphs' routing (torch hooks registered through the methods below
        do this themselves)."""
        for owner in self.owners():
            owner.refresh_routing()

    # torch hook registration re-routes the node, and so does removing the handle -----------------
    def _refreshing(self, handle: RemovableHandle) -> RemovableHandle:
        remove = handle.remove

        def remove_and_refresh() -> None:
            remove()
            self.__dict__["_hooked"] = has_module_hooks(self)
            self._note_listened()
            self.refresh()
        handle.remove = remove_and_refresh  # type: ignore[method-assign]  # this handle's remove also re-routes
        self.__dict__["_hooked"] = True
        self._note_listened()
        self.refresh()
        return handle

    def register_forward_hook(self, hook: Callable[..., Any], **kwargs: Any) -> RemovableHandle:
        """As ``torch.nn.Module.register_forward_hook``; returning a value replaces the op's output."""
        return self._refreshing(super().register_forward_hook(hook, **kwargs))

    def register_forward_pre_hook(self, hook: Callable[..., Any], **kwargs: Any) -> RemovableHandle:
        """As ``torch.nn.Module.register_forward_pre_hook``; the op's value is the single input."""
        return self._refreshing(super().register_forward_pre_hook(hook, **kwargs))

    def register_full_backward_hook(self, hook: Callable[..., Any], *args: Any, **kwargs: Any) -> RemovableHandle:
        """As ``torch.nn.Module.register_full_backward_hook``."""
        return self._refreshing(super().register_full_backward_hook(hook, *args, **kwargs))

    def register_full_backward_pre_hook(self, hook: Callable[..., Any], *args: Any, **kwargs: Any) -> RemovableHandle:
        """As ``torch.nn.Module.register_full_backward_pre_hook``."""
        return self._refreshing(super().register_full_backward_pre_hook(hook, *args, **kwargs))

    def extra_repr(self) -> str:
        for owner in self.owners():
            example = owner.example(self.node_name)
            if example is not None:
                return f"{self.node_name}: {describe(example)}"
        return self.node_name

    def node_path(self) -> str:
        """The node's NodePath (``transformer.h_0.attn.softmax``), from its first live graph."""
        for owner in self.owners():
            prefix = from_module_path(owner.graph_meta.node_path)
            return f"{prefix}.{self.node_name}" if prefix else self.node_name
        return self.node_name

    def editors(self) -> str:
        """Who may have replaced the value on its way through this point (for :func:`through`'s
        error): its torch forward and pre-forward hooks, a running trace (:attr:`editing_trace`),
        else its listeners (a patch checks its own value first, naming itself)."""
        hooks = [getattr(hook, "__qualname__", None) or type(hook).__name__ for hook in value_hooks(self)]
        found = [f"A torch hook on the op point ({', '.join(hooks)})"] if hooks else []
        path = OpPoint.editing_trace(self)
        if path is not None:
            found.append(f"an nnsight edit of {path} (.output = ..., .input = ..., or in place)")
        if not found:
            found.append(f"A listener on the op point ({', '.join(type(f).__name__ for f in self._listeners)})")
        edit = " or ".join(found)
        return edit[0].upper() + edit[1:]


def refresh_owners(points: Iterable[OpPoint]) -> None:
    """Refresh the routing of every distinct owner of ``points`` once (after adding or removing
    listeners with ``refresh=False``)."""
    owners = {id(owner): owner for p in points for owner in p.owners()}
    for owner in owners.values():
        owner.refresh_routing()


def through(point: OpPoint, value: Any) -> Any:
    """``point(value)``, checked: the value its listeners, torch hooks and nnsight hand on in place
    of a tensor must have the tensor's shape (also after an in-place edit), dtype and device.
    Every routed node's value passes here; the check runs only when the value was replaced or
    its shape changed, so a point whose listeners only read pays two comparisons.

    Raises:
        PatchError: the value handed on cannot stand for the node's (see
            :func:`~.edits.check_replacement`), naming the NodePath and who may have made the edit.
    """
    if not isinstance(value, torch.Tensor):
        return point(value)
    shape = value.shape
    result = point(value)
    if result is not value or value.shape != shape:
        check_replacement(value, result, node_path=point.node_path, edit=point.editors, shape=shape)
    return result


def route(point: OpPoint, value: Any) -> Any:
    """:func:`through` ``(point, value)`` when a patch or torch hook listens to ``point`` or
    :attr:`OpPoint.wanted` says a running trace wants it; else ``value`` unchanged. The generated
    code of a graph running under a trace calls this once per node, so it is kept to two attribute
    reads and one call."""
    d = point.__dict__
    if d["_listeners"] or d["_hooked"] or OpPoint.wanted(point):
        return through(point, value)
    return value


class OpPointContainer(torch.nn.Module):
    """Holds the op points of a later invocation (``invocation_1``...) of a bridged module."""
