"""Modules whose weight is computed at call time: ``torch.nn.utils.parametrize`` (a property on a
generated class), the hook-based ``weight_norm``/``spectral_norm`` and pruning (forward pre-hooks
writing the weight), in eval and train mode (spectral norm's power iteration then updates its
buffers in every call). Bridged, each equals the untouched model: outputs, gradients, buffers,
and after the underlying parameters are edited in place; a PatchableGraph too."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
import torch.nn.utils.prune as prune
from torch import nn

import nnbridge


class _Doubled(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


_KINDS = {
    "parametrize": lambda m: parametrize.register_parametrization(m, "weight", _Doubled()),
    "orthogonal": nn.utils.parametrizations.orthogonal,
    "weight_norm (hook)": nn.utils.weight_norm,
    "weight_norm": nn.utils.parametrizations.weight_norm,
    "spectral_norm (hook)": nn.utils.spectral_norm,
    "spectral_norm": nn.utils.parametrizations.spectral_norm,
    "prune": lambda m: prune.l1_unstructured(m, "weight", amount=0.5),
}


def _made(kind: str, train: bool) -> _Net:
    torch.manual_seed(0)
    model = _Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the hook-based weight_norm
        _KINDS[kind](model.a)
    return model.train(train)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("kind", list(_KINDS))
def test_a_weight_computed_at_call_time_equals_eager(kind, train):
    model, reference = _made(kind, train), _made(kind, train)
    x = torch.randn(3, 4)
    nnbridge.bridge(model, x)
    for _ in range(3):  # spectral norm's buffers move on in train mode
        assert torch.equal(model(x), reference(x))
    for (name, buffer), (_, expected) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.equal(buffer, expected), name
    with torch.no_grad():
        for module in (model, reference):
            for parameter in module.a.parameters():
                parameter.add_(0.5)
    out, expected = model(x), reference(x)
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for (name, parameter), (_, original) in zip(model.named_parameters(), reference.named_parameters()):
        assert (parameter.grad is None) == (original.grad is None), name
        assert parameter.grad is None or torch.equal(parameter.grad, original.grad), name
    nnbridge.unbridge(model)
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("kind", [kind for kind in _KINDS if "hook" not in kind and kind != "prune"])
def test_a_patchable_graph_over_a_parametrized_module_equals_eager(kind, train):
    """(The hook-based kinds are refused by a PatchableGraph over an unbridged model: its graphs
    would stand in for the hooked module.)"""
    model, reference = _made(kind, train), _made(kind, train)
    x = torch.randn(3, 4)
    pg = nnbridge.PatchableGraph(model, x)
    for _ in range(3):
        assert torch.equal(pg(x), reference(x))
    for (name, buffer), (_, expected) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.equal(buffer, expected), name
    parametrizations = model.a.parametrizations
    assert type(parametrizations.weight) is parametrize.ParametrizationList and len(parametrizations.weight) == 1
