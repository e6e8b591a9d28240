"""The trace context of nnbridge's model classes: nnsight's, with ``tracer.cache(ops=...)``.

``tracer.cache()`` with no arguments records what nnsight's records: the output of every module
(the same keys, in the same order, with the same values), no op. Op envoys are cached when asked:
``tracer.cache(ops=True)`` adds every op of the model (of the modules named in ``modules=``, when
given), and an op envoy or op path named in ``modules=`` is cached like a module.

Example::

    with model.trace(x) as tracer:
        modules = tracer.cache()                      # nnsight's: every module's output
    with model.trace(x) as tracer:
        everything = tracer.cache(ops=True)           # and every op's
    with model.trace(x) as tracer:
        some = tracer.cache(modules=[model.transformer.h[0].attn.softmax])
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from ..compat.nnsight.models import wrapped_module
from ..compat.nnsight.interleaving import InterleavingTracer

from ..graph.op_point import OpPoint, OpPointContainer


def _is_op(envoy: Any) -> bool:
    return isinstance(wrapped_module(envoy), (OpPoint, OpPointContainer))


class OpCacheTracer:
    """Mixin over an nnsight ``InterleavingTracer`` (see the module docstring)."""

    def cache(self, modules: list[Any] | None = None, device: Any = torch.device("cpu"), dtype: Any = None,
              detach: bool = True, include_output: bool = True, include_inputs: bool = False,
              non_blocking: bool = False, *, ops: bool = False) -> Any:
        """nnsight's ``tracer.cache`` (same arguments and result), recording module envoys only
        unless ``ops`` is true or ``modules`` names op envoys.

        Args:
            ops: also record op envoys: every op of the model when ``modules`` is None, else every
                op below each module ``modules`` names.
        """
        envoy = self.envoy  # type: ignore[attr-defined]  # InterleavingTracer's
        if modules is None and not ops:
            modules = [path for path, sub in envoy.modules(names=True) if not _is_op(sub)]
        elif modules is not None and ops:
            modules = _with_ops_below(envoy, modules)
        return super().cache(modules, device=device, dtype=dtype, detach=detach,  # type: ignore[misc]
                             include_output=include_output, include_inputs=include_inputs,
                             non_blocking=non_blocking)


def _with_ops_below(envoy: Any, modules: Iterable[Any]) -> list[Any]:
    """``modules`` (envoys or paths) and the paths of the op envoys below each of them."""
    given = list(modules)
    prefixes = tuple(f"{item if isinstance(item, str) else item.path}." for item in given)
    return given + [path for path, sub in envoy.modules(names=True) if _is_op(sub) and path.startswith(prefixes)]


class BridgeTracer(OpCacheTracer, InterleavingTracer):
    """nnsight's default trace context, with :class:`OpCacheTracer`'s ``cache``."""


@functools.cache
def op_cache_tracer(tracer_class: type | None) -> type:
    """``tracer_class`` (an nnsight ``InterleavingTracer``; None: nnsight's default) with
    :class:`OpCacheTracer`'s ``cache``."""
    if tracer_class is None or tracer_class is InterleavingTracer:
        return BridgeTracer
    if issubclass(tracer_class, OpCacheTracer):
        return tracer_class
    return type(tracer_class.__name__, (OpCacheTracer, tracer_class), {"__module__": __name__})
