"""Weights computed by ``torch.nn.utils.parametrize`` (weight norm, spectral norm, orthogonal, a
user's parametrization): the weight is a function of other parameters, recomputed on each read;
spectral norm's power iteration updates buffers in training mode. Edits after bridging add,
stack or change a parametrization (the same edit is made to the eager copy). Removing one is not
an entry: ``parametrize`` injects a class per module that deep copies share, so removing it from
the eager copy (``remove_parametrizations`` deletes the class's property) would break the other."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from . import Call, Edit, Entry, calls


def _x():
    return torch.randn(3, 4)


class Symmetric(nn.Module):
    """A user's parametrization: the weight is the symmetric matrix of its upper triangle."""

    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


class Scaled(nn.Module):
    """A user's parametrization reading a plain Python attribute."""

    def __init__(self):
        super().__init__()
        self.scale = 2.0

    def forward(self, w):
        return w * self.scale


def _stack(first: nn.Module) -> nn.Module:
    return nn.Sequential(first, nn.ReLU(), nn.Linear(4, 2))


def _weight_norm():
    return _stack(parametrizations.weight_norm(nn.Linear(4, 4)))


def _spectral_norm():
    return _stack(parametrizations.spectral_norm(nn.Linear(4, 4)))


def _orthogonal():
    return _stack(parametrizations.orthogonal(nn.Linear(4, 4)))


def _symmetric():
    linear = nn.Linear(4, 4)
    parametrize.register_parametrization(linear, "weight", Symmetric())
    return _stack(linear)


def _scaled():
    linear = nn.Linear(4, 4)
    parametrize.register_parametrization(linear, "weight", Scaled())
    return _stack(linear)


def _plain():
    return _stack(nn.Linear(4, 4))


def _add_symmetric(m):
    parametrize.register_parametrization(m[0], "weight", Symmetric())


def _stack_scaled(m):
    parametrize.register_parametrization(m[0], "weight", Scaled())


def _rescale(m):
    m[0].parametrizations.weight[0].scale = 0.5


def _scale_original(m):
    with torch.no_grad():
        m[0].parametrizations.weight.original.mul_(3)


def _cached():
    return Call((_x(),), context=parametrize.cached)


ENTRIES = [
    Entry("parametrize_weight_norm", _weight_norm, calls(lambda: (_x(),), lambda: (_x(),))),
    Entry("parametrize_spectral_norm", _spectral_norm, calls(lambda: (_x(),), lambda: (_x(),), lambda: (_x(),))),
    Entry("parametrize_orthogonal", _orthogonal, calls(lambda: (_x(),), lambda: (_x(),))),
    Entry("parametrize_user", _symmetric, calls(lambda: (_x(),), _cached, lambda: (_x(),))),
    Entry("parametrize_added_after_bridging", _plain, calls(lambda: (_x(),), Edit(_add_symmetric), lambda: (_x(),)),
          item=5),
    Entry("parametrize_stacked_after_bridging", _symmetric,
          calls(lambda: (_x(),), Edit(_stack_scaled), lambda: (_x(),)), item=5),
    Entry("parametrize_attribute_edited", _scaled, calls(lambda: (_x(),), Edit(_rescale), lambda: (_x(),)), item=5),
    Entry("parametrize_original_edited", _scaled, calls(lambda: (_x(),), Edit(_scale_original), lambda: (_x(),)),
          item=5),
]
