"""Module globals that are containers holding more than plain values (see
:meth:`nnbridge.guards.code_walk.CodeWalk.data_item`): an array in a dict, a settings object in a
dict, a plain value beside a function, arrays in a list, functions in a list or dict, an array in a
closure's dict, an array or tensor attribute of a global object of settings or of a class; and
containers of the standard library's other types (``OrderedDict``, ``defaultdict``, ``deque``,
``bytearray``, ``array.array``), a dict subclass, a ``functools.partial``'s keywords, a dict held
by an object of settings or a class, the defaults of a function held in a dict.

Before, such a global was read by nobody: a value written into it after bridging (``STORE["a"][0] =
5.0``, ``MIX["scale"] = 7.0``, ``HOOKS[0] = triple``) left the graphs computing with the old one,
silently, and an array in a global list written in forward kept extraction's writes; the same held
for the other container types (read by a rule per type, which missed every type it did not name). Every test
compares with an untouched copy run eagerly (``torch.equal``)."""

from __future__ import annotations

import array
import collections
import copy
import functools
import types

import numpy as np
import pytest
import torch
from torch import nn

import nnbridge
from nnbridge.guards.bindings import MISSING, SequenceItems
from nnbridge.guards.code_check import CodeCheck, code_bindings
from nnbridge.guards.code_digest import code_digest
from utils import Outer, assert_follows_edit


def double(x):
    return x * 2


def triple(x):
    return x * 3


def scale(x, k=2.0):
    return x * k


def halve(x, k=0.5):
    return x * k


class Store(dict):
    """A script's dict subclass, with the dict's own lookup: read as a dict is."""


class Settings:
    """A script's own object of settings, held in a global dict."""

    def __init__(self):
        self.v = 1.0


def _globals() -> dict:
    """The globals the :class:`Reads` forwards read, as they are at the start of each test."""
    def make():
        box = {"a": np.array([2.0])}

        def read(y):
            return y * float(box["a"][0])
        return read, box
    read, box = make()
    return {
        "STORE": {"a": np.array([2.0])},
        "MIX": {"scale": 2.0, "fn": len},
        "LIST": [np.array([3.0])],
        "TUPLE": (2.0, np.array([1.0])),
        "OBJECTS": {"o": Settings()},
        "HOOKS": [double],
        "ACTS": {"a": double, "n": 1.0},
        "GETS": {"x": np.ones(1)},
        "SEQ": [np.array([1.0]), np.array([2.0])],
        "CFG": types.SimpleNamespace(table=np.array([2.0]), t=torch.tensor([2.0])),
        "READ": read,
        "BOX": box,
        "ORDERED": collections.OrderedDict(a=np.array([2.0])),
        "DEFAULTS": collections.defaultdict(float, {"scale": 2.0, "fn": len}),
        "QUEUE": collections.deque([np.array([2.0])]),
        "BYTES": bytearray(b"\x02"),
        "NUMBERS": array.array("d", [2.0]),
        "PARTIAL": functools.partial(scale, k=2.0),
        "SUBCLASS": Store(a=np.array([2.0])),
        "NESTED": types.SimpleNamespace(tables={"a": np.array([2.0])}),
        "SCALES": {"s": halve},
    }


class Flags:
    """A class the code names, holding an array."""

    arr = np.array([2.0])
    tables = {"a": np.array([2.0])}


globals().update(_globals())


@pytest.fixture(autouse=True)
def fresh_globals():
    globals().update(_globals())
    Flags.arr = np.array([2.0])
    Flags.tables = {"a": np.array([2.0])}
    scale.__defaults__, halve.__defaults__ = (2.0,), (0.5,)
    yield
    scale.__defaults__, halve.__defaults__ = (2.0,), (0.5,)


