"""A child call whose outputs its caller drops: torch 2.13's ``torch.export.unflatten`` loses the
call's module (``'InterpreterModule' object has no attribute 'c_linear@2'``). Extraction says so
and names the guide's note; without ``error_on_compilation_failure`` the caller runs opaque and
equals eager. graphpatch (one Dynamo graph per module) extracted such modules."""

from __future__ import annotations

import pytest
import torch

from nnbridge import ExtractionError, ExtractionOptions, PatchableGraph
from nnbridge.compat.torch.export import UnusedCallOutputError, _lost_call
from utils import falls_back


class Three(torch.nn.Module):
    """Returns one call of its linear per output (graphpatch's deeply nested fixture's ``C``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> list[object]:
        return [self.lin(x), (self.lin(x + y), self.lin(y * 2))]


class UsesOne(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.three = Three()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.three(x, x + 1)[1][0]


class UsesAll(UsesOne):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.three(x, x + 1)
        return out[0] + out[1][0] + out[1][1]


def _model(cls: type[torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls().eval()


def test_a_caller_that_drops_child_outputs_raises_naming_the_note():
    x = torch.randn(2, 4)
    with pytest.raises(ExtractionError, match=r"lost by torch.export.unflatten: its caller never uses.*"
                                              r"A child call whose outputs the caller drops") as raised:
        PatchableGraph(_model(UsesOne), ExtractionOptions(error_on_compilation_failure=True), x)
    assert isinstance(raised.value.__cause__, UnusedCallOutputError)


def test_without_the_error_option_the_caller_runs_opaque_and_equals_eager():
    model, x = _model(UsesOne), torch.randn(2, 4)
    with falls_back("<root>"):
        pg = PatchableGraph(model, x)
    assert "lost by torch.export.unflatten" in pg.extractions[0].opaque["<root>"]
    assert "three.lin_2.output" in pg.graph  # the child, called alone by the opaque root, is a graph
    assert torch.equal(pg(x), model(x))


def test_a_caller_that_uses_every_output_is_a_graph():
    model, x = _model(UsesAll), torch.randn(2, 4)
    pg = PatchableGraph(model, ExtractionOptions(error_on_compilation_failure=True), x)
    assert pg.extractions[0].opaque == {}
    assert "three.lin_2.output" in pg.graph
    assert torch.equal(pg(x), model(x))


@pytest.mark.parametrize(("message", "lost"), [
    ("'InterpreterModule' object has no attribute 'c_linear@2'", "c_linear@2"),
    ("'Module' object has no attribute '_ty'", "_ty"),
    ("'InterpreterModule' object has no attribute 'weight'", None),  # another AttributeError: re-raised as is
])
def test_only_unflattens_lost_calls_are_reworded(message, lost):
    assert _lost_call(AttributeError(message)) == lost
