"""Module globals holding callables that are not Python functions: a bound built-in method
(``GET = TABLE.get``), a bound method of a script's object (``SCALE = S.scale``), and a built-in
function (``ACT = torch.tanh``, ``ROOT = math.sqrt``).

Before, the code walk read none of them: the dict, list or object a bound method is bound to
written after bridging (``TABLE["scale"] = 5.0``, ``S.k = 5.0``), or the global assigned another
built-in (``ACT = torch.sigmoid``), left the graphs computing with the old one, silently. Every
test compares with an untouched copy run eagerly (``torch.equal``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from utils import Outer, assert_follows_edit


class Scaler:
    """A script's object whose bound methods are held by globals."""

    def __init__(self):
        self.k = 2.0
        self.arr = np.array([2.0])

    def scale(self, x):
        return x * self.k

    def scale_by_array(self, x):
        return x * float(self.arr[0])


def _globals() -> dict:
    """The globals the :class:`Calls` forwards read, as they are at the start of each test."""
    table, scaler, numbers, arrays = {"scale": 2.0}, Scaler(), [2.0, 3.0], {"a": np.array([2.0])}
    return {"TABLE": table, "GET": table.get, "S": scaler, "SCALE": scaler.scale,
            "SCALE_BY_ARRAY": scaler.scale_by_array, "NUMBERS": numbers, "INDEX": numbers.index,
            "ARRAYS": arrays, "ITEM": arrays.__getitem__, "ACT": torch.tanh, "ROOT": math.sqrt}


globals().update(_globals())


@pytest.fixture(autouse=True)
def fresh_globals():
    globals().update(_globals())
    yield
    globals().update(_globals())


class Calls(nn.Module):
    """Calls a global callable, by ``kind``."""

    def __init__(self, kind: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x):
        y = self.lin(x)
        kind = self.kind
        if kind == "bound dict.get":
            return y * GET("scale")
        if kind == "bound method of an object":
            return SCALE(y)
        if kind == "bound method reading an array":
            return SCALE_BY_ARRAY(y)
        if kind == "bound list.index":
            return y * INDEX(3.0)
        if kind == "bound dict.__getitem__":
            return y * float(ITEM("a")[0])
        if kind == "built-in function":
            return ACT(y)
        return y * ROOT(4.0)  # "built-in of the standard library"


def _edit(kind: str) -> str:
    """Changes what ``kind`` calls or reads; returns the name :func:`nnbridge.explain` gives the change."""
    if kind == "bound dict.get":
        TABLE["scale"] = 5.0
        return "GET.__self__ was written in place"
    if kind == "bound method of an object":
        S.k = 5.0
        return "SCALE.__self__.k was replaced"
    if kind == "bound method reading an array":
        S.arr[0] = 5.0
        return "__self__.arr was written in place"
    if kind == "bound list.index":
        NUMBERS.insert(0, 9.0)
        return "INDEX.__self__ was written in place"
    if kind == "bound dict.__getitem__":
        ARRAYS["a"][0] = 5.0
        return "ITEM.__self__['a'] was written in place"
    if kind == "built-in function":
        globals()["ACT"] = torch.sigmoid
        return "ACT was replaced"
    globals()["ROOT"] = math.exp
    return "ROOT was replaced"


KINDS = ["bound dict.get", "bound method of an object", "bound method reading an array", "bound list.index",
         "bound dict.__getitem__", "built-in function", "built-in of the standard library"]


@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
@pytest.mark.parametrize("kind", KINDS)
def test_what_a_global_callable_reads_or_is_changed_after_bridging_re_extracts(kind, front):
    torch.manual_seed(0)
    assert_follows_edit(Outer(Calls(kind)), torch.randn(2, 4), lambda model, reference: _edit(kind), front)


def test_a_global_callable_is_part_of_the_code_digest():
    from nnbridge.guards.code_digest import code_digest

    model = Outer(Calls("bound dict.get"))
    before = code_digest(model)
    TABLE["scale"] = 5.0
    assert code_digest(model) != before
    model = Outer(Calls("built-in function"))
    before = code_digest(model)
    globals()["ACT"] = torch.sigmoid
    assert code_digest(model) != before, "the extraction cache would serve the graphs of torch.tanh"


def test_identity_text_names_callables_leaves_addresses_out_and_falls_back_to_identity():
    import threading

    from nnbridge.guards.code_objects import identity_text

    assert identity_text(torch.tanh) != identity_text(torch.sigmoid)
    assert identity_text(math.sqrt).endswith("math.sqrt")
    assert identity_text(threading.Lock()) == identity_text(threading.Lock())  # (no address in it)
    assert identity_text(nn.GELU()) != identity_text(nn.GELU(approximate="tanh"))

    class Opaque:
        __slots__ = ()

    first, second = Opaque(), Opaque()
    assert identity_text(first) != identity_text(second) and f"id {id(first)}" in identity_text(first)
