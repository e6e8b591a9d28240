"""One warning per extraction of a model, listing the modules that fell back to running eagerly.

A module falls back to an opaque module (its own code runs; only its inputs, output, parameters
and buffers are patchable) when its graph cannot be extracted faithfully. Every extraction made
while a :func:`fallback_report` is open, including those of the children of opaque modules that
it triggers, adds its :attr:`~nnbridge.extract.context.Extraction.fallbacks`; the outermost report
issues one :class:`~nnbridge.FallbackWarning` when it closes, with a table of module paths and
causes. No warning when nothing fell back, when the extraction raised, or for a dispatcher whose
options ask for a warning per module (``ExtractionOptions.warn_on_compilation_failure``, as
graphpatch). ``nnbridge.explain(model)`` gives the full report. Example::

    with fallback_report(model) as report:
        extraction = extract(model, args, kwargs)
        report.add(extraction.fallbacks)
    # FallbackWarning: 1 module of Model runs eagerly ...
"""

from __future__ import annotations

from contextvars import ContextVar, Token

import torch

from ..errors import FallbackWarning, warn

#: rows shown in the table; the rest are counted
MAX_ROWS = 8
#: characters of a cause shown in the table
MAX_CAUSE = 100


class FallbackReport:
    """The fallbacks of the extractions made while a :func:`fallback_report` is open:
    ``{module path: cause}`` in the order found."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.fallbacks: dict[str, str] = {}

    def add(self, fallbacks: dict[str, str]) -> None:
        """Add an extraction's ``{module path: cause}``."""
        for path, cause in fallbacks.items():
            self.fallbacks.setdefault(path, cause)

    def message(self) -> str:
        """The warning's text: one line, a table of at most :data:`MAX_ROWS` rows, the pointers."""
        count = len(self.fallbacks)
        rows = [(path or "<root>", _short(cause)) for path, cause in list(self.fallbacks.items())[:MAX_ROWS]]
        width = max(len("module"), *(len(path) for path, _ in rows))
        lines = [f"{count} module{'s' if count != 1 else ''} of {type(self.model).__name__} run{'s' if count == 1 else ''}"
                 " eagerly (opaque: only inputs, output, parameters and buffers are patchable; the ops inside are"
                 " not nodes), as no faithful graph could be extracted:",
                 f"  {'module':<{width}} | cause"]
        lines += [f"  {path:<{width}} | {cause}" for path, cause in rows]
        if count > MAX_ROWS:
            lines.append(f"  ... and {count - MAX_ROWS} more")
        lines.append("nnbridge.explain(model) gives the full report; ExtractionOptions(warn_on_compilation_failure=True)"
                     " warns per module, error_on_compilation_failure=True raises instead.")
        return "\n".join(lines)


def _short(cause: str) -> str:
    line = " ".join(cause.split())
    return line if len(line) <= MAX_CAUSE else line[:MAX_CAUSE - 3] + "..."


_OPEN: ContextVar[FallbackReport | None] = ContextVar("nnbridge_fallback_report", default=None)


class fallback_report:  # noqa: N801 - used as a function: ``with fallback_report(model) as report``
    """The report of the extractions made inside: the open one when there is one (a nested
    extraction joins its caller's), else a new one that warns on a normal exit when it holds any
    fallback (see the module docstring). A class, not a generator: the warning is attributed to
    the user's line, past nnbridge's frames (see :func:`nnbridge.errors.warn`)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.report: FallbackReport | None = None
        self.token: Token[FallbackReport | None] | None = None

    def __enter__(self) -> FallbackReport:
        current = _OPEN.get()
        if current is not None:
            return current
        self.report = FallbackReport(self.model)
        self.token = _OPEN.set(self.report)
        return self.report

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if self.token is None:
            return
        _OPEN.reset(self.token)
        if kind is None and self.report is not None and self.report.fallbacks:
            warn(self.report.message(), FallbackWarning)