class Reads(nn.Module):
    """Reads a global container's item, by ``kind``."""

    def __init__(self, kind: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x):
        y = self.lin(x)
        kind = self.kind
        if kind == "array in dict":
            return y * float(STORE["a"][0])
        if kind == "plain beside a builtin":
            return y * MIX["scale"]
        if kind == "array in list":
            return y * float(LIST[0][0])
        if kind == "array in tuple":
            return y * float(TUPLE[1][0])
        if kind == "settings object in dict":
            return y * OBJECTS["o"].v
        if kind == "function in list":
            for hook in HOOKS:
                y = hook(y)
            return y
        if kind == "function in dict":
            return ACTS["a"](y)
        if kind == "key absent then added":
            return y * float(GETS.get("z", np.ones(1))[0])
        if kind == "list grown":
            return y * sum(float(a[0]) for a in SEQ)
        if kind == "array of a settings object":
            return y * float(CFG.table[0])
        if kind == "tensor of a settings object":
            return y * CFG.t
        if kind == "array of a class":
            return y * float(Flags.arr[0])
        if kind == "array in an OrderedDict":
            return y * float(ORDERED["a"][0])
        if kind == "plain in a defaultdict":
            return y * DEFAULTS["scale"]
        if kind == "array in a deque":
            return y * float(QUEUE[0][0])
        if kind == "byte of a bytearray":
            return y * BYTES[0]
        if kind == "number of an array.array":
            return y * NUMBERS[0]
        if kind == "keyword of a partial":
            return PARTIAL(y)
        if kind == "array in a dict subclass":
            return y * float(SUBCLASS["a"][0])
        if kind == "array in a dict of a settings object":
            return y * float(NESTED.tables["a"][0])
        if kind == "array in a dict of a class":
            return y * float(Flags.tables["a"][0])
        if kind == "defaults of a function in a dict":
            return SCALES["s"](y)
        return READ(y)  # "array in a closure's dict"


def _edit(kind: str) -> str:
    """Changes what ``kind`` reads; returns the name :func:`nnbridge.explain` gives the change."""
    if kind == "array in dict":
        STORE["a"][0] = 5.0
        return "STORE['a'] was written in place"
    if kind == "plain beside a builtin":
        MIX["scale"] = 7.0
        return "MIX['scale'] was replaced"
    if kind == "array in list":
        LIST[0][0] = 9.0
        return "LIST[0] was written in place"
    if kind == "array in tuple":
        TUPLE[1][0] = 8.0
        return "TUPLE[1] was written in place"
    if kind == "settings object in dict":
        OBJECTS["o"].v = 6.0
        return "OBJECTS['o'].v was replaced"
    if kind == "function in list":
        HOOKS[0] = triple
        return "HOOKS[0] was replaced"
    if kind == "function in dict":
        ACTS["a"] = triple
        return "ACTS['a'] was replaced"
    if kind == "key absent then added":
        GETS["z"] = np.array([5.0])
        return "GETS was written in place"
    if kind == "list grown":
        SEQ.append(np.array([4.0]))
        return "SEQ was written in place"
    if kind == "array of a settings object":
        CFG.table[0] = 7.0
        return "CFG.table was written in place"
    if kind == "tensor of a settings object":
        CFG.t.mul_(3)
        return "CFG.t was written in place"
    if kind == "array of a class":
        Flags.arr[0] = 9.0
        return "Flags.arr was written in place"
    if kind == "array in an OrderedDict":
        ORDERED["a"][0] = 5.0
        return "ORDERED['a'] was written in place"
    if kind == "plain in a defaultdict":
        DEFAULTS["scale"] = 5.0
        return "DEFAULTS['scale'] was replaced"
    if kind == "array in a deque":
        QUEUE[0][0] = 5.0
        return "QUEUE[0] was written in place"
    if kind == "byte of a bytearray":
        BYTES[0] = 5
        return "BYTES was written in place"
    if kind == "number of an array.array":
        NUMBERS[0] = 5.0
        return "NUMBERS was written in place"
    if kind == "keyword of a partial":
        PARTIAL.keywords["k"] = 5.0
        return "PARTIAL.keywords was written in place"
    if kind == "array in a dict subclass":
        SUBCLASS["a"][0] = 5.0
        return "SUBCLASS['a'] was written in place"
    if kind == "array in a dict of a settings object":
        NESTED.tables["a"][0] = 5.0
        return "NESTED.tables['a'] was written in place"
    if kind == "array in a dict of a class":
        Flags.tables["a"][0] = 5.0
        return "Flags.tables['a'] was written in place"
    if kind == "defaults of a function in a dict":
        halve.__defaults__ = (5.0,)
        return "halve.__defaults__ was replaced"
    BOX["a"][0] = 3.0
    return "box['a'] was written in place"


