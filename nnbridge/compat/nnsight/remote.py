"""Requests for an NDIF server (nnsight 0.8's ``remote=True`` / ``remote="local"``) serialised as
plain nnsight would serialise them.

An NDIF server runs nnsight over its own copy of the model; nnbridge is not installed there. nnsight
0.8.1 pickles the trace (``RequestModel.serialize``: the tracer and the envoys the block names, with
``CustomCloudPickler``), and the envoys carry their class and their child envoys. nnbridge's model
classes (``nnbridge.LanguageModel``...) and its op envoys would make the server's unpickling fail with
``ModuleNotFoundError: No module named 'nnbridge'`` (what ``remote="local"``, nnsight's simulation of
the server, reproduces). While :func:`serialised_as_nnsight` is active in a thread, every envoy is
pickled as an instance of its nnsight base class (``nnsight.LanguageModel``...), without the op
envoys among its children and without nnbridge's own attributes: what the server expects from a
plain nnsight client; a trace context (nnbridge's ``tracer.cache(ops=...)`` tracer) is pickled as its
nnsight base class. Other threads' pickling is untouched.

nnsight 0.8.1's ``remote="local"`` deserialises the request with every module outside its server
list (``typing_extensions`` among them) removed from ``sys.modules``, then puts them back. Where
that deserialisation imports ``typing_extensions`` (it does with the packages of some
environments), the module runs a second time and its new copy replaces functions of ``typing``
(``typing._collect_parameters``) with ones comparing against the copy's own ``NoDefault``; every
later ``Generic[P, T]`` of a ``typing_extensions.ParamSpec`` then raises ``TypeError: Type parameter
~T without a default follows type parameter with a default`` (``torch.compile``'s inductor, on its
first import, among them). :func:`typing_kept` puts ``typing``'s attributes back after a request.

nnsight internals used: ``CustomCloudPickler`` (a ``cloudpickle.CloudPickler``; its
``reducer_override`` is wrapped, process-wide, on first use) and ``Envoy.__getstate__``,
``Envoy._children``, ``Envoy._child_map``, ``Envoy._module`` (nnsight 0.8.1).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import nnsight
import torch
from nnsight.intervention import serialization
from nnsight.tracing.tracer import Tracer

from .. import registry

_ACTIVE = threading.local()
_INSTALLED = threading.Lock()
#: Envoy attributes nnbridge adds (``_nnbridge_*`` and these): not part of nnsight's state.
_NNBRIDGE_STATE = frozenset({"_batcher_class", "eager_module_traces"})


def _nnsight_class(cls: type) -> type:
    """The first class of ``cls``'s MRO that nnsight defines (``cls`` itself for nnsight's)."""
    return next(base for base in cls.__mro__ if base.__module__.split(".")[0] == "nnsight")


def _plain_state(envoy: Any, is_op: Callable[[torch.nn.Module], bool]) -> dict[str, Any]:
    state = dict(envoy.__getstate__())  # nnsight's: tags the module and interleaver as persistent
    state["_children"] = [child for child in state.get("_children", []) if not is_op(child._module)]
    state["_child_map"] = {name: child for name, child in state.get("_child_map", {}).items()
                           if not is_op(child._module)}
    if state.get("_envoys") is not None and _names_nnbridge(state["_envoys"]):
        state["_envoys"] = None  # nnbridge's default (op envoy classes): nnsight's default on the server
    return {key: value for key, value in state.items()
            if not key.startswith("_nnbridge") and key not in _NNBRIDGE_STATE
            and not (isinstance(value, nnsight.Envoy) and is_op(value._module))}  # children as attributes


def _names_nnbridge(value: Any) -> bool:
    items = value.items() if isinstance(value, dict) else [(value, value)]
    return any(getattr(part, "__module__", "").split(".")[0] == "nnbridge" for pair in items for part in pair)


@contextlib.contextmanager
def typing_kept() -> Iterator[None]:
    """Within: anything may replace attributes of the ``typing`` module; after, each attribute
    replaced or added is as it was before (the same objects), and none is left removed."""
    import typing

    before = dict(vars(typing))
    try:
        yield
    finally:
        now = vars(typing)
        for name in [n for n in now if n not in before]:
            delattr(typing, name)
        for name, value in before.items():
            if now.get(name, _MISSING) is not value:
                setattr(typing, name, value)


_MISSING = object()


def _install() -> None:
    with _INSTALLED:
        pickler = serialization.CustomCloudPickler
        if getattr(pickler.reducer_override, "_nnbridge", False):
            return
        original = pickler.reducer_override

        def reducer_override(self: Any, obj: Any) -> Any:
            is_op = getattr(_ACTIVE, "is_op", None)
            if is_op is not None and isinstance(obj, nnsight.Envoy) and not is_op(obj._module):
                return object.__new__, (_nnsight_class(type(obj)),), _plain_state(obj, is_op)
            if is_op is not None and isinstance(obj, Tracer) and _nnsight_class(type(obj)) is not type(obj):
                return object.__new__, (_nnsight_class(type(obj)),), obj.__getstate__()  # nnbridge's tracer
            return original(self, obj)

        reducer_override._nnbridge = True  # type: ignore[attr-defined]
        if registry.enabled("nnsight_request_pickler"):  # installed for the rest of the process
            registry.install("nnsight_request_pickler", pickler, "reducer_override", value=reducer_override)


@contextlib.contextmanager
def serialised_as_nnsight(is_op: Callable[[torch.nn.Module], bool]) -> Iterator[None]:
    """For the body's duration, in this thread, nnsight's request pickler writes every envoy as its
    nnsight base class, leaving out child envoys over modules ``is_op`` accepts (op points) and
    nnbridge's attributes (see the module docstring). Nests."""
    _install()
    previous = getattr(_ACTIVE, "is_op", None)
    _ACTIVE.is_op = is_op
    try:
        yield
    finally:
        _ACTIVE.is_op = previous
