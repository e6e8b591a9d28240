"""The checks :func:`~.passes.apply_passes` runs on a graph after each pass.

A check compares the graph after a pass with the graph before the first pass and says what is
wrong, or None. Built in (``checks=`` names them):

- ``"lint"``: ``graph.lint()`` (fx's invariants: topological order, targets that exist, ...);
- ``"signature"``: the placeholders (targets, order, defaults) and the output's structure are
  unchanged, so every caller of the graph still fits;
- ``"shapes"``: fake propagation (:class:`~.fake_values.FakeValues`) gives the output, and every
  child module call's arguments, the sizes, dtypes and devices they had before, and computes every
  value it computed before.

A user check is a function ``check(graph_module)`` that raises to fail, as ``PassManager`` checks
are. Example::

    checks = resolve_checks(("lint", "shapes", my_check))
    reference = checks[1].reference(before)
    reason = checks[1].failure(reference, after)     # None, or what went wrong
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate

from ..compat.torch.fake_values import fake_mode
from ..errors import PassCheckError
from .fake_values import UNKNOWN, FakeValues, describe_leaf, leaf_metadata


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"


class GraphCheck(abc.ABC):
    """A check (see the module docstring). Subclasses set :attr:`name` and implement :meth:`failure`."""

    name: str = ""

    def reference(self, before: GraphModule) -> Any:
        """What the check needs to know of the graph before the passes (computed once per graph)."""
        return None

    @abc.abstractmethod
    def failure(self, reference: Any, after: GraphModule) -> str | None:
        """What is wrong with ``after``, or None."""


class LintCheck(GraphCheck):
    name = "lint"

    def failure(self, reference: Any, after: GraphModule) -> str | None:
        try:
            after.graph.lint()
        except Exception as error:  # noqa: BLE001 - fx raises plain errors for each invariant
            return f"graph.lint() failed: {_first_line(error)}"
        return None


def _signature(module: GraphModule) -> tuple[list[tuple[str, Any]], str]:
    placeholders = [(str(n.target), n.args) for n in module.graph.nodes if n.op == "placeholder"]
    output = next((n for n in module.graph.nodes if n.op == "output"), None)
    structure = map_aggregate(output.args[0] if output is not None and output.args else None,
                              lambda a: "<value>" if isinstance(a, Node) else a)
    return placeholders, repr(structure)


class SignatureCheck(GraphCheck):
    name = "signature"

    def reference(self, before: GraphModule) -> Any:
        return _signature(before)

    def failure(self, reference: Any, after: GraphModule) -> str | None:
        placeholders, output = _signature(after)
        if placeholders != reference[0]:
            return (f"the placeholders changed from {[t for t, _ in reference[0]]} to {[t for t, _ in placeholders]};"
                    " a pass must keep the graph's inputs, which its callers pass")
        if output != reference[1]:
            return f"the output's structure changed from {reference[1]} to {output}"
        return None


@dataclass
class _Propagated:
    output: tuple[Any, list[Any]]
    calls: dict[str, tuple[Any, list[Any]]]
    failure: str | None


def _propagate(module: GraphModule, recorded: dict[str, Any]) -> _Propagated:
    values = FakeValues(module, fake_mode(), recorded=recorded)
    output = values.propagate()
    calls = {name: leaf_metadata(call) for name, call in values.calls.items()}
    return _Propagated(leaf_metadata(output), calls, values.failure)


def _compare(what: str, before: tuple[Any, list[Any]], after: tuple[Any, list[Any]], *, failure: str | None
             ) -> str | None:
    (spec_before, leaves_before), (spec_after, leaves_after) = before, after
    if spec_before != spec_after:
        return f"{what} changed structure: {len(leaves_before)} values before, {len(leaves_after)} after"
    for i, (old, new) in enumerate(zip(leaves_before, leaves_after)):
        if old is UNKNOWN:
            continue  # not computable before either (state objects, an opaque child): not checked
        if new is UNKNOWN:
            return f"{what} (value {i}) cannot be computed any more: {failure or 'unknown cause'}"
        if old != new:
            return f"{what} (value {i}) was {describe_leaf(old)}, is now {describe_leaf(new)}"
    return None


class ShapeCheck(GraphCheck):
    """Args:
        recorded: the graph's inputs on the example call (:func:`~.pass_inputs.recorded_inputs`).
    """

    name = "shapes"

    def __init__(self, recorded: dict[str, Any] | None = None) -> None:
        self.recorded = recorded or {}

    def reference(self, before: GraphModule) -> Any:
        return _propagate(before, self.recorded)

    def failure(self, reference: Any, after: GraphModule) -> str | None:
        now = _propagate(after, self.recorded)
        for name, call in reference.calls.items():  # where a change first shows, before the output
            if name in now.calls:
                found = _compare(f"the arguments of the call {name!r}", call, now.calls[name],
                                 failure=now.failure)
                if found is not None:
                    return found
        found = _compare("the output", reference.output, now.output, failure=now.failure)
        if found is not None:
            return found
        if reference.failure is None and now.failure is not None:
            return f"fake propagation fails: {now.failure}"
        return None


class UserCheck(GraphCheck):
    """A function ``check(graph_module)`` that raises to fail."""

    def __init__(self, function: Callable[[GraphModule], Any]) -> None:
        self.function = function
        self.name = getattr(function, "__name__", None) or type(function).__name__

    def failure(self, reference: Any, after: GraphModule) -> str | None:
        try:
            self.function(after)
        except Exception as error:  # noqa: BLE001 - a user check fails by raising anything
            return _first_line(error)
        return None


_BUILT_IN: dict[str, Callable[[], GraphCheck]] = {"lint": LintCheck, "signature": SignatureCheck, "shapes": ShapeCheck}
#: the checks ``apply_passes`` runs unless told otherwise
DEFAULT_CHECKS = ("lint", "signature", "shapes")


def resolve_checks(checks: Sequence[str | Callable[[GraphModule], Any]], *,
                   recorded: dict[str, Any] | None = None) -> list[GraphCheck]:
    """The check objects for ``checks`` (built-in names or functions ``check(graph_module)``);
    ``recorded``: the graph's inputs on the example call, for ``"shapes"``.

    Raises:
        PassCheckError: an unknown name, or something neither a name nor callable (check ``argument``).
    """
    if isinstance(checks, str):
        checks = (checks,)
    resolved: list[GraphCheck] = []
    for check in checks:
        if isinstance(check, str):
            make = _BUILT_IN.get(check)
            if make is None:
                raise PassCheckError(f"apply_passes: unknown check {check!r}; the built-in checks are"
                                     f" {sorted(_BUILT_IN)}, or pass a function check(graph_module) that raises.",
                                     check="argument")
            resolved.append(ShapeCheck(recorded) if check == "shapes" else make())
        elif callable(check):
            resolved.append(UserCheck(check))
        else:
            raise PassCheckError(f"apply_passes: checks= takes names {sorted(_BUILT_IN)} or functions"
                                 f" check(graph_module); got {check!r} ({type(check).__name__}).", check="argument")
    return resolved
