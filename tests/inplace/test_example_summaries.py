"""An in-place bridge computes its graphs' example summaries (the shapes op points print) on the
first read, not in ``bridge()``: in link order, as if computed when each extraction was linked.
A PatchableGraph computes them from export's metadata when it describes every value."""

import copy

import pytest
import torch

import nnbridge
from nnbridge.graph import summaries
from nnbridge.inplace.bridging import BRIDGE_KEY
from utils import gpt2, llama

IDS = torch.tensor([[3, 14, 15, 92, 65, 35]])
SOFTMAX = "transformer.h.0.attn.softmax"


@pytest.fixture
def propagations(monkeypatch):
    """Roots whose summaries were propagated (one per extraction's root graph)."""
    roots = []
    original = summaries.ExampleSummaries.propagate

    def propagate(self):
        roots.append(self.graph_module)
        return original(self)
    monkeypatch.setattr(summaries.ExampleSummaries, "propagate", propagate)
    return roots


def seen_shape(model, path, *args, **kwargs):
    """The shape of the op's value in a real forward (a forward hook on its op point)."""
    shapes = []
    handle = model.get_submodule(path).register_forward_hook(lambda m, a, out: shapes.append(out.shape))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        handle.remove()
    return shapes[0]


def test_bridge_computes_no_example_until_one_is_read(propagations):
    model = gpt2()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        nnbridge.bridge(model, IDS, use_cache=False)
    assert propagations == []
    point = model.get_submodule(SOFTMAX)
    shape = seen_shape(model, SOFTMAX, IDS, use_cache=False)
    assert propagations == [], "running the model computes none either"
    assert repr(point) == f"OpPoint(softmax: Tensor({', '.join(map(str, shape))}))"
    computed = len(propagations)
    assert computed > 0
    repr(model.get_submodule("transformer.h.1.attn.softmax"))
    assert len(propagations) == computed, "computed once for the whole extraction"
    with torch.no_grad():
        assert torch.equal(model(IDS, use_cache=False).logits, reference(IDS, use_cache=False).logits)


def test_a_new_call_structure_owes_its_examples_again_and_reads_in_link_order(propagations):
    model = gpt2()
    with torch.no_grad():
        nnbridge.bridge(model, IDS, use_cache=False)
        model(IDS[:, :4], use_cache=False, output_attentions=True)  # another call structure: linked, owed
    bridge = model.__dict__[BRIDGE_KEY]
    owed = [root() for root, _ in bridge.owed_examples]
    assert len(owed) >= 2 and propagations == []
    repr(model.get_submodule(SOFTMAX))
    assert bridge.owed_examples == []
    first = []
    for root in propagations:
        if any(root is o for o in owed) and not any(root is f for f in first):
            first.append(root)
    assert len(first) == len(owed) and all(a is b for a, b in zip(first, owed)), "in link order"


@pytest.mark.parametrize("make", [gpt2, llama])
def test_cache_writing_graphs_are_summarized_from_metadata_as_a_recording_run_would(make, monkeypatch):
    """A graph that writes its cache layer back (``write_state``, which returns None) is
    summarized from export's metadata: no recording run, and every node's summary equals what a
    recording run of the same example gives (it used to make the static pass give up)."""
    from nnbridge.patching.patchable_graph import PatchableGraph
    from nnbridge.extract import examples
    from nnbridge.graph.hierarchy import walk
    from nnbridge.graph.state import write_state

    model, reference = make(), make()
    recorded = []
    original = examples.record_examples

    def recording(*args, **kwargs):
        recorded.append(args[0])
        return original(*args, **kwargs)
    monkeypatch.setattr(examples, "record_examples", recording)
    pg = PatchableGraph(model, IDS, use_cache=True)
    assert recorded == []
    root = pg._graph_module
    assert any(node.target is write_state for graph in root.modules() if hasattr(graph, "graph")
               for node in graph.graph.nodes)
    static = {(path, name): owner.example(name) for path, owner, name, sub in walk(root) if sub is None}
    original(root, (IDS,), {"use_cache": True})
    assert static == {(path, name): owner.example(name) for path, owner, name, sub in walk(root) if sub is None}
    with torch.no_grad():
        assert torch.equal(pg(IDS, use_cache=True).logits, reference(IDS, use_cache=True).logits)