KINDS = ["array in dict", "plain beside a builtin", "array in list", "array in tuple", "settings object in dict",
         "function in list", "function in dict", "key absent then added", "list grown",
         "array of a settings object", "tensor of a settings object", "array of a class",
         "array in a closure's dict", "array in an OrderedDict", "plain in a defaultdict", "array in a deque",
         "byte of a bytearray", "number of an array.array", "keyword of a partial", "array in a dict subclass",
         "array in a dict of a settings object", "array in a dict of a class", "defaults of a function in a dict"]


@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_value_in_a_global_container_written_after_bridging_re_extracts(kind, front):
    torch.manual_seed(0)
    assert_follows_edit(Outer(Reads(kind)), torch.randn(2, 4), lambda model, reference: _edit(kind), front)


WRITTEN = {"a": np.zeros(2), "n": 0}
WRITTEN_LIST = [np.zeros(2)]


class Writes(nn.Module):
    """Writes an array in a global dict (and a count beside it) or in a global list."""

    def __init__(self, where: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.where = where

    def forward(self, x):
        if self.where == "dict":
            WRITTEN["a"] += 1
            WRITTEN["n"] += 1
        else:
            WRITTEN_LIST[0][0] += 1
        return self.lin(x)


@pytest.mark.parametrize("where", ["dict", "list"])
def test_an_array_in_a_global_container_written_in_forward_runs_eagerly_and_is_put_back(where):
    WRITTEN.update(a=np.zeros(2), n=0)
    WRITTEN_LIST[0] = np.zeros(2)
    torch.manual_seed(0)
    model = Outer(Writes(where))
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        array = WRITTEN["a"] if where == "dict" else WRITTEN_LIST[0]
        assert array.tolist() == [0.0, 0.0] and WRITTEN["n"] == 0, "extraction's runs left their writes"
        assert f"writes {__name__}.{'WRITTEN' if where == 'dict' else 'WRITTEN_LIST'}" \
            in nnbridge.explain(model).opaque["inner"]
        model(x)
        model(x)
        assert array.tolist() == [2.0, 0.0] if where == "list" else array.tolist() == [2.0, 2.0]
    finally:
        nnbridge.unbridge(model)


def test_a_value_in_a_global_container_is_part_of_the_code_digest():
    model = Outer(Reads("array in dict"))
    before = code_digest(model)
    STORE["a"][0] = 4.0
    assert code_digest(model) != before


class Registry(dict):
    """A mapping type with its own lookup, as transformers' registries: only its code is read."""

    def get(self, key, default=None):
        return super().get(key, default)


REGISTRY = Registry(fn=double)


class ReadsRegistry(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return REGISTRY["fn"](self.lin(x))


def test_a_registry_of_another_mapping_type_growing_does_not_re_extract_and_its_code_is_followed():
    model = ReadsRegistry()
    check = CodeCheck(code_bindings(model))
    REGISTRY["other"] = 3.0
    try:
        assert check.holds(), "an entry added to a registry of another mapping type re-extracts"
        REGISTRY["fn"] = triple
        assert not check.holds() and check.what_changed().endswith("REGISTRY['fn'] was replaced")
    finally:
        REGISTRY.clear()
        REGISTRY["fn"] = double


def test_sequence_items_reads_assigns_and_tells_missing_past_the_end():
    items = SequenceItems([1, 2])
    assert items[1] == 2 and items[-2] == 1 and items[2] is MISSING and items.get(5) is MISSING
    assert 1 in items and 2 not in items
    items[0] = 7
    assert items.sequence == [7, 2]
    items.sequence.clear()
    assert items[0] is MISSING


def _written() -> dict:
    """The globals :class:`WritesOther` writes, as they are at the start of each run."""
    return {
        "W_KEYS": {"a": np.array([2.0]), "f": len},
        "W_ORDERED": collections.OrderedDict(a=np.array([2.0])),
        "W_QUEUE": collections.deque([np.array([2.0])], maxlen=3),
        "W_NUMBERS_QUEUE": collections.deque([1.0], maxlen=3),
        "W_BYTES": bytearray(b"\x02"),
        "W_NUMBERS": array.array("d", [2.0]),
        "W_PARTIAL": functools.partial(scale, k=2.0),
        "W_NESTED": types.SimpleNamespace(tables={"n": np.zeros(1)}),
    }


globals().update(_written())


class WritesOther(nn.Module):
    """Writes a global container of another type in forward, by ``kind``, and reads it back."""

    def __init__(self, kind: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x):
        y = self.lin(x)
        kind = self.kind
        if kind == "key added to a dict":
            W_KEYS["n"] = W_KEYS.get("n", 0) + 1
            return y * float(W_KEYS["a"][0]) * W_KEYS["n"]
        if kind == "item of an OrderedDict":
            W_ORDERED["a"] += 1
            return y * float(W_ORDERED["a"][0])
        if kind == "array appended to a deque":
            W_QUEUE.append(np.array([float(len(W_QUEUE))]))
            return y * float(W_QUEUE[-1][0])
        if kind == "number appended to a deque":
            W_NUMBERS_QUEUE.append(W_NUMBERS_QUEUE[-1] + 1)
            return y * W_NUMBERS_QUEUE[-1]
        if kind == "byte of a bytearray":
            W_BYTES[0] += 1
            return y * W_BYTES[0]
        if kind == "number of an array.array":
            W_NUMBERS[0] += 1
            return y * W_NUMBERS[0]
        if kind == "keyword of a partial":
            W_PARTIAL.keywords["k"] += 1
            return W_PARTIAL(y)
        W_NESTED.tables["n"] += 1  # "array in a dict of a settings object"
        return y * float(W_NESTED.tables["n"][0])


def _written_state() -> str:
    return repr((sorted((key, repr(value)) for key, value in W_KEYS.items()), W_ORDERED, list(W_QUEUE),
                 W_NUMBERS_QUEUE, W_BYTES, W_NUMBERS, W_PARTIAL.keywords, W_NESTED.tables))


@pytest.mark.parametrize("kind", ["key added to a dict", "item of an OrderedDict", "array appended to a deque",
                                  "number appended to a deque", "byte of a bytearray", "number of an array.array",
                                  "keyword of a partial", "array in a dict of a settings object"])
def test_a_global_container_of_another_type_written_in_forward_runs_eagerly_and_is_put_back(kind):
    globals().update(_written())
    torch.manual_seed(0)
    model = Outer(WritesOther(kind))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    before = _written_state()
    nnbridge.bridge(model, x)
    try:
        assert _written_state() == before, "extraction's runs left their writes"
        assert "writes" in nnbridge.explain(model).opaque["inner"]
        bridged = [model(x) for _ in range(3)]
        after_bridged = _written_state()
        globals().update(_written())
        eager = [reference(x) for _ in range(3)]
        assert all(map(torch.equal, bridged, eager))
        assert after_bridged == _written_state()
    finally:
        nnbridge.unbridge(model)
        globals().update(_written())


def test_a_dict_subclass_with_the_dicts_lookup_is_data_and_one_with_its_own_is_a_registry():
    from nnbridge.guards.code_objects import data_container

    assert data_container(Store()) and data_container(collections.OrderedDict())
    assert data_container(collections.deque()) and data_container(bytearray())
    assert not data_container(Registry()) and not data_container("text") and not data_container(range(3))
