"""A value a torch hook on an op point puts in place of the op's tensor is checked where it enters the
graph: another shape, dtype or device raises PatchError naming the NodePath and the hook, not a
RuntimeError in a later op; a fitting edit gives what the same edit gives eagerly."""

import pytest
import torch

import nnbridge
from nnbridge.errors import PatchError
from utils import gpt2

SOFTMAX = "transformer.h.0.attn.softmax"
NODE_PATH = r"'transformer\.h_0\.attn\.softmax'"


def _bridged(ids):
    return nnbridge.bridge(gpt2(), ids)


def _halve(module, args, output):
    return output * 0.5


def _unsqueeze_in_place(module, args, output):
    output.unsqueeze_(0)


def _double_in_place(module, args, output):
    output.mul_(2.0)


@pytest.mark.parametrize("hook, given", [
    (lambda module, args, output: output[..., :5], r"put a tensor of shape \(1, 4, 6, 5\), torch.float32, on cpu"),
    (lambda module, args, output: output.double(), r"put a tensor of shape \(1, 4, 6, 6\), torch.float64, on cpu"),
    (lambda module, args, output: output.to("meta"), r"put a tensor of shape \(1, 4, 6, 6\), torch.float32, on meta"),
    (lambda module, args, output: 1.5, r"put float 1.5"),
    (_unsqueeze_in_place, r"changed the node's value in place to shape \(1, 1, 4, 6, 6\), torch.float32, on cpu"),
], ids=["shape", "dtype", "device", "not-a-tensor", "in-place-shape"])
def test_wrong_value_from_a_torch_hook_names_the_node_path(hook, given):
    ids = torch.randint(0, 100, (1, 6))
    model = _bridged(ids)
    handle = model.get_submodule(SOFTMAX).register_forward_hook(hook)
    with pytest.raises(PatchError, match=rf"^A torch hook on the op point \((<lambda>|_unsqueeze_in_place)\) on {NODE_PATH} {given}"
                                         r".* of shape \(1, 4, 6, 6\), torch.float32, on cpu\. .*\.to\(\)"):
        model(ids)
    handle.remove()
    assert torch.equal(model(ids).logits, gpt2()(ids).logits), "nothing is left edited after the error"


def test_wrong_value_from_a_pre_hook_names_the_node_path():
    ids = torch.randint(0, 100, (1, 6))
    model = _bridged(ids)
    model.get_submodule(SOFTMAX).register_forward_pre_hook(lambda module, args: (args[0][:, :2],))
    with pytest.raises(PatchError, match=rf"on {NODE_PATH} put a tensor of shape \(1, 2, 6, 6\)"):
        model(ids)


def test_sizes_are_those_of_this_call():
    """The node's value on this call is the reference, not the example's: a batch and sequence the
    example did not have are no error, and a wrong edit is reported against this call's sizes."""
    model = _bridged(torch.randint(0, 100, (1, 6)))
    ids = torch.randint(0, 100, (2, 9))
    handle = model.get_submodule(SOFTMAX).register_forward_hook(_halve)
    model(ids)
    handle.remove()
    model.get_submodule(SOFTMAX).register_forward_hook(lambda module, args, output: output[:1])
    with pytest.raises(PatchError, match=r"shape \(1, 4, 9, 9\).* of shape \(2, 4, 9, 9\)"):
        model(ids)


def test_fitting_edits_equal_the_same_edits_done_eagerly(monkeypatch):
    ids = torch.randint(0, 100, (2, 7))
    model = _bridged(ids)
    for i in range(2):
        model.get_submodule(f"transformer.h.{i}.attn.softmax").register_forward_hook(_halve)
    # in place, same shape: allowed
    model.get_submodule("transformer.h.1.attn.softmax").register_forward_hook(_double_in_place)
    got = model(ids).logits
    softmax = torch.nn.functional.softmax
    calls = []

    def edited(*args, **kwargs):
        calls.append(None)
        result = softmax(*args, **kwargs) * 0.5
        return result.mul_(2.0) if len(calls) == 2 else result
    reference = gpt2()
    with monkeypatch.context() as patched:
        patched.setattr(torch.nn.functional, "softmax", edited)
        expected = reference(ids).logits
    assert len(calls) == 2
    assert torch.equal(got, expected)
    assert not torch.equal(got, reference(ids).logits)


def test_patch_and_hook_errors_share_one_message():
    """pg.patch's check and the op point's are one helper: the same wording after the edit's name."""
    ids = torch.randint(0, 100, (1, 6))
    model = _bridged(ids)
    pg = nnbridge.PatchableGraph(model, ids)
    with pg.patch({"transformer.h_0.attn.softmax": nnbridge.ReplacePatch(value=torch.zeros(1, 4, 6, 5))}):
        with pytest.raises(PatchError) as from_patch:
            model(ids)
    model.get_submodule(SOFTMAX).register_forward_hook(lambda module, args, output: torch.zeros(1, 4, 6, 5))
    with pytest.raises(PatchError) as from_hook:
        model(ids)
    assert str(from_patch.value).startswith("Patch ReplacePatch(")
    tail = str(from_hook.value).partition(" on 'transformer.h_0.attn.softmax' ")[2]
    assert tail and str(from_patch.value).endswith(tail)
