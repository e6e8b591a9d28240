"""The private slots of nnsight 0.8's model classes (``nnsight.NNsight`` and its subclasses) that
nnbridge's front-end reads or overrides: the wrapped module, the batcher class, the remote backend.

:class:`ModelSlots` is mixed in before nnsight's class (``class NNsight(ModelSlots, nnsight.NNsight)``)
and gives each slot an ``_nnbridge_`` name, so that no nnsight attribute is named outside this
folder and no user module attribute is shadowed (nnsight forwards unknown attributes to the module).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def wrapped_module(envoy: Any) -> Any:
    """What an nnsight envoy or model wrapper stands for, as nnsight holds it (``_module``; a
    module, or for a lazily loaded model its meta-device stand-in), or None."""
    return getattr(envoy, "__dict__", {}).get("_module")


class ModelSlots:
    """nnsight 0.8.x model-class slots under nnbridge's names."""

    _module: Any
    _batcher_class: type

    def _nnbridge_use_batcher(self, wrap: Callable[[type], type]) -> None:
        """Give this instance the batcher class ``wrap(class's batcher)`` (nnsight's
        ``_batcher_class``, shadowed per instance)."""
        self.__dict__["_batcher_class"] = wrap(type(self)._batcher_class)

    def _nnbridge_batcher(self, kwargs: dict[str, Any]) -> Any:
        """A new batcher for one trace's invokes, as nnsight's ``interleave`` makes one."""
        return self._batcher_class(self, kwargs)

    def _remote_backend(self, remote: bool | str, blocking: bool, job_id: str | None, verbose: bool) -> Any:
        return self._nnbridge_remote(super()._remote_backend(remote, blocking, job_id, verbose))  # type: ignore[misc]

    def _nnbridge_remote(self, backend: Any) -> Any:
        """The backend for ``remote=`` (nnsight's ``_remote_backend``), as the subclass wraps it."""
        return backend
