"""Installs nnsight's "does the running trace want this?" tests into the graph runtime.

The graph layer asks class-wide hooks while a trace runs: :attr:`OpPoint.wanted` (route this
node's value through its op point?), :attr:`Bridge.wanted_inside` (run this bridged module's
asking code?), :attr:`Bridge.source_body` (run nnsight's ``.source`` body for this call?),
:attr:`Bridge.front_end_body` and :attr:`Bridge.count_unrouted` (nnsight's visit counts), and
:attr:`Bridge.front_end_active` (is a trace running that reaches this module?). All say
no until a front-end installs its test; the package root installs nnsight 0.8's
(:mod:`nnbridge.compat.nnsight.interleaving`, :mod:`nnbridge.compat.nnsight.source`).
:attr:`OpPoint.editing_trace` names the op's envoy in an edit's error (:func:`~.op_point.through`). The dependency runs one way: the envoy layer
knows the graph runtime, never the reverse. It also makes nnsight's plain module envoys of a
bridged model name the closest ops when an attribute is missing (``'Envoy' object (nor its
module) has attribute 'sofmax'. ...; closest ops: ['softmax', ...]``, see
:func:`.envoy.missing_message`). Example::

    install()                  # done once by nnbridge/__init__
    OpPoint.wanted is trace_wants
"""

from __future__ import annotations

from ..inplace.bridging import Bridge
from ..graph.op_point import OpPoint
from ..compat.nnsight.interleaving import install_missing_attribute_hint, trace_wants, wanted_inside
from .envoy import bridged_hint
from ..compat.nnsight.source import count_visits, nnsight_body, source_body, trace_path, trace_running


def install() -> None:
    """Make the graph runtime ask nnsight whether a running trace wants an op or a module's
    inside. Idempotent."""
    OpPoint.wanted = staticmethod(trace_wants)
    OpPoint.editing_trace = staticmethod(trace_path)
    Bridge.wanted_inside = staticmethod(wanted_inside)
    Bridge.source_body = staticmethod(source_body)
    Bridge.front_end_body = staticmethod(nnsight_body)
    Bridge.count_unrouted = staticmethod(count_visits)
    Bridge.front_end_active = staticmethod(trace_running)
    install_missing_attribute_hint(bridged_hint)
