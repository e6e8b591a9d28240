"""Issue 9 item 15: copies of bridged models (``copy.deepcopy``, ``pickle``, ``torch.save``) are
equal, independent, bridged models; the original is left exactly as it was."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import nnbridge
from nnbridge import ExtractionOptions
from nnbridge.inplace.bridging import bridge_of
from nnbridge.errors import NNBridgeError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.out(torch.relu(self.fc(x))) * 2


def _pair() -> tuple[Block, Block]:
    torch.manual_seed(0)
    model, reference = Block(), Block()
    reference.load_state_dict(model.state_dict())
    return model, reference


def _torch_round_trip(module: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": _torch_round_trip,
}


def _structure(model: nn.Module) -> list[tuple[str, str]]:
    return [(name, type(m).__name__) for name, m in model.named_modules()]


@pytest.mark.parametrize("how", COPIES)
def test_copy_of_bridged_model_is_an_equal_independent_bridged_model(how: str) -> None:
    model, reference = _pair()
    x = torch.randn(3, 4)
    nnbridge.bridge(model, x)
    model(x), reference(x)
    point = model.get_submodule("relu")
    handle = point.register_forward_hook(lambda mod, args, out: out * 0)
    structure, keys = _structure(model), list(model.state_dict())
    calls = model.calls.clone()

    twin = COPIES[how](model)

    # the original: same modules, op points and hooks, still bridged
    assert _structure(model) == structure and list(model.state_dict()) == keys
    assert bridge_of(model) is not None
    assert torch.equal(model(x), reference.out(torch.zeros(3, 4)) * 2), "a hook on an op point survives"
    handle.remove()
    assert torch.equal(model(x), reference(x))
    # the copy: equal, bridged (op points at its first call), hooks on op points not copied
    assert bridge_of(twin) is not None and twin is not model
    assert torch.equal(twin(x), reference(x))
    assert torch.equal(twin.calls, calls + 1), "buffer state copied, and written back by the copy"
    assert twin.get_submodule("relu") is not point
    # independent weights
    with torch.no_grad():
        twin.fc.weight.add_(1)
    assert torch.equal(model(x), reference(x))
    assert not torch.equal(twin(x), reference(x))
    nnbridge.unbridge(model)
    nnbridge.unbridge(twin)
    assert _structure(twin) == _structure(reference)


@pytest.mark.parametrize("how", COPIES)
def test_copy_of_a_bridged_submodule_runs_its_own_weights(how: str) -> None:
    """Before: a child's copy ran the original's body (weak reference copied as is)."""
    model, reference = _pair()
    x = torch.randn(3, 4)
    nnbridge.bridge(model, x)
    child = COPIES[how](model.fc)
    assert torch.equal(child(x), reference.fc(x))
    with torch.no_grad():
        child.weight.zero_()
    assert torch.equal(child(x), child.bias.expand(3, 4))
    assert torch.equal(model(x), reference(x))
    nnbridge.unbridge(model)


def test_deepcopy_of_bridged_gpt2_with_cache() -> None:
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, attn_implementation="eager")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 100, (2, 5))
    nnbridge.bridge(model, ids)
    for how, make in COPIES.items():
        twin = make(model)
        with torch.no_grad():
            assert torch.equal(twin(ids).logits, reference(ids).logits), how
            assert torch.equal(model(ids).logits, reference(ids).logits), how
        nnbridge.unbridge(twin)
    nnbridge.unbridge(model)


def test_pickling_with_unpicklable_options_raises_and_leaves_the_model_bridged() -> None:
    model, reference = _pair()
    x = torch.randn(3, 4)
    options = ExtractionOptions(postprocessing_function=lambda graph_module, module: None)
    nnbridge.bridge(model, x, options=options)
    with pytest.raises(NNBridgeError, match="ExtractionOptions.*unbridge"):
        pickle.dumps(model)
    assert bridge_of(model) is not None
    assert torch.equal(model(x), reference(x))
    nnbridge.unbridge(model)
    assert _structure(model) == _structure(reference)


def test_deepcopy_of_nnsight_wrapper_traces_like_eager() -> None:
    model, reference = _pair()
    x = torch.randn(3, 4)
    wrapper = nnbridge.NNsight(model)
    with wrapper.trace(x):
        wrapper.output.save()
    twin = copy.deepcopy(wrapper)
    with twin.trace(x):
        relu = twin.relu.output.save()
        out = twin.output.save()
    assert torch.equal(out, reference(x))
    assert torch.equal(relu, torch.relu(reference.fc(x)))
    with wrapper.trace(x):
        out = wrapper.output.save()
    assert torch.equal(out, reference(x))
