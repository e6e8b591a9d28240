"""What a module reads through its own attributes, its class and its defaults, and through the
user's modules, beyond plain values, configs' plain values, tensors and held objects: an array,
tensor or container of other values its class holds (``TABLE = {"a": np.ones(1)}`` read as
``self.TABLE``), a dict of arrays a forward's default is, a container of other values
(``self.tables = OrderedDict(a=np.ones(1))``, a ``deque`` of arrays), the object a bound built-in
method is bound to (``self.get = table.get``), an array or container in a config-like object
(``self.ns = SimpleNamespace(tables={...})``), and the globals of a module of the user's code read
through it (``held_user_settings.SCALE``).

Before, none of them was read: written or assigned anew after bridging, they left the graphs
computing with the old values, silently. Every test compares with an untouched copy run eagerly
(``torch.equal``)."""

from __future__ import annotations

import collections
import copy
import types

import held_user_settings
import numpy as np
import pytest
import torch
from torch import nn

import nnbridge
from utils import Outer, assert_follows_edit


def _reset():
    held_user_settings.reset()
    Holds.TABLE, Holds.QUEUE = {"a": np.array([2.0])}, collections.deque([np.array([2.0])])
    Holds.ARRAY, Holds.MASK = np.array([2.0]), torch.tensor([2.0])
    DEFAULT_TABLE["a"] = np.array([2.0])


@pytest.fixture(autouse=True)
def fresh_settings():
    _reset()
    yield
    _reset()


DEFAULT_TABLE = {"a": np.array([2.0])}


class Holds(nn.Module):
    """Reads what it holds, by ``kind``."""

    TABLE = {"a": np.array([2.0])}
    QUEUE = collections.deque([np.array([2.0])])
    ARRAY = np.array([2.0])
    MASK = torch.tensor([2.0])

    def __init__(self, kind: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kind = kind
        self.ordered = collections.OrderedDict(a=np.array([2.0]))
        self.queue = collections.deque([np.array([2.0])])
        table = {"scale": 2.0}
        self.get = table.get
        self.ns = types.SimpleNamespace(tables={"a": np.array([2.0])}, table=np.array([2.0]))

    def forward(self, x, table=DEFAULT_TABLE):
        y = self.lin(x)
        kind = self.kind
        if kind == "array in a dict class attribute":
            return y * float(self.TABLE["a"][0])
        if kind == "array in a deque class attribute":
            return y * float(type(self).QUEUE[0][0])
        if kind == "array class attribute":
            return y * float(self.ARRAY[0])
        if kind == "tensor class attribute":
            return y * self.MASK
        if kind == "array in a dict default":
            return y * float(table["a"][0])
        if kind == "array in an OrderedDict attribute":
            return y * float(self.ordered["a"][0])
        if kind == "array in a deque attribute":
            return y * float(self.queue[0][0])
        if kind == "bound dict.get attribute":
            return y * self.get("scale")
        if kind == "array in a dict of a config-like attribute":
            return y * float(self.ns.tables["a"][0])
        if kind == "array of a config-like attribute":
            return y * float(self.ns.table[0])
        if kind == "plain global of a user's module":
            return y * held_user_settings.SCALE
        if kind == "array global of a user's module":
            return y * float(held_user_settings.TABLE[0])
        return held_user_settings.act(y)  # "function of a user's module"


def _triple(x):
    return x * 3.0


def _edit(model: nn.Module, kind: str) -> str:
    """Changes what ``kind`` reads, in ``model`` (and globals); returns the name
    :func:`nnbridge.explain` gives the change."""
    inner = model.inner
    if kind == "array in a dict class attribute":
        Holds.TABLE["a"][0] = 5.0
        return "Holds.TABLE['a'] was written in place"
    if kind == "array in a deque class attribute":
        Holds.QUEUE[0][0] = 5.0
        return "Holds.QUEUE[0] was written in place"
    if kind == "array class attribute":
        Holds.ARRAY[0] = 5.0
        return "Holds.ARRAY was written in place"
    if kind == "tensor class attribute":
        Holds.MASK.mul_(3.0)
        return "Holds.MASK was written in place"
    if kind == "array in a dict default":
        DEFAULT_TABLE["a"][0] = 5.0
        return "__defaults__[0]['a'] was written in place"
    if kind == "array in an OrderedDict attribute":
        inner.ordered["a"][0] = 5.0
        return "inner.ordered['a'] was written in place"
    if kind == "array in a deque attribute":
        inner.queue[0][0] = 5.0
        return "inner.queue[0] was written in place"
    if kind == "bound dict.get attribute":
        inner.get.__self__["scale"] = 5.0
        return "inner.get.__self__ was written in place"
    if kind == "array in a dict of a config-like attribute":
        inner.ns.tables["a"][0] = 5.0
        return "inner.ns.tables['a'] was written in place"
    if kind == "array of a config-like attribute":
        inner.ns.table[0] = 5.0
        return "inner.ns.table was written in place"
    if kind == "plain global of a user's module":
        held_user_settings.SCALE = 5.0
        return "held_user_settings.SCALE was replaced"
    if kind == "array global of a user's module":
        held_user_settings.TABLE[0] = 5.0
        return "held_user_settings.TABLE was written in place"
    held_user_settings.act = _triple
    return "held_user_settings.act was replaced"


KINDS = ["array in a dict class attribute", "array in a deque class attribute", "array class attribute",
         "tensor class attribute", "array in a dict default", "array in an OrderedDict attribute",
         "array in a deque attribute", "bound dict.get attribute",
         "array in a dict of a config-like attribute", "array of a config-like attribute",
         "plain global of a user's module", "array global of a user's module", "function of a user's module"]


#: kinds whose edit changes a class or global the copy shares (edited once)
CLASS_KINDS = ("array in a dict class attribute", "array in a deque class attribute", "array class attribute",
               "tensor class attribute", "array in a dict default")


@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
@pytest.mark.parametrize("kind", KINDS)
def test_what_a_module_reads_through_its_attributes_or_a_users_module_written_after_bridging_re_extracts(kind,
                                                                                                     front):
    torch.manual_seed(0)

    def edit(model, reference):
        change = _edit(model, kind)
        if kind not in CLASS_KINDS:  # (a class attribute is shared with the reference)
            _edit(reference, kind)
        return change

    assert_follows_edit(Outer(Holds(kind)), torch.randn(2, 4), edit, front)


class CountsInSettings(nn.Module):
    """Counts its calls in a global of the user's module, in forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        held_user_settings.SCALE += 1.0
        return self.lin(x) * held_user_settings.SCALE


def test_a_users_module_global_written_in_forward_runs_eagerly_and_is_put_back():
    torch.manual_seed(0)
    model = Outer(CountsInSettings())
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        assert held_user_settings.SCALE == 2.0, "extraction's runs left their writes"
        assert "writes held_user_settings.SCALE" in nnbridge.explain(model).opaque["inner"]
        bridged = [model(x) for _ in range(2)]
        held_user_settings.reset()
        assert all(map(torch.equal, bridged, [reference(x) for _ in range(2)]))
    finally:
        nnbridge.unbridge(model)


def test_own_module_tells_the_users_modules_from_torchs_the_standard_librarys_and_installed_ones():
    import math

    import transformers

    from nnbridge.guards.code_objects import own_module

    assert own_module(held_user_settings)
    assert not any(map(own_module, (torch, math, transformers, np, "held_user_settings")))
