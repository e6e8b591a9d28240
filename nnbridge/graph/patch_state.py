"""Which patch contexts are open, per thread and per asyncio task (``contextvars``).

A patch context (``pg.patch({...})``) attaches its listeners to op points, which are shared by
every thread calling the model. Each listener therefore applies its patch only when the context
that opened it is the caller's: a :class:`open-listener set in a ``ContextVar``, set on entering
``patch`` and reset on leaving it. A new thread starts with no open patch contexts (its context is
empty); an asyncio task sees those open where it was created, as ``contextvars`` define.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

_OPEN: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("nnbridge_open_patches", default=frozenset())


def is_open(listener: object) -> bool:
    """Whether ``listener``'s patch context is open in the calling thread / task."""
    return id(listener) in _OPEN.get()


@contextlib.contextmanager
def opened(listeners: Sequence[object]) -> Iterator[None]:
    """Mark ``listeners`` open in the calling context for the body's duration."""
    token = _OPEN.set(_OPEN.get() | {id(listener) for listener in listeners})
    try:
        yield
    finally:
        try:
            _OPEN.reset(token)
        except ValueError:  # left in another context (a generator resumed elsewhere): remove ours only
            _OPEN.set(_OPEN.get() - {id(listener) for listener in listeners})
