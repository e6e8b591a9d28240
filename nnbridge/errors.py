"""nnbridge's exception and warning hierarchy."""

from __future__ import annotations


class NNBridgeError(Exception):
    """Base class of every error nnbridge raises on purpose."""


class ExtractionError(NNBridgeError):
    """A module could not be turned into a graph and the options forbid the opaque fallback.

    The original exception is attached as ``__cause__``.
    """


class NodePathError(NNBridgeError, KeyError):
    """One or more NodePaths are unknown or not leaves; raised before the model runs.

    A ``KeyError`` subclass, as graphpatch raised ``KeyError`` for bad paths. ``str()`` gives the
    full message (``KeyError`` would otherwise quote it).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class NNBridgeWarning(UserWarning):
    """Category of every warning nnbridge issues."""
