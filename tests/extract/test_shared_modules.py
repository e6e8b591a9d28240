"""One module object at two container entries (``nn.ModuleList([block, other, block])``).

Iterating the container runs the object twice. The module owning the container is a graph whose
calls go through each entry's name (``layers_0``, ``layers_2``: each its own graph and invocation),
in compiled and opaque mode, also with ``error_on_compilation_failure``. A call passing a stateful
argument keeps the owner opaque (tests/extract/test_shared_container_compiled.py). Before, the
repeated entry was hidden from the container while exporting and the graph ran one layer fewer
than eager, without any error.
"""

import copy

import pytest
import torch
from torch import nn

import nnbridge
from nnbridge import ExtractionError, ExtractionOptions, PatchableGraph, ZeroPatch
from nnbridge.graph.module_tree import named_real_modules
from nnbridge.graph.op_point import OpPoint, OpPointContainer


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


def test_the_owner_is_a_graph_calling_each_entry_by_its_name():
    model, x = _made(Outer), torch.randn(3, 4)
    pg = PatchableGraph(model, x)
    keys = set(pg.graph.keys())
    assert {"mul", "stack.relu", "stack.relu_2"} <= keys, "the owner's own ops are a graph"
    assert nnbridge.explain(pg).opaque == {}


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
def test_the_error_option_extracts_it_too_and_leaves_the_registrations(cached, tmp_path, monkeypatch):
    model, x = _made(Outer), torch.randn(3, 4)
    if cached:  # a lenient extraction stored the export; the strict one is served from it
        monkeypatch.setenv("NNBRIDGE_CACHE", str(tmp_path))
        monkeypatch.delenv("NNBRIDGE_EXTRACTION_CACHE", raising=False)
        PatchableGraph(_made(Outer), x)
        assert list(tmp_path.glob("extractions/*.nnbridge"))
    pg = PatchableGraph(model, x, options=ExtractionOptions(error_on_compilation_failure=True))
    assert torch.equal(pg(x), _made(Outer)(x))
    assert "stack.layers_2.output" in set(pg.graph.keys())
    assert torch.equal(model(x), _made(Outer)(x))
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



class AliasInSequential(nn.Module):
    """A Linear registered at the root and again as a Sequential's second entry, beside a repeated
    ModuleList entry (``stack``): the Sequential runs the Linear only through its registration.
    Bridged, the Sequential's graph dropped that entry and the logits differed from eager (0.72)
    without an error."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.first = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.second = nn.Sequential(nn.Linear(4, 4), self.shared)
        self.stack = Repeats()

    def forward(self, x):
        return self.second(self.first(x)) + self.stack(x)


class SequentialTwice(nn.Module):
    """``Sequential(block, relu, block)``: the block runs twice (bridged, it ran once)."""

    def __init__(self):
        super().__init__()
        block = nn.Linear(4, 4)
        self.seq = nn.Sequential(block, nn.ReLU(), block)

    def forward(self, x):
        return self.seq(x) * 2


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("cls, sequential", [(AliasInSequential, "second"), (SequentialTwice, "seq")])
def test_a_sequential_holding_a_module_registered_twice_equals_eager(cls, sequential, mode):
    x = torch.randn(3, 4)
    reference = _made(cls)
    expected = reference(x)
    expected.sum().backward()
    model = _made(cls)
    bridged = nnbridge.bridge(model, x, options=MODES[mode])
    out = bridged(x)
    out.sum().backward()
    assert torch.equal(out, expected)
    for (name, grad), (_, reference_grad) in zip(_grads(model), _grads(reference)):
        assert torch.equal(grad, reference_grad), name
    pg = PatchableGraph(_made(cls), x, options=MODES[mode])
    assert torch.equal(pg(x), expected)
    if mode == "compiled":
        assert nnbridge.explain(pg).opaque == {}
        assert f"{sequential}.1.output" in pg.graph.keys(), "the Sequential calls each entry by its name"


def _grads(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p.grad) for name, p in model.named_parameters()]


def test_real_module_walk_is_named_modules_without_op_points_keeping_shared_children_under_each_parent():
    """named_real_modules, which op reads and extraction walk, lists what named_modules lists
    without its memo (a module shared by two parents under each) and without op points."""
    model, x = _made(AliasInSequential), torch.randn(2, 4)
    expected = _made(AliasInSequential)(x)
    before = [(name, id(module)) for name, module in model.named_modules(remove_duplicate=False)]
    # within one parent a module object registered twice comes once (as named_children gives it)
    before.remove(("stack.layers.2", id(model.stack.layers[0])))
    nnbridge.bridge(model, x)
    assert torch.equal(model(x), expected)
    assert any(isinstance(m, (OpPoint, OpPointContainer)) for m in model.modules())
    assert [(name, id(module)) for name, module in named_real_modules(model)] == before
    assert [name for name, _ in named_real_modules(model.first, "first")] == ["first", "first.0", "first.1"]
