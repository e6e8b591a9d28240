"""A bridged body and nnsight's ``.source`` on one module: both stay installed, the trace picks.

nnsight 0.8.1 keeps a wrapped module's body in ``State.body`` (``module.__dict__["__nnsight__"]``,
a ``__slots__`` object); its ``Controller`` runs ``state.body(module, *args, **kwargs)``, and
``install_source`` (the first ``envoy.source``) overwrites the slot with the source-instrumented
forward. A bridge writes the same slot, so with one body per slot whichever wrote last would win:
``.source`` touched before the first trace would lose its operations, touched after it would
silence the module's op envoys.

Here the state's class becomes :class:`BridgedState` and its slot holds both bodies: a call runs
the bridged one, and ``install_source`` replaces only nnsight's (plain or instrumented). The
bridged body asks :func:`source_body` at
each call whether the running trace wants one of the module's ``.source`` operations; if so it
runs nnsight's instrumented forward for that call (the module's op points are not reached in
that call: ops and ``.source`` operations of one module are served in different calls).

nnsight also keeps, as a module's body, the class ``forward`` it found when it wrapped the module;
after ``module.__class__ = Sub`` eager runs ``Sub.forward``. :func:`follow_classes` makes such a
module's nnsight body :func:`current_class_forward`, so every call runs what an eager call would.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, SupportsIndex

import torch
from nnsight.intervention.source import State

from .. import registry
from ...errors import NNBridgeError

#: ``module.__dict__`` key of nnsight 0.8.x's per-module ``State`` (``nnsight.intervention.source.STATE``).
NNSIGHT_STATE = "__nnsight__"

_SLOT = State.body  # the slot descriptor of nnsight 0.8.1's State.body


class _Bodies:
    """What a bridged state's ``body`` slot holds: the bridged body (what a call runs) and
    nnsight's own (plain or source-instrumented), which ``install_source`` writes."""

    __slots__ = ("bridged", "nnsight")

    def __init__(self, bridged: Callable[..., Any], nnsight: Callable[..., Any]) -> None:
        self.bridged, self.nnsight = bridged, nnsight

    def __call__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.bridged(module, *args, **kwargs)


class BridgedState(State):
    """nnsight's ``State`` whose ``body`` reads as the bridged body; writes (``install_source``)
    replace nnsight's own body, read back by :func:`nnsight_body`."""

    __slots__ = ()

    @property
    def body(self) -> Callable[..., Any]:
        return _SLOT.__get__(self)

    @body.setter
    def body(self, value: Callable[..., Any]) -> None:
        _SLOT.__get__(self).nnsight = value

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        """Copies and pickles are nnsight's plain ``State`` (a copied module is not bridged)."""
        constructor, arguments, *rest = super().__reduce_ex__(protocol)
        return (constructor, (State, *arguments[1:]), *rest)


def install(module: torch.nn.Module, body: Callable[..., Any]) -> Callable[..., Any] | None:
    """Make the nnsight-wrapped ``module`` run ``body(module, *args, **kwargs)``; returns what
    :func:`uninstall` needs to put back."""
    state = module.__dict__[NNSIGHT_STATE]
    if type(state) is BridgedState:
        bodies = _SLOT.__get__(state)
        previous, bodies.bridged = bodies.bridged, body
        return previous
    _SLOT.__set__(state, _Bodies(body, _SLOT.__get__(state)))
    registry.class_swapped("nnsight_bridged_state", state, BridgedState, applying=True)
    return None


def uninstall(module: torch.nn.Module, previous: Callable[..., Any] | None) -> None:
    """Undo :func:`install` (``previous`` as it returned)."""
    state = module.__dict__.get(NNSIGHT_STATE)
    if type(state) is not BridgedState:
        return
    bodies = _SLOT.__get__(state)
    if previous is not None:
        bodies.bridged = previous
        return
    registry.class_swapped("nnsight_bridged_state", state, State, applying=False)
    _SLOT.__set__(state, bodies.nnsight)


def nnsight_body(module: torch.nn.Module) -> Callable[..., Any] | None:
    """nnsight's own body of ``module`` (unbound: call with the module first), or ``None``."""
    state = module.__dict__.get(NNSIGHT_STATE)
    if state is None:
        return None
    body = _SLOT.__get__(state)
    return body.nnsight if isinstance(body, _Bodies) else body


def sourced(module: torch.nn.Module) -> bool:
    """Whether nnsight's ``.source`` of ``module`` was touched (its instrumented forward exists)."""
    state = module.__dict__.get(NNSIGHT_STATE)
    return state is not None and bool(state.sourced)


def trace_running(module: torch.nn.Module) -> bool:
    """Whether an nnsight trace that reaches ``module`` is interleaving now (its ``State.active``):
    else :func:`source_body`, :func:`wanted_below` and :func:`count_visits` say no or do nothing."""
    state = module.__dict__.get(NNSIGHT_STATE)
    return state is not None and state.active()[0] is not None


def trace_path(module: torch.nn.Module) -> str | None:
    """The path nnsight's trace interleaving now gives ``module`` (``model.transformer.h.0.attn.softmax``,
    from ``State.active``); None when no running trace reaches it."""
    state = module.__dict__.get(NNSIGHT_STATE)
    if state is None:
        return None
    interleaver, path, _ = state.active()
    return path if interleaver is not None else None


