"""Module code that walks its own registry (``for child in self.children()``, a count of
``self.modules()``): a bridge registers op points in the modules' ``_modules``, so this code must
run where they are out of it (an extraction, or the module's own code over a bridged model: a
submodule called on its own, a call no graph serves yet, a trace that runs the model's code)."""

from __future__ import annotations

import torch
from torch import nn

from . import Call, Edit, Entry, calls


def _x():
    return torch.randn(2, 3)


class Loop(nn.Module):
    """Applies each child in registration order; adds the number of modules in its tree."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, x, scale=1.0):
        for child in self.children():
            x = torch.tanh(child(x))
        return x * scale + len(list(self.modules()))


class Walking(nn.Module):
    def __init__(self):
        super().__init__()
        self.loop = Loop()
        self.head = nn.Linear(3, 2)

    def forward(self, x, scale=1.0):
        return self.head(self.loop(x, scale))


class Chain(nn.Module):
    """A root applying its named children in turn (a hand-made Sequential)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 4)
        self.act = nn.Tanh()
        self.last = nn.Linear(4, 3)

    def forward(self, x):
        for _, child in self.named_children():
            x = child(x)
        return x


class Growing(nn.Module):
    """Appends a spare block to its ModuleList in forward until it holds three: a side effect on
    its registry (it runs opaque), which extraction's runs must undo and its runs must make."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(3, 3)])
        self.spare = [nn.Linear(3, 3), nn.Linear(3, 3)]  # (a plain list: not registered)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        if len(self.blocks) < 3:
            self.blocks.append(self.spare[len(self.blocks) - 1])
        return x


class Swapping(Growing):
    """Replaces its second block by a spare one in forward while spares last. torch.export puts
    module attributes back by path after tracing: unless the registry is put back first, the
    spare gets the attributes of the block it replaced (export's wrappers of its forward
    included)."""

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        if len(self.blocks) < 2:
            self.blocks.append(self.spare.pop())
        elif self.spare:
            self.blocks[1] = self.spare.pop()
        return x


class Rebinding(nn.Module):
    """Binds a spare module to its ``head`` attribute in forward while spares last: a registry edit
    of the module itself (it runs opaque), which must stay as eager's does."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 3)
        self.spare = [nn.Linear(3, 3), nn.Linear(3, 3)]  # (a plain list: not registered)

    def forward(self, x):
        x = torch.tanh(self.head(x))
        if self.spare:
            self.head = self.spare.pop()
        return x


class RebindingAlias(Rebinding):
    """Binds a spare module to ``alias``, a second name of its ``head``, in forward: extraction
    hides such an alias from the registry (an instance attribute), which the binding drops."""

    def __init__(self):
        super().__init__()
        self.alias = self.head

    def forward(self, x):
        x = torch.tanh(self.head(x))
        x = self.alias(x)
        if self.spare:
            self.alias = self.spare.pop()
        return x


class RebindingCalledTwice(nn.Module):
    """Calls a :class:`Rebinding` child by keyword, then positionally: export of the root fails
    on the second call (its call signature changed) after the child bound a spare."""

    def __init__(self):
        super().__init__()
        self.block = Rebinding()

    def forward(self, x):
        return self.block(x=x) + self.block(x)


class RebindingLayers(nn.Module):
    """Identical layers (layer reuse) of which each binds a spare ``head`` in its forward while
    spares last: opaque layers inside a root that is a graph."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Rebinding() for _ in range(3)])
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) + x
        return self.out(x)


def _call_loop(m):
    """The user calls the submodule on its own (its own code runs over the bridged model)."""
    m.seen = m.loop(torch.ones(2, 3)).detach()


def _blocks(m):
    return [type(block).__name__ for block in m.blocks]


def _seen(m):
    return m.__dict__.get("seen")


ENTRIES = [
    Entry("registry_walk_children", Walking,
          calls(lambda: (_x(),), lambda: Call((_x(),), {"scale": 3.0}), Edit(_call_loop), lambda: (_x(),)),
          attrs=_seen),
    Entry("registry_walk_root", Chain, calls(lambda: (_x(),), lambda: (torch.randn(5, 3),), lambda: (_x(),))),
    Entry("registry_grown_in_forward", Growing, calls(*[lambda: (_x(),)] * 4), attrs=_blocks),
    Entry("registry_swapped_in_forward", Swapping, calls(*[lambda: (_x(),)] * 4), attrs=_blocks),
    Entry("registry_rebound_in_forward", Rebinding, calls(*[lambda: (_x(),)] * 4)),
    Entry("registry_rebound_in_layers", RebindingLayers, calls(*[lambda: (_x(),)] * 4)),
    Entry("registry_alias_rebound_in_forward", RebindingAlias, calls(*[lambda: (_x(),)] * 4)),
    Entry("registry_rebound_in_a_failed_export", RebindingCalledTwice, calls(*[lambda: (_x(),)] * 4)),
]
