"""Stack traces that reach into the helper functions a ``forward`` calls.

torch 2.13's non-strict ``torch.export`` records, as each node's ``stack_trace``, only the frames
named ``forward`` (``TracerBase._record_forward_stack_traces_only``, set by ``_ModuleStackTracer``
and ``make_fx``): an op computed inside a plain function a forward calls (transformers'
``eager_attention_forward``, ``create_causal_mask``) is reported at the call site, not at its own
line. :func:`helper_frames_recorded` keeps those deeper frames too, appended after the innermost
``forward`` frame, so the node's last frame is the line that computed it (what
:mod:`nnbridge.graph.aliases` names variables from, and what ``pg.graph.<node>._code`` shows).
Library frames (torch's own Python code such as ``torch/nn/functional.py``, the standard library,
nnbridge) are left out. The frames up to the innermost ``forward`` are exactly torch's.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sysconfig
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._traceback as torch_traceback
from torch.fx.proxy import TracerBase

from .. import registry

_LOCK = threading.Lock()
_DEPTH = 0
_ORIGINAL_EXTRACT: list[Any] = []  # what registry.uninstall puts back while _lazy_lines is installed
_ORIGINAL_FILTER: list[Any] = []  # likewise for the frame filter
def _directory(path: str) -> str:
    return os.path.join(os.path.realpath(path), "")


#: torch's directory and nnbridge's (this file is nnbridge/compat/torch/stack_traces.py)
_LIBRARY_DIRS = (_directory(os.path.dirname(torch.__file__)),
                 _directory(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
_STDLIB = _directory(sysconfig.get_paths()["stdlib"])
_INSTALLED = tuple({_directory(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")})


@functools.lru_cache(maxsize=4096)
def _library_frame(filename: str) -> bool:
    """torch's, nnbridge's or the standard library's own code (site-packages lies inside the
    standard library's directory on most installs: installed packages are not library frames)."""
    if filename.startswith("<"):
        return True
    path = os.path.realpath(filename)
    if path.startswith(_LIBRARY_DIRS):
        return True
    return path.startswith(_STDLIB) and not path.startswith(_INSTALLED)


def _with_helper_frames(original: Any) -> Any:
    def filter_frames(self: TracerBase, summary: traceback.StackSummary) -> traceback.StackSummary:
        kept = original(self, summary)
        if not getattr(self, "_record_forward_stack_traces_only", False) or not kept:
            return kept
        kept_ids = {id(frame) for frame in kept}
        last = max((i for i, frame in enumerate(summary) if id(frame) in kept_ids), default=-1)
        extra = [frame for frame in list(summary)[last + 1:] if not _library_frame(frame.filename)]
        return traceback.StackSummary.from_list([*kept, *extra]) if extra else kept
    return filter_frames


def _lazy_lines(tb: Any, skip: int) -> traceback.StackSummary:
    """torch's ``torch.utils._traceback._extract_symbolized_tb`` without reading every frame's
    source line up front: ``FrameSummary`` reads it (``linecache``) when the frame is formatted,
    so only the frames a node's ``stack_trace`` keeps are read. The text is the same; torch's
    version reads the line of each of the ~100 frames of every node."""
    stack = traceback.StackSummary()
    for frame in reversed(tb[skip:]):
        stack.append(traceback.FrameSummary(frame["filename"], frame["line"], frame["name"], lookup_line=False))
    return stack


@contextlib.contextmanager
def helper_frames_recorded() -> Iterator[None]:
    """For the duration, exported nodes' ``stack_trace`` also hold the frames of the plain
    functions between the innermost ``forward`` and the op (see the module docstring). Nests;
    process-wide while active (``TracerBase._filter_traceback_frames`` is a class attribute)."""
    global _DEPTH
    with _LOCK:
        if _DEPTH == 0:
            if registry.enabled("helper_frames"):
                patched = _with_helper_frames(TracerBase.__dict__["_filter_traceback_frames"])
                _ORIGINAL_FILTER[:] = [registry.install("helper_frames", TracerBase, "_filter_traceback_frames",
                                                        value=patched)]
            if getattr(torch_traceback, "_extract_symbolized_tb", None) is not None and registry.enabled("lazy_traceback_lines"):
                _ORIGINAL_EXTRACT[:] = [registry.install("lazy_traceback_lines", torch_traceback, "_extract_symbolized_tb",
                                                         value=_lazy_lines)]
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                if _ORIGINAL_FILTER:
                    registry.uninstall("helper_frames", TracerBase, "_filter_traceback_frames",
                                       previous=_ORIGINAL_FILTER.pop())
                if _ORIGINAL_EXTRACT:
                    registry.uninstall("lazy_traceback_lines", torch_traceback, "_extract_symbolized_tb",
                                       previous=_ORIGINAL_EXTRACT.pop())
