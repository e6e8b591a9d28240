"""Installs nnsight's "does the running trace want this?" tests into the graph runtime.

The graph layer asks two class-wide hooks while a trace runs: :attr:`OpPoint.wanted` (route
this node's value through its op point?) and :attr:`Bridge.wanted_inside` (run this bridged
module's asking code?). Both say no until a front-end installs its test; importing the envoy
layer installs nnsight 0.8's (:func:`nnbridge.compat.nnsight.trace_wants`,
:func:`~nnbridge.compat.nnsight.wanted_inside`). The dependency runs one way: the envoy layer
knows the graph runtime, never the reverse. Example::

    install()                  # done on import of nnbridge.envoys
    OpPoint.wanted is trace_wants
"""

from __future__ import annotations

from ..bridge.in_place import Bridge
from ..bridge.op_point import OpPoint
from ..compat.nnsight import trace_wants, wanted_inside


def install() -> None:
    """Make the graph runtime ask nnsight whether a running trace wants an op or a module's
    inside. Idempotent."""
    OpPoint.wanted = staticmethod(trace_wants)  # type: ignore[assignment]
    Bridge.wanted_inside = staticmethod(wanted_inside)  # type: ignore[assignment]
