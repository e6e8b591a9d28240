"""Writes into a call's Python containers: a module whose code appends to a list argument or sets a
key of a dict argument (``acts.append(h)``, ``store["h"] = h``).

A graph takes its arguments' tensors and rebuilds the containers around them: its code writes into
containers of its own, never into the caller's. So a module writing into a container it was passed
runs its own code, and so does every caller the container passed through, up to the module that
made it or got it from elsewhere (that module's graph would read the container back empty, or hand
its own caller a container the write never reached). When the root itself was passed the container,
the root runs its own code.

Found in one eager run (see :func:`~.eager_checks.eager_findings`): each module call's containers
(lists, dicts and sets, inside lists, tuples and dicts, three levels deep) are listed as it is
entered, by identity with the identities of their items, and compared as it returns.
"""

from __future__ import annotations

from typing import Any

#: how deep containers are searched inside a call's arguments
_DEPTH = 3


def _contents(container: Any) -> Any:
    if isinstance(container, dict):
        return tuple((id(key), id(value)) for key, value in container.items())
    if isinstance(container, list):
        return tuple(map(id, container))
    return frozenset(map(id, container))


def _containers(value: Any, found: dict[int, tuple[Any, Any]], depth: int = 0) -> dict[int, tuple[Any, Any]]:
    """``{id: (container, its contents)}`` of the lists, dicts and sets in ``value``."""
    if depth > _DEPTH or not isinstance(value, (list, tuple, dict, set)) or id(value) in found:
        return found
    if not isinstance(value, tuple):
        found[id(value)] = (value, _contents(value))
    for item in value.values() if isinstance(value, dict) else value if not isinstance(value, set) else ():
        _containers(item, found, depth + 1)
    return found


class ArgumentWrites:
    """The paths of the modules that must run their own code because of writes into their
    arguments' containers (see the module docstring), for one eager run: call :meth:`entering` as
    each module is entered and :meth:`leaving` as it returns, with the stack of running modules'
    paths (``""``: the root)."""

    def __init__(self) -> None:
        self.writers: dict[str, None] = {}
        self._entries: list[dict[int, tuple[Any, Any]]] = []

    def entering(self, depth: int, args: Any, kwargs: Any) -> None:
        """``depth``: how many modules are running (the entered one's callers)."""
        del self._entries[depth:]  # (calls of a run that raised never returned)
        self._entries.append(_containers((args, kwargs), {}))

    def leaving(self, active: list[str]) -> None:
        """``active``: the running modules' paths, outermost first, the returning module's last."""
        entry = self._entries.pop() if self._entries else {}
        written = {key for key, (container, contents) in entry.items() if _contents(container) != contents}
        if not written:
            return
        self.writers.setdefault(active[-1])
        for depth in range(len(self._entries) - 1, -1, -1):  # callers, innermost first
            self.writers.setdefault(active[depth])
            if written.isdisjoint(self._entries[depth]):  # made it, or got it from elsewhere
                break
