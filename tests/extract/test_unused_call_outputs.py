"""A child call whose outputs its caller drops, in part (``self.three(x, y)[1][0]``) or whole
(``self.lin(h)`` never read). Eager runs such a call; so does the extracted graph: the call stays
in its caller's graph, with its op points, and the outputs equal the untouched model's. torch 2.13's
``torch.export.unflatten`` would drop it (its effect-token pass removes dead code) and then fail
looking its module up (``'InterpreterModule' object has no attribute 'c_linear@2'``);
:func:`nnbridge.compat.torch.export.unused_calls_kept` keeps it for programs without effect
tokens. With effect tokens torch's own pass runs, and extraction says so and names the guide's note."""

from __future__ import annotations

import pytest
import torch

import nnbridge
from nnbridge import ExtractionError, ExtractionOptions, PatchableGraph
from nnbridge.compat.torch import export as torch_export
from nnbridge.compat.torch.export import UnusedCallOutputError, _lost_call
from utils import falls_back

STRICT = ExtractionOptions(error_on_compilation_failure=True)


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


class DropsACall(torch.nn.Module):
    """Stores a call's output and then drops it (graphpatch's deeply nested fixture's ``B``)."""

    def __init__(self) -> None:
        super().__init__()
        self.three = Three()
        self.dropped = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = self.three(x, x * 3)
        outputs[0] = self.dropped(outputs[1][0])
        return outputs[1][0] * 2


def _model(cls: type[torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls().eval()


def test_a_caller_that_drops_child_outputs_is_a_graph_equal_to_eager():
    model, x = _model(UsesOne), torch.randn(2, 4)
    expected = model(x)
    pg = PatchableGraph(model, STRICT, x)
    assert pg.extractions[0].opaque == {}
    assert {"three.lin_0.output", "three.lin_1.output", "three.lin_2.output"} <= set(pg.graph)
    assert torch.equal(pg(x), expected)


def test_the_dropped_calls_run_and_are_probed_as_eager_computes_them():
    model, x = _model(UsesOne), torch.randn(2, 4)
    lin = model.three.lin
    with torch.no_grad():
        eager = [lin(x), lin(x + (x + 1)), lin((x + 1) * 2)]
    pg = PatchableGraph(model, STRICT, x)
    probes = [nnbridge.ProbePatch() for _ in range(3)]
    with pg.patch({f"three.lin_{k}.output": [probe] for k, probe in enumerate(probes)}):
        out = pg(x)
    for probe, value in zip(probes, eager, strict=True):
        assert torch.equal(probe.activation, value)
    # a patch of a dropped output reaches nothing downstream, as in eager
    with pg.patch({"three.lin_2.output": nnbridge.ZeroPatch()}):
        assert torch.equal(pg(x), out)


def test_a_call_whose_whole_output_is_dropped_stays_in_the_graph():
    model, x = _model(DropsACall), torch.randn(2, 4)
    expected = model(x)
    pg = PatchableGraph(model, STRICT, x)  # strict: the dropped call is not an uncalled module
    assert pg.extractions[0].opaque == {}
    assert "dropped.output" in pg.graph
    with pg.patch({"dropped.output": [probe := nnbridge.ProbePatch()]}):
        assert torch.equal(pg(x), expected)
    with torch.no_grad():
        assert torch.equal(probe.activation, model.dropped(model.three.lin(x + x * 3)))


def test_a_caller_that_uses_every_output_is_a_graph():
    model, x = _model(UsesAll), torch.randn(2, 4)
    pg = PatchableGraph(model, STRICT, x)
    assert pg.extractions[0].opaque == {}
    assert "three.lin_2.output" in pg.graph
    assert torch.equal(pg(x), model(x))


def test_a_program_without_effect_tokens_keeps_its_dead_calls():
    model = _model(UsesOne)
    fqns = tuple(name for name, _ in model.named_modules() if name)
    exported = torch.export.export(model, (torch.randn(2, 4),), strict=False, preserve_module_call_signature=fqns)
    assert not torch_export._has_effect_tokens(exported)
    unflattened = torch_export.unflatten(exported)
    assert len(torch_export.invocation_graphs(unflattened.three.lin)) == 3


@pytest.mark.no_extraction_cache  # the earlier tests' extraction of UsesOne must not be loaded
def test_with_effect_tokens_torchs_pass_runs_and_the_lost_call_is_refused_naming_the_note(monkeypatch):
    # a program with effect tokens goes through torch's own pass, which drops the dead calls
    monkeypatch.setattr(torch_export, "_has_effect_tokens", lambda exported: True)
    x = torch.randn(2, 4)
    with pytest.raises(ExtractionError, match=r"lost by torch.export.unflatten: its caller never uses.*"
                                              r"A child call whose outputs the caller drops") as raised:
        PatchableGraph(_model(UsesOne), STRICT, x)
    assert isinstance(raised.value.__cause__, UnusedCallOutputError)
    model = _model(UsesOne)
    with falls_back("<root>"):
        pg = PatchableGraph(model, x)
    assert "lost by torch.export.unflatten" in pg.extractions[0].opaque["<root>"]
    assert "three.lin_2.output" in pg.graph  # the child, called alone by the opaque root, is a graph
    assert torch.equal(pg(x), model(x))


@pytest.mark.parametrize(("message", "lost"), [
    ("'InterpreterModule' object has no attribute 'c_linear@2'", "c_linear@2"),
    ("'Module' object has no attribute '_ty'", "_ty"),
    ("'InterpreterModule' object has no attribute 'weight'", None),  # another AttributeError: re-raised as is
])
def test_only_unflattens_lost_calls_are_reworded(message, lost):
    assert _lost_call(AttributeError(message)) == lost
