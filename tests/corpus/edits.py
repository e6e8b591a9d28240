"""Issue 9 item 5: the module is edited after bridging (the same edit is made to the eager copy)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from . import Edit, Entry, calls


def _x():
    return torch.randn(2, 4)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _replace_layer(m):
    m.layers[2] = nn.Linear(4, 4)


class LoRA(nn.Module):
    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(base.in_features, 2))
        self.b = nn.Parameter(torch.randn(2, base.out_features))

    def forward(self, x):
        return self.base(x) + x @ self.a @ self.b


def _wrap_lora(m):
    m.layers[1] = LoRA(m.layers[1])


class Temperature(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.temperature = 1.0

    def forward(self, x):
        return torch.softmax(self.fc(x) / self.temperature, -1)


def _set_temperature(m):
    m.temperature = 3.0


class TensorAttr(nn.Module):
    """A plain tensor attribute (not a buffer, not a parameter) read in forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.offset = torch.zeros(4)

    def forward(self, x):
        return self.fc(x) + self.offset


def _reassign_offset(m):
    m.offset = torch.arange(4.0)


def _mutate_offset(m):
    m.offset.add_(5.0)


class Configured(nn.Module):
    """Config-like flags read in forward (``self.config.residual``, ``self.use_gate``)."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(residual=True, act="relu")
        self.use_gate = False
        self.fc = nn.Linear(4, 4)
        self.gate = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        h = torch.relu(h) if self.config.act == "relu" else torch.tanh(h)
        if self.use_gate:
            h = h * torch.sigmoid(self.gate(x))
        return x + h if self.config.residual else h


def _flip_config(m):
    m.config.residual = False
    m.config.act = "tanh"


def _enable_gate(m):
    m.use_gate = True


def _scale_weight(m):
    with torch.no_grad():
        m.layers[0].weight.mul_(2.0)


def _new_parameter(m):
    m.layers[0].weight = nn.Parameter(torch.randn(4, 4))


def _new_buffer(m):
    m.register_buffer("shift", torch.ones(4))


class MaybeBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        out = self.fc(x)
        if hasattr(self, "shift"):
            out = out + self.shift
        return out


def _hook(m):
    m.fc.register_forward_hook(lambda mod, args, out: out * 2)


ENTRIES = [
    Entry("edit_replace_submodule", Stack, calls(lambda: (_x(),), Edit(_replace_layer), lambda: (_x(),)), item=5),
    Entry("edit_wrap_lora", Stack, calls(lambda: (_x(),), Edit(_wrap_lora), lambda: (_x(),)), item=5),
    Entry("edit_python_attribute", Temperature,
          calls(lambda: (_x(),), Edit(_set_temperature), lambda: (_x(),)), item=5),
    Entry("edit_reassign_tensor_attribute", TensorAttr,
          calls(lambda: (_x(),), Edit(_reassign_offset), lambda: (_x(),)), item=5),
    Entry("edit_mutate_tensor_attribute", TensorAttr,
          calls(lambda: (_x(),), Edit(_mutate_offset), lambda: (_x(),)), item=5),
    Entry("edit_config_flags", Configured,
          calls(lambda: (_x(),), Edit(_flip_config), lambda: (_x(),), Edit(_enable_gate), lambda: (_x(),)), item=5),
    Entry("edit_weight_in_place", Stack, calls(lambda: (_x(),), Edit(_scale_weight), lambda: (_x(),)), item=5),
    Entry("edit_new_parameter", Stack, calls(lambda: (_x(),), Edit(_new_parameter), lambda: (_x(),)), item=5),
    Entry("edit_register_buffer", MaybeBuffer, calls(lambda: (_x(),), Edit(_new_buffer), lambda: (_x(),)), item=5),
    Entry("edit_forward_hook", MaybeBuffer, calls(lambda: (_x(),), Edit(_hook), lambda: (_x(),)), item=5),
]
