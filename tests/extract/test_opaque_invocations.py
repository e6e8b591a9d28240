"""Opaque mode numbers the invocations of a child called several times (``linear_0``,
``linear_1``), as compiled mode and graphpatch do: a patch on one invocation changes only that call."""

import pytest
import torch
from torch import nn

from nnbridge import ExtractionOptions, PatchableGraph, ZeroPatch

MODES = {"compiled": ExtractionOptions(), "opaque": ExtractionOptions(skip_compilation=True)}


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(torch.relu(self.linear(x)))


def _made():
    torch.manual_seed(0)
    return Twice().eval()


def _zero_call(model, which):
    """Eager reference: a forward hook zeroing the output of call number ``which`` (0-based)."""
    calls = []

    def hook(module, args, output):
        calls.append(module)
        return torch.zeros_like(output) if len(calls) - 1 == which else output
    return model.linear.register_forward_hook(hook)


@pytest.mark.parametrize("mode", list(MODES))
def test_each_invocation_is_its_own_node_path(mode):
    model, x = _made(), torch.randn(3, 4)
    pg = PatchableGraph(model, x, options=MODES[mode])
    assert {"linear_0.output", "linear_1.output", "linear_0.weight", "linear_1.weight"} <= set(pg.graph.keys())
    assert "linear.output" not in pg.graph.keys()
    assert torch.equal(pg(x), _made()(x))
    for which in (0, 1):
        reference = _made()
        handle = _zero_call(reference, which)
        with pg.patch({f"linear_{which}.output": ZeroPatch()}):
            patched = pg(x)
        assert torch.equal(patched, reference(x)), f"{mode}: linear_{which}"
        handle.remove()
        assert not torch.equal(patched, reference(x)), "the patch changes the output"
    assert torch.equal(pg(x), _made()(x)), "patches are undone; the call count restarts every run"


def test_opaque_invocations_share_the_parameters():
    model, x = _made(), torch.randn(3, 4)
    pg = PatchableGraph(model, x, options=MODES["opaque"])
    weights = dict(pg.named_parameters())
    assert all(w is model.linear.weight for n, w in weights.items() if n.endswith("weight"))
    pg(x).sum().backward()
    reference = _made()
    reference(x).sum().backward()
    assert torch.equal(model.linear.weight.grad, reference.linear.weight.grad)


def test_opaque_invocations_survive_pg_save_and_both_loads(tmp_path):
    import io
    model, x = _made(), torch.randn(3, 4)
    pg = PatchableGraph(model, x, options=MODES["opaque"])
    buffer = io.BytesIO()
    pg.save(buffer)
    buffer.seek(0)
    pg.save(tmp_path / "pg")
    for loaded in (torch.load(buffer, weights_only=False),
                   PatchableGraph.load(tmp_path / "pg", model, options=MODES["opaque"])):
        assert torch.equal(loaded(x), _made()(x))
        reference = _made()
        handle = _zero_call(reference, 1)
        with loaded.patch({"linear_1.output": ZeroPatch()}):
            assert torch.equal(loaded(x), reference(x))
        handle.remove()


# -- sizes: an opaque module runs its own code, so one extraction may serve any sizes ----------------
OPAQUE = ExtractionOptions(skip_compilation=True)


class PerRow(nn.Module):
    """Calls ``linear`` once per row: how many invocations depends on the batch size."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return torch.stack([self.linear(row) for row in x])


class LongOnly(nn.Module):
    """Calls ``extra`` only for sequences longer than 4."""

    def __init__(self):
        super().__init__()
        self.linear, self.extra = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        return self.extra(y) if x.shape[0] > 4 else y


def _seeded(cls):
    torch.manual_seed(0)
    return cls().eval()


def test_an_opaque_module_calling_each_child_once_serves_other_sizes():
    model = _seeded(LongOnly)  # longer than 4 rows: each child called once
    pg = PatchableGraph(model, torch.randn(6, 4), options=OPAQUE)
    for rows in (5, 9, 30):
        x = torch.randn(rows, 4)
        assert torch.equal(pg(x), _seeded(LongOnly)(x))
    assert len(pg.extractions) == 1


def test_a_child_called_per_row_is_extracted_again_for_another_batch_size():
    """Two rows extracted ``linear_0``, ``linear_1``; three rows are another call (three
    invocations, not the third routed to ``linear_1``), so a patch on ``linear_1`` applies to the
    second call only."""
    model = _seeded(PerRow)
    pg = PatchableGraph(model, torch.randn(2, 4), options=OPAQUE)
    x = torch.randn(3, 4)
    reference = _seeded(PerRow)
    handle = _zero_call(reference, 1)
    expected = reference(x)
    handle.remove()
    with pg.patch({"linear_1.output": ZeroPatch()}):
        assert torch.equal(pg(x), expected)
    assert len(pg.extractions) == 2
    assert torch.equal(pg(x[:2]), _seeded(PerRow)(x[:2]))


def test_a_child_the_extracted_call_left_uncalled_is_extracted_when_another_size_calls_it():
    """Three rows left ``extra`` uncalled (kept as an unused module); six rows call it: a new
    extraction, in which a patch on ``extra.output`` applies (not the uncalled module's)."""
    model = _seeded(LongOnly)
    pg = PatchableGraph(model, torch.randn(3, 4), options=OPAQUE)
    x = torch.randn(6, 4)
    reference = _seeded(LongOnly)
    handle = reference.extra.register_forward_hook(lambda module, args, output: torch.zeros_like(output))
    expected = reference(x)
    handle.remove()
    with pg.patch({"extra.output": ZeroPatch()}):
        assert torch.equal(pg(x), expected)
    assert len(pg.extractions) == 2