def source_body(module: torch.nn.Module) -> Callable[..., Any] | None:
    """nnsight's source-instrumented forward of ``module`` when the running trace waits at or
    caches one of its ``.source`` operations (``<path>.source.`` locations), else ``None``."""
    state = module.__dict__.get(NNSIGHT_STATE)
    if state is None or not state.sourced:
        return None
    return nnsight_body(module) if wanted_below(module, "source.") else None


def wanted_below(module: torch.nn.Module, prefix: str = "") -> bool:
    """Whether the running nnsight trace parks at, or caches, a location of ``module``'s whose path
    continues with ``prefix`` (``Interleaver.parked``/``observers``, matched by path prefix)."""
    state = module.__dict__.get(NNSIGHT_STATE)
    if state is None:
        return False
    interleaver, path, _ = state.active()
    if interleaver is None:
        return False
    start = f"{path}.{prefix}"
    return (any(location.startswith(start) for location in interleaver.parked)
            or any(location.startswith(start) for location in interleaver.observers))


def count_visits(module: torch.nn.Module, points: Iterable[torch.nn.Module]) -> None:
    """Count one visit of each op point in ``points`` (``module``'s graph ran without routing
    them) in every running trace's ``Interleaver.counts``, as nnsight counts a served location
    (``Interleaver.handle``: ``input``, ``skip`` and ``output`` once per call, nnsight 0.8.1).
    Without it a later ``tracer.iter`` step asks an op for an occurrence it never reaches. A no-op
    outside a trace (``module`` has no running interleaver)."""
    state = module.__dict__.get(NNSIGHT_STATE)
    if state is None or state.active()[0] is None:
        return
    for point in points:
        point_state = point.__dict__.get(NNSIGHT_STATE)
        if point_state is not None:
            count_routes(point_state)


def count_routes(state: Any) -> None:
    """One visit of every location of an op point's nnsight ``State`` in each interleaving trace."""
    for ref, _, locations in state.routes:
        interleaver = ref()
        if interleaver is not None and interleaver.interleaving:
            counts = interleaver.counts
            for location in locations:
                counts[location] = counts.get(location, 0) + 1


#: ``{module: the class whose forward nnsight took as its body}``, or None where nnsight took
#: another body (an instance ``forward`` the user set), for the modules :func:`follow_classes` saw
_OWNERS: weakref.WeakKeyDictionary[torch.nn.Module, type | None] = weakref.WeakKeyDictionary()
_UNSEEN = object()


def current_class_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """nnsight's body of a module whose body was its class's ``forward``: the forward of the class
    the module has at this call, as eager's call runs it (``module.__class__ = Sub`` then runs
    ``Sub.forward``)."""
    return type(module).forward(module, *args, **kwargs)


def follow_classes(modules: Iterable[tuple[str, torch.nn.Module]]) -> None:
    """Make each nnsight-wrapped module of ``modules`` (``(path, module)``) run the forward of the
    class it has at each call, as eager's call does: nnsight 0.8.1 keeps as a module's body the
    class ``forward`` it found when it wrapped the module (``State.body``), so after
    ``module.__class__ = Sub`` it would keep running the old class's. A module seen here for the
    first time whose nnsight body is its class's forward gets :func:`current_class_forward` as
    its body (``State.original``, from which ``.source`` instruments, stays); one whose body is an
    instance ``forward`` the user set keeps it, as eager's call does.

    Raises:
        NNBridgeError: a module whose class changed since it was first seen has nnsight's
            ``.source``-instrumented forward, made from the old class's code, which nnsight would
            keep running; names the module's path and both classes. Nothing is changed.
    """
    for path, module in modules:
        owner = _OWNERS.get(module, _UNSEEN)
        if owner is _UNSEEN:
            _OWNERS[module] = _take_body(module)
        elif isinstance(owner, type) and type(module) is not owner:
            _refuse_old_source(path, module, owner)


def _take_body(module: torch.nn.Module) -> type | None:
    """The class whose forward nnsight took as ``module``'s body, which becomes
    :func:`current_class_forward` (unless ``.source`` instrumented it already); None when nnsight
    took another body."""
    state = module.__dict__.get(NNSIGHT_STATE)
    if state is None or state.original is not type(module).forward:
        return None
    if not state.sourced:
        state.body = current_class_forward  # a bridged state's setter writes nnsight's own body
    return type(module)


def _refuse_old_source(path: str, module: torch.nn.Module, owner: type) -> None:
    """:func:`follow_classes`'s error for a module whose class differs from ``owner`` (the class it had
    when first seen) and whose nnsight body is the ``.source``-instrumented forward of that class."""
    state = module.__dict__.get(NNSIGHT_STATE)
    if state is not None and state.sourced and state.original is not type(module).forward:
        raise NNBridgeError(
            f"'{path}': its class changed from {owner.__qualname__} to {type(module).__qualname__} after nnsight's"
            f" .source instrumented {owner.__qualname__}.forward, which nnsight would keep running instead of the"
            f" new class's code. Change the class before the module's .source is first read, or build the model"
            f" again with the new class.")
