"""The match log: verdicts and reasons by NodePath, near misses, the logger and NNBRIDGE_MATCH_LOG."""

import logging

import torch

import nnbridge
from nnbridge import ExtractionOptions, surgery
from pattern_models import Block, CustomLinear, Model, pattern


class Chain(torch.nn.Module):
    """``l2(l1(l0(x))) * 3``: two overlapping ``b(a(x))`` candidates, and a literal 3."""

    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.l2 = CustomLinear(8), CustomLinear(8), CustomLinear(8)

    def forward(self, x):
        return self.l2(self.l1(self.l0(x))) * 3


def bridged(model):
    x = torch.randn(2, 8)
    nnbridge.bridge(model, x)
    return model


def test_match_changes_nothing_and_reports_module_types():
    model = bridged(Model(layers=2))
    result = surgery.match(model, pattern, scope="blocks_0")
    assert [m.anchor for m in result.matches] == ["blocks_0.l1"]
    assert result.matches[0].modules == {"l0": "l0", "l1": "l1"}
    assert result.matches[0].node_paths() == ["blocks_0.l1", "blocks_0.l0"]
    lines = str(result.log).splitlines()
    assert lines == [
        "REJECTED  blocks_0.l0  [pattern in blocks_0]: blocks_0.x is placeholder x, not a call of a CustomLinear (l0)",
        "MATCHED   blocks_0.l1  [pattern in blocks_0]",
        "REJECTED  blocks_0.ln  [pattern in blocks_0]: module type differs: blocks_0.ln is a LayerNorm; the"
        " pattern's l1 wants a CustomLinear",
    ]
    assert surgery.edits(model) == []


def test_overlap_and_literal():
    model = bridged(Chain())

    def chained(x, a: CustomLinear, b: CustomLinear):
        return b(a(x))

    result = surgery.match(model, chained)
    assert [m.anchor for m in result.matches] == ["l1"]
    [overlap] = [e for e in result.log if e.anchor == "l2"]
    assert overlap.verdict == "REJECTED" and "overlaps the earlier match at l1 (both use l1)" in overlap.reason

    def times_two(x, a: CustomLinear):
        return a(x) * 2

    result = surgery.match(model, times_two)
    assert result.matches == []
    [rejected, near] = result.log
    assert rejected.verdict == "REJECTED" and rejected.anchor == "mul"
    assert "literal differs: argument 1 of mul is 3; the pattern has 2" in rejected.reason
    assert near.verdict == "NEAR-MISS" and near.anchor == "mul" and near.reason.startswith("2/2 pattern nodes")


def test_opaque_graphs_are_skipped():
    x = torch.randn(2, 8)
    model = Model(layers=2)
    nnbridge.bridge(model, x, options=ExtractionOptions(classes_to_skip_compiling={Block}))
    result = surgery.match(model, pattern)
    skipped = result.log.verdicts("SKIPPED")
    assert [e.anchor for e in skipped] == ["blocks_0", "blocks_1"]
    assert "opaque: Block runs eagerly" in skipped[0].reason
    assert result.matches == []


def test_the_logger_and_the_environment_glob(caplog, monkeypatch):
    model = bridged(Model(layers=2))
    with caplog.at_level(logging.DEBUG, logger="nnbridge.surgery"):
        surgery.match(model, pattern)
    assert "MATCHED   blocks_1.l1" in caplog.text and "blocks_0.l1" in caplog.text
    caplog.clear()
    monkeypatch.setenv("NNBRIDGE_MATCH_LOG", "blocks_1")
    with caplog.at_level(logging.INFO, logger="nnbridge.surgery"):
        result = surgery.match(model, pattern)
    assert "MATCHED   blocks_1.l1" in caplog.text and "blocks_0" not in caplog.text
    assert "blocks_0.l1" in str(result.log)  # the result keeps every graph's entries
