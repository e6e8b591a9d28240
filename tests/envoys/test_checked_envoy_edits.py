"""An nnsight edit of an op envoy (``.output = ...``, in place) is checked where the value enters the
graph: another shape, dtype or device raises PatchError naming the NodePath and the envoy, not a
RuntimeError in a later op; in-place edits keep the shape unless an op changes it
(``unsqueeze_``), which is caught the same way; a fitting edit gives what the same edit gives
eagerly."""

import pytest
import torch

import nnbridge
from nnbridge.errors import PatchError
from utils import gpt2

IDS = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(0))
EDIT = r"^An nnsight edit of model\.transformer\.h\.0\.attn\.softmax \(\.output = \.\.\., \.input = \.\.\., or in place\)"
NODE_PATH = r"'transformer\.h_0\.attn\.softmax'"
NODE = r"of shape \(1, 4, 6, 6\), torch\.float32, on cpu\. "


def _assign_slice(softmax):
    softmax.output = softmax.output[..., :5]


def _assign_double(softmax):
    softmax.output = softmax.output.double()


def _assign_meta(softmax):
    softmax.output = softmax.output.to("meta")


def _unsqueeze_in_place(softmax):
    softmax.output.unsqueeze_(0)


@pytest.mark.parametrize("edit, given", [
    (_assign_slice, r"put a tensor of shape \(1, 4, 6, 5\), torch\.float32, on cpu in place of the node's value "),
    (_assign_double, r"put a tensor of shape \(1, 4, 6, 6\), torch\.float64, on cpu in place of the node's value "),
    (_assign_meta, r"put a tensor of shape \(1, 4, 6, 6\), torch\.float32, on meta in place of the node's value "),
    (_unsqueeze_in_place, r"changed the node's value in place to shape \(1, 1, 4, 6, 6\), torch\.float32, on cpu; it was "),
], ids=["shape", "dtype", "device", "in-place-shape"])
def test_wrong_edit_of_an_op_envoy_names_the_node_path(edit, given):
    model = nnbridge.NNsight(gpt2())
    with pytest.raises(PatchError, match=rf"{EDIT} on {NODE_PATH} {given}{NODE}"):
        with model.trace(IDS):
            edit(model.transformer.h[0].attn.softmax)
            model.output.save()
    with model.trace(IDS):  # nothing is left edited after the error
        softmax = model.transformer.h[0].attn.softmax.output.save()
        logits = model.lm_head.output.save()
    assert softmax.shape == (1, 4, 6, 6)
    assert torch.equal(logits, gpt2()(IDS).logits)


def test_fitting_edits_equal_the_same_edits_done_eagerly(monkeypatch):
    model = nnbridge.NNsight(gpt2())
    with model.trace(IDS):
        first = model.transformer.h[0].attn.softmax
        first.output = first.output * 0.5
        model.transformer.h[1].attn.softmax.output[:, 1] = 0  # in place, same shape
        got = model.lm_head.output.save()
    softmax = torch.nn.functional.softmax
    calls = []

    def edited(*args, **kwargs):
        calls.append(None)
        result = softmax(*args, **kwargs)
        if len(calls) == 1:
            return result * 0.5
        result[:, 1] = 0
        return result
    reference = gpt2()
    with monkeypatch.context() as patched:
        patched.setattr(torch.nn.functional, "softmax", edited)
        expected = reference(IDS).logits
    assert len(calls) == 2
    assert torch.equal(got, expected)
    assert not torch.equal(got, reference(IDS).logits)
