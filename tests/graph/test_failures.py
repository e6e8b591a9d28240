"""A failure inside a graph keeps its type and message and gains a note naming the NodePath of the
op and the model source line export recorded (STYLE practice 8)."""

import pytest
import torch

import nnbridge
from nnbridge import CustomPatch, PatchableGraph
from nnbridge.graph.failures import describe
from utils import gpt2


def notes(error):
    return "\n".join(getattr(error, "__notes__", []))


def test_failing_op_names_its_node_path_and_source_line(monkeypatch):
    model = gpt2()
    ids = torch.randint(1, 100, (1, 6))
    pg = PatchableGraph(model, ids)
    model.transformer.h[1].ln_2.weight.data = torch.ones(5)  # graphs share the model's tensors
    # the state guard would extract again (and fail in the eager code); run the stale graph itself
    stale = pg.extractions[0]
    monkeypatch.setattr(pg._dispatcher, "lookup", lambda args, kwargs: stale)
    with pytest.raises(RuntimeError, match="Expected weight to be of same shape") as raised:
        pg(ids)
    assert "raised at NodePath 'transformer.h_1.ln_2.layer_norm' (call_function aten.layer_norm" in notes(raised.value)
    assert "F.layer_norm(" in notes(raised.value), "the model source line"
    assert notes(raised.value).count("nnbridge:") == 1, "one note, however many graphs it passed"


def test_failing_patch_names_the_op_it_patches():
    model = gpt2()
    ids = torch.randint(1, 100, (1, 6))
    pg = PatchableGraph(model, ids)
    with pg.patch({"transformer.h_0.attn.softmax": CustomPatch(custom_op=lambda t: t.view(7, -1))}):
        with pytest.raises(RuntimeError, match=r"shape '\[7, -1\]' is invalid") as raised:
            pg(ids)
    assert "raised at NodePath 'transformer.h_0.attn.softmax' (in a patch or hook on this op)" in notes(raised.value)


def test_failing_hook_on_a_bridged_op_names_the_op():
    model = gpt2()
    ids = torch.randint(1, 100, (1, 6))
    nnbridge.bridge(model, ids)

    def broken(module, args, output):
        raise ValueError("bad hook")
    handle = model.transformer.h[1].attn.softmax.register_forward_hook(broken)
    with pytest.raises(ValueError, match="bad hook") as raised:
        model(ids)
    handle.remove()
    assert "raised at NodePath 'transformer.h_1.attn.softmax' (in a patch or hook on this op)" in notes(raised.value)
    nnbridge.unbridge(model)


def test_errors_outside_graphs_get_no_note():
    try:
        raise ValueError("plain")
    except ValueError as error:
        assert describe(error) is None
