"""A namedtuple call argument: an LSTM's ``PackedSequence`` (whose constructor checks its fields).
Bridging raised ``TypeError: issubclass() arg 1 must be a class`` (a namedtuple's pytree node type
is a function) and building dim specs rebuilt the PackedSequence from dicts; now every packing
equals eager, bridged and as a PatchableGraph, outputs and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nnbridge
from nnbridge.compat.torch.pytree import node_class, pytree


def _packed(lengths: list[int], seed: int = 0) -> nn.utils.rnn.PackedSequence:
    torch.manual_seed(seed)
    x = torch.randn(len(lengths), 5, 8)
    return nn.utils.rnn.pack_padded_sequence(x, torch.tensor(lengths), batch_first=True, enforce_sorted=False)


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 6, 1, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, packed: nn.utils.rnn.PackedSequence) -> torch.Tensor:
        _, (hidden, _) = self.lstm(packed)
        return self.head(hidden[-1])


LENGTHS = [[5, 3], [5, 4], [3, 5], [5, 3, 2], [2, 2]]


@pytest.mark.parametrize("front", ["bridge", "PatchableGraph"])
def test_packed_sequences_of_every_length_equal_eager(front):
    torch.manual_seed(0)
    model = _Classifier()
    reference = copy.deepcopy(model)
    run = nnbridge.PatchableGraph(model, _packed([5, 3])) if front == "PatchableGraph" \
        else nnbridge.bridge(model, _packed([5, 3]))
    for lengths in LENGTHS:
        for seed in (0, 1):
            packed = _packed(lengths, seed)
            out, expected = run(packed), reference(packed)
            assert torch.equal(out, expected), lengths
    model.zero_grad()
    run(_packed([5, 4])).sum().backward()
    reference(_packed([5, 4])).sum().backward()
    for (name, parameter), (_, original) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(parameter.grad, original.grad), name


def test_node_class_of_a_namedtuple_is_its_class():
    packed = _packed([5, 3])
    assert node_class(pytree.tree_flatten(packed)[1]) is nn.utils.rnn.PackedSequence
    assert node_class(pytree.tree_flatten((1, [2]))[1]) is tuple
