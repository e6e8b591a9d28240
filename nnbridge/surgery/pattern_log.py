"""The match log of :func:`~nnbridge.surgery.match` and :func:`~nnbridge.surgery.replace_pattern`.

One :class:`LogEntry` per candidate: the graph (its NodePath), the anchor node (the target node
the pattern's output was tried on, by NodePath), the verdict (``MATCHED``, ``REJECTED``,
``SKIPPED``) and the reason; per graph where nothing matched, the best near miss (``NEAR-MISS``:
the rejected candidate that matched most pattern nodes); when no graph in scope had a candidate,
one ``NO-CANDIDATE`` entry naming the pattern's last op and the fix. Each entry also goes to the logger
``nnbridge.surgery`` (``DEBUG``); with the environment variable ``NNBRIDGE_MATCH_LOG`` set to a
glob over graph NodePaths (``model.layers_*``, ``**``), the entries of those graphs only, at
``INFO``. Example::

    print(result.log)        # MATCHED  blocks_0.l1  [fuse in blocks_0] ...
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from .pass_targets import scope_pattern

LOGGER = logging.getLogger("nnbridge.surgery")
#: the environment variable that selects the graphs logged at INFO
ENVIRONMENT = "NNBRIDGE_MATCH_LOG"


@dataclass(frozen=True)
class LogEntry:
    """One candidate (see the module docstring).

    Attributes:
        pattern: the pattern's name.
        graph: the graph's NodePath (``"<root>"`` for a whole-model graph).
        anchor: the candidate node's NodePath (the graph's for a skipped graph).
        verdict: ``MATCHED``, ``REJECTED``, ``SKIPPED``, ``NEAR-MISS``, ``DROPPED`` (an input
            unused) or ``NO-CANDIDATE``.
        reason: why (empty for a match).
        score: how many pattern nodes matched before the reason (for near misses).
    """

    pattern: str
    graph: str
    anchor: str
    verdict: str
    reason: str = ""
    score: int = 0

    def __str__(self) -> str:
        tail = f": {self.reason}" if self.reason else ""
        return f"{self.verdict:9} {self.anchor}  [{self.pattern} in {self.graph}]{tail}"


class MatchLog(list[LogEntry]):
    """The entries, in the order candidates were tried; ``str(log)`` is one line each."""

    def __str__(self) -> str:
        return "\n".join(str(entry) for entry in self)

    def verdicts(self, verdict: str) -> list[LogEntry]:
        """The entries with ``verdict`` (``"REJECTED"``...)."""
        return [entry for entry in self if entry.verdict == verdict]

    def add(self, entry: LogEntry) -> None:
        """Keep ``entry`` and log it (see the module docstring)."""
        self.append(entry)
        chosen = os.environ.get(ENVIRONMENT)
        if not chosen:
            LOGGER.debug("%s", entry)
            return
        graph = "" if entry.graph == "<root>" else entry.graph
        if scope_pattern(chosen).fullmatch(graph) is not None:
            LOGGER.info("%s", entry)
