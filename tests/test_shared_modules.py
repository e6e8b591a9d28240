"""One module object at two container entries (``nn.ModuleList([block, other, block])``).

Iterating the container runs the object twice. Export cannot keep one object's calls under two
paths apart, so the module owning the container runs opaque (its children extracted one by one,
each entry its own graph) in compiled and opaque mode, loudly with ``error_on_compilation_failure``.
Before, the repeated entry was hidden from the container while exporting and the graph ran one
layer fewer than eager, without any error.
"""

import copy

import pytest
import torch
from torch import nn

import nnbridge
from nnbridge import ExtractionError, ExtractionOptions, PatchableGraph, ZeroPatch


class Repeats(nn.Module):
    """Runs ``block``, ``other``, ``block`` from one ModuleList."""

    def __init__(self):
        super().__init__()
        block = nn.Linear(4, 4)
        self.layers = nn.ModuleList([block, nn.Linear(4, 4), block])

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class Outer(nn.Module):
    """A compiled root whose child owns the container with the repeated entry."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.stack = Repeats()

    def forward(self, x):
        return self.stack(self.pre(x)) * 2


def _made(cls):
    torch.manual_seed(0)
    return cls().eval()


MODES = {"compiled": ExtractionOptions(), "opaque": ExtractionOptions(skip_compilation=True)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("cls", [Repeats, Outer])
def test_every_entry_runs_as_in_eager(cls, mode):
    model, x = _made(cls), torch.randn(3, 4)
    expected = _made(cls)(x)
    pg = PatchableGraph(model, x, options=MODES[mode])
    assert torch.equal(pg(x), expected)
    prefix = "stack." if cls is Outer else ""
    assert {f"{prefix}layers_0.output", f"{prefix}layers_1.output", f"{prefix}layers_2.output"} <= set(pg.graph.keys())
    bridged = nnbridge.bridge(copy.deepcopy(model), x, options=MODES[mode])
    assert torch.equal(bridged(x), expected)


def test_the_owner_is_opaque_with_the_reason_and_the_rest_compiled():
    model, x = _made(Outer), torch.randn(3, 4)
    pg = PatchableGraph(model, x)
    assert "mul" in pg.graph.keys(), "the root's own ops stay a graph"
    assert "stack.relu" not in pg.graph.keys(), "the owner of the container runs its code"
    reasons = str(nnbridge.explain(pg))
    assert "'stack.layers.0' and 'stack.layers.2' are one module object" in reasons, reasons


def test_each_entry_is_its_own_invocation_for_patches():
    """Zeroing the third entry's output changes only what follows the third call, as a forward
    hook counting calls of the shared object would."""
    model, x = _made(Repeats), torch.randn(3, 4)
    pg = PatchableGraph(model, x)
    reference = _made(Repeats)
    calls = []

    def zero_third_call(module, args, output):
        calls.append(module)
        return torch.zeros_like(output) if len(calls) == 2 else output
    reference.layers[0].register_forward_hook(zero_third_call)
    with pg.patch({"layers_2.output": ZeroPatch()}):
        patched = pg(x)
    assert torch.equal(patched, reference(x))
    assert not torch.equal(patched, _made(Repeats)(x))


@pytest.mark.no_extraction_cache  # each case controls its own cache
@pytest.mark.parametrize("cached", [False, True], ids=["fresh", "from-disk-cache"])
def test_error_option_names_the_module_the_cause_and_the_fix(cached, tmp_path, monkeypatch):
    model, x = _made(Outer), torch.randn(3, 4)
    if cached:  # a lenient extraction stored the export; the strict one is served from it
        monkeypatch.setenv("NNBRIDGE_CACHE", str(tmp_path))
        monkeypatch.delenv("NNBRIDGE_EXTRACTION_CACHE", raising=False)
        PatchableGraph(_made(Outer), x)
        assert list(tmp_path.glob("extractions/*.nnbridge"))
    with pytest.raises(ExtractionError) as raised:
        PatchableGraph(model, x, options=ExtractionOptions(error_on_compilation_failure=True))
    message = str(raised.value)
    assert "'stack'" in message and "'stack.layers.0' and 'stack.layers.2' are one module object" in message
    assert "Give each container entry its own module object" in message
    assert torch.equal(model(x), _made(Outer)(x)), "nothing left half-extracted"
    assert list(dict(model.stack.layers.named_children())) == ["0", "1"] and len(model.stack.layers) == 3


class SecondEntry(nn.Module):
    """``ModuleList([lin, lin])`` whose forward indexes the second entry (graphpatch-parity report)."""

    def __init__(self):
        super().__init__()
        lin = nn.Linear(4, 4)
        self.layers = nn.ModuleList([lin, lin])

    def forward(self, x):
        return self.layers[1](x) * 2


@pytest.mark.parametrize("mode", list(MODES))
def test_indexing_the_repeated_entry(mode):
    model, x = _made(SecondEntry), torch.randn(3, 4)
    pg = PatchableGraph(model, x, options=MODES[mode])
    assert torch.equal(pg(x), _made(SecondEntry)(x))
    with pg.patch({"layers_1.output": ZeroPatch()}):
        assert torch.equal(pg(x), torch.zeros(3, 4))
