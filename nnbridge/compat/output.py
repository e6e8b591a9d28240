"""Output a forward writes, seen from the interpreter's profiling events (Python 3.10 - 3.14).

A graph replays tensor operations; what the code around them printed, warned or logged while it
was traced is not repeated. :class:`OutputWatch` tells, event by event (``sys.setprofile``'s
``frame, event, arg``), whether the code wrote output:

- ``print(...)``, or ``write``/``writelines`` of a stream (``sys.stdout.write``, a file): a
  ``c_call`` event of the built-in;
- a warning shown by ``warnings.warn``/``warn_explicit`` called from Python code: the ``call``
  event of ``warnings._showwarnmsg``, which the interpreter calls only for a warning the filters
  let through (a ``"default"`` warning seen before at the same line is not shown again), while
  such a call is in progress (a warning of torch's C++ kernels is shown again by a graph's replay,
  which runs the same kernel);
- a log record handed to handlers: the ``call`` event of ``logging.Logger.callHandlers``, which
  ``Logger`` calls only for a record whose level is enabled (``logger.debug`` under ``INFO`` writes
  nothing); not one sent through a once-only helper, a function named ``*_once`` (transformers'
  ``logger.warning_once``, memoised: eager does not log it again either, so a graph stays faithful).

Output written by ``skipped`` code (nnbridge's own, whose warnings are its reports) is not counted:
for a warning or a log record, the first caller outside ``warnings`` and ``logging`` decides.

:func:`quiet_stdout` drops what extraction's own runs of a forward print (eager makes no such
calls); a module that prints runs eagerly, and prints on each of the user's calls.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading
import types
import warnings
from collections.abc import Iterator
from typing import Any

_SHOW = getattr(warnings, "_showwarnmsg").__code__  # (stdlib private: the one function every shown warning passes)
_HANDLERS = logging.Logger.callHandlers.__code__
_WARN, _WARN_EXPLICIT = warnings.warn, warnings.warn_explicit
_STREAM_WRITES = frozenset({"write", "writelines"})
_LIBRARIES = (warnings.__file__, logging.__file__)


class OutputWatch:
    """Feed it every profiling event (:meth:`wrote`); it answers True for the event that writes output.

    Args:
        skipped: filename prefixes of code whose output is not counted.
    """

    __slots__ = ("skipped", "warning")

    def __init__(self, skipped: tuple[str, ...]):
        self.skipped = skipped
        self.warning = 0  # how many Python-level warn calls are in progress

    def wrote(self, frame: types.FrameType, event: str, arg: Any) -> bool:
        if event == "c_call":
            if arg is print or (getattr(arg, "__name__", None) in _STREAM_WRITES
                                and isinstance(getattr(arg, "__self__", None), io.IOBase)):
                # (a warning or a log record written by warnings' or logging's code counts by its own rule)
                return not frame.f_code.co_filename.startswith((*self.skipped, *_LIBRARIES))
            if arg is _WARN or arg is _WARN_EXPLICIT:
                self.warning += 1
        elif event in ("c_return", "c_exception"):
            if (arg is _WARN or arg is _WARN_EXPLICIT) and self.warning:
                self.warning -= 1
        elif event == "call":
            code = frame.f_code
            if code is _QUIET_WRITES:  # (sys.stdout while extraction runs, see quiet_stdout)
                caller = frame.f_back
                return caller is not None and not caller.f_code.co_filename.startswith((*self.skipped, *_LIBRARIES))
            if (code is _SHOW and self.warning) or code is _HANDLERS:
                return self._counted(frame.f_back, once=code is _HANDLERS)
        return False

    def _counted(self, frame: types.FrameType | None, *, once: bool) -> bool:
        """Whether the first frame from ``frame`` outwards outside ``warnings`` and ``logging`` is
        code whose output counts (with ``once``: not a once-only helper, see the module docstring)."""
        while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
            frame = frame.f_back
        return frame is not None and not frame.f_code.co_filename.startswith(self.skipped) \
            and not (once and frame.f_code.co_name.endswith("_once"))


class _Quiet:
    """``stream`` for every thread but ``thread``, whose writes go nowhere."""

    def __init__(self, stream: Any, thread: int):
        self._stream, self._thread = stream, thread

    def write(self, text: str) -> int:
        return len(text) if threading.get_ident() == self._thread else self._stream.write(text)

    def writelines(self, lines: Any) -> None:
        if threading.get_ident() != self._thread:
            self._stream.writelines(lines)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Drop what this thread writes to ``sys.stdout`` in the body (``print`` included); other
    threads' writes pass through. ``sys.stdout`` is put back on exit, whatever happens; if code in
    the body set another one, that one is kept."""
    original = sys.stdout
    quiet = sys.stdout = _Quiet(original, threading.get_ident())
    try:
        yield
    finally:
        if sys.stdout is quiet:
            sys.stdout = original


_QUIET_WRITES = _Quiet.write.__code__
