"""One FallbackWarning (an NNBridgeWarning) per extraction of a model lists the modules that fell back to eager code."""

import warnings

import pytest
import torch

import nnbridge
from nnbridge import ExtractionOptions, FallbackWarning, NNBridgeWarning, OpaqueGraphModule, PatchableGraph
from nnbridge.dispatch.fallback_report import MAX_CAUSE, MAX_ROWS, FallbackReport
from utils import assert_same

pytestmark = pytest.mark.no_extraction_cache  # the warning must not depend on what a cache holds


class ItemBranch(torch.nn.Module):
    """Branches on ``x.item()``: export cannot trace it, so it runs eagerly."""

    def forward(self, x):
        if x.sum().item() > 0:
            return x * 2
        return x * 3


class WithBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.branch = ItemBranch()

    def forward(self, x):
        return self.branch(self.lin(x)) + 1


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()


def test_one_warning_names_the_module_and_the_cause():
    model, x = WithBranch(), torch.randn(2, 4)
    with pytest.warns(FallbackWarning) as caught:
        pg = PatchableGraph(model, x)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "1 module of WithBranch runs eagerly" in message
    row = next(line for line in message.splitlines() if line.strip().startswith("branch "))
    assert "GuardOnDataDependentSymNode" in row
    assert "nnbridge.explain(model)" in message
    assert caught[0].filename == __file__  # the user's line
    assert isinstance(pg._graph_module.branch, OpaqueGraphModule)
    assert_same(pg(x), model(x))
    # explain stays the full report
    assert "GuardOnDataDependentSymNode" in nnbridge.explain(pg).opaque["branch"]


def test_no_warning_when_nothing_falls_back():
    model, x = Plain(), torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pg = PatchableGraph(model, x)
        assert_same(pg(x), model(x))


def test_calls_served_by_the_extraction_do_not_warn_again_and_a_new_extraction_does():
    model, x = WithBranch(), torch.randn(2, 4)
    with pytest.warns(FallbackWarning, match="runs eagerly"):
        pg = PatchableGraph(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pg(x)
        pg(torch.randn(5, 4))  # other sizes: the same extraction serves them
    with pytest.warns(FallbackWarning, match="runs eagerly") as caught:
        pg(x.unsqueeze(0))  # another rank: a new extraction
    assert len(caught) == 1


def test_warn_on_compilation_failure_warns_per_module_instead():
    model, x = WithBranch(), torch.randn(2, 4)
    with pytest.warns(NNBridgeWarning) as caught:
        PatchableGraph(model, x, options=ExtractionOptions(warn_on_compilation_failure=True))
    assert [str(w.message).split(" is opaque")[0] for w in caught] == ["Module 'branch'"]
    assert not any(isinstance(w.message, FallbackWarning) for w in caught)


def test_options_that_make_modules_opaque_do_not_warn():
    model, x = WithBranch(), torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PatchableGraph(model, x, options=ExtractionOptions(classes_to_skip_compiling={ItemBranch}))
        PatchableGraph(Plain(), x, options=ExtractionOptions(skip_compilation=True))


class OpaqueRoot(torch.nn.Module):
    """Branches on a value itself and calls a child that does too: the child is extracted by the
    root's opaque fallback, inside the same extraction."""

    def __init__(self):
        super().__init__()
        self.inner = WithBranch()

    def forward(self, x):
        if x.mean().item() > 10:
            x = x + 1
        return self.inner(x)


def test_fallbacks_of_children_of_an_opaque_module_share_the_one_warning():
    model, x = OpaqueRoot(), torch.randn(2, 4)
    with pytest.warns(FallbackWarning) as caught:
        nnbridge.bridge(model, x)
    try:
        assert len(caught) == 1
        message = str(caught[0].message)
        assert message.startswith("2 modules of OpaqueRoot run eagerly")
        assert "\n  <root> " in message and "\n  inner.branch " in message
    finally:
        nnbridge.unbridge(model)


def test_the_table_is_short():
    report = FallbackReport(Plain())
    report.add({f"layers.{i}": "Error: " + "x" * 500 for i in range(MAX_ROWS + 3)})
    lines = str(report.message()).splitlines()
    assert len(lines) == 1 + 1 + MAX_ROWS + 1 + 1
    assert lines[-2] == "  ... and 3 more"
    assert all(len(line.split(" | ", 1)[1]) == MAX_CAUSE for line in lines[2:2 + MAX_ROWS])
