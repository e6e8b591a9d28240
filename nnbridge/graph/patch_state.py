"""Which patch contexts are open, per thread and per asyncio task (``contextvars``).

A patch context (``pg.patch({...})``) attaches its listeners to op points, which are shared by
every thread calling the model. Each listener therefore applies its patch only when the context
that opened it is the caller's: a :class:`open-listener set in a ``ContextVar``, set on entering
``patch`` and reset on leaving it. A new thread starts with no open patch contexts (its context is
empty); an asyncio task sees those open where it was created, as ``contextvars`` define.

torch.compile cannot read a ``ContextVar`` while it traces, nor guard on one. A compiled graph asks
:func:`all_open_here` instead: whether every listener open anywhere in the process is open in the
caller's context (then every patch listener on an op point applies here, since listeners sit on op
points only while their context is open). It compares two counts, :attr:`Counts.here` and
:attr:`Counts.total`, which torch.compile reads as attributes and checks again before every call
of the compiled code (its guards), in the caller's context; the counts stay the same when a patch
context is left and another with new patch values opened, so the compiled code is reused.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Sequence

_OPEN: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("nnbridge_open_patches", default=frozenset())
#: ``len(_OPEN.get())``, set with it; no default (see :attr:`Counts.here`)
_HERE: contextvars.ContextVar[int] = contextvars.ContextVar("nnbridge_open_patch_count")
_TOTAL_LOCK = threading.Lock()


class Counts:
    """The numbers of open patch listeners that :func:`all_open_here` compares.

    Attributes:
        here: the number of listeners open in the caller's context, or this object when the
            context never opened one. A property whose getter is ``ContextVar.get`` itself (a C
            function, called with this object as its default): torch.compile reads its value
            instead of tracing it, and its guards read it again, in the caller's context, before
            each call of the compiled code.
        total: the number of listeners open in any context of the process.
    """

    here = property(_HERE.get)

    def __init__(self) -> None:
        self.total = 0


COUNTS = Counts()


def is_open(listener: object) -> bool:
    """Whether ``listener``'s patch context is open in the calling thread / task."""
    return id(listener) in _OPEN.get()


def all_open_here() -> bool:
    """Whether every patch listener open in any thread or task is open in the caller's context
    (also when none is): then every patch listener on an op point applies in this call."""
    here = COUNTS.here
    return (here if isinstance(here, int) else 0) == COUNTS.total


@contextlib.contextmanager
def opened(listeners: Sequence[object]) -> Iterator[None]:
    """Mark ``listeners`` open in the calling context for the body's duration."""
    ids = {id(listener) for listener in listeners}
    with _TOTAL_LOCK:
        COUNTS.total += len(ids)
    try:
        now_open = _OPEN.get() | ids
        token, count_token = _OPEN.set(now_open), _HERE.set(len(now_open))
        try:
            yield
        finally:
            try:
                _HERE.reset(count_token)
                _OPEN.reset(token)
            except ValueError:  # left in another context (a generator resumed elsewhere): remove ours only
                remaining = _OPEN.get() - ids
                _OPEN.set(remaining)
                _HERE.set(len(remaining))
    finally:
        with _TOTAL_LOCK:
            COUNTS.total -= len(ids)
