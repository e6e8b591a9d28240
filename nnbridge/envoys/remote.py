"""Traces run on an NDIF server (``remote=True``, or nnsight's simulation ``remote="local"``).

An NDIF server runs nnsight, not nnbridge, over its own copy of the model: there, a model's envoys
are nnsight's and no op envoy exists. :class:`NNsightRequest` wraps nnsight's remote backend so that
a bridged model's trace travels exactly as a plain nnsight model's would (its envoys serialised as
nnsight's classes, see :mod:`nnbridge.compat.nnsight.remote`), and refuses, before anything is sent, a
trace whose code may read an op envoy (:mod:`.op_reads`), which the server could not serve. Module
inputs, outputs and skips, ``.source``, ``session``, ``iter`` and edits work as with nnsight.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..graph.op_point import OpPoint, OpPointContainer
from ..compat.nnsight.remote import serialised_as_nnsight, typing_kept
from ..errors import NNBridgeError
from .op_reads import possible_ops


def is_op_point(module: torch.nn.Module) -> bool:
    """Whether ``module`` is one of nnbridge's op points (or their per-invocation containers)."""
    return isinstance(module, (OpPoint, OpPointContainer))


class NNsightRequest:
    """An nnsight remote backend (``RemoteBackend`` or ``LocalSimulationBackend``) for a bridged
    model: called with the tracer as nnsight calls its backends.

    Args:
        backend: nnsight's backend for the request.
        model: the bridged model (``torch.nn.Module``) the trace wraps.
        known_ops: the model's registered op envoy names (exact op names for the check).
        module_names: the names of the model's real submodules (never ops).

    Raises (when called):
        NNBridgeError: the trace's code may read an op envoy; names the reads and the fix.
    """

    def __init__(self, backend: Any, model: torch.nn.Module, known_ops: Iterable[str], *, module_names: Iterable[str]):
        self.backend = backend
        self.model = model
        self.known_ops = frozenset(known_ops)
        self.module_names = frozenset(module_names)

    def __call__(self, tracer: Any) -> Any:
        frame = tracer.info.frame
        scopes = (frame.f_locals, frame.f_globals)

        def resolve(name: str) -> object:
            return next((scope[name] for scope in scopes if name in scope), None)
        ops = [name for name in possible_ops([tracer.info.code], resolve, self.model, known_ops=self.known_ops)
               if name not in self.module_names]
        if ops:
            raise NNBridgeError(
                f"this remote trace may read op envoys {ops[:5]} of {type(self.model).__name__}: an NDIF server runs"
                " nnsight, not nnbridge, so only module envoys (inputs, outputs, skips, .source) exist there."
                " Run the trace locally (remote=False) to read ops, or read module values only remotely.")
        with serialised_as_nnsight(is_op_point), typing_kept():  # (see typing_kept: nnsight's "local")
            return self.backend(tracer)
