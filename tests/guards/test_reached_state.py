"""State a module reaches through its attributes (see :mod:`nnbridge.guards.reached_state`): a list
inside a list, dict, tuple or namespace a forward appends to, a set inside a dict, a ``deque``
inside a list, tensors and random generator objects held inside containers.

Before, extraction's runs left their writes there (``self.log[0]`` held three entries after
``bridge()``, a ``deque`` kept a symbolic float of the export), and the graph never wrote it again,
silently; a random generator object inside a list was not put back, so the repeat check refused
the model. Every test compares with an untouched copy run eagerly (``torch.equal``)."""

from __future__ import annotations

import collections
import functools
import copy
import random
import types

import numpy as np
import pytest
import torch
from torch import nn

import nnbridge
from nnbridge import PatchableGraph
from nnbridge.guards import plain_values, reached_state
from nnbridge.guards.preservation import ModuleState, snapshot
from nnbridge.guards.reached_state import reached
from utils import Outer


class Holder:
    """A plain object a module holds."""

    def __init__(self):
        self.items = []


class Logs(nn.Module):
    """Appends to (or adds into) a container nested inside its attribute ``state``."""

    def __init__(self, kind: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kind = kind
        self.state = {
            "nested list": [[]],
            "dict of list": {"a": []},
            "list in tuple": ([], 3),
            "set in dict": {"seen": set()},
            "deque in list": [collections.deque(maxlen=2)],
            "namespace list": types.SimpleNamespace(items=[]),
            "object list": Holder(),
            "tensors in nested list": [[]],
            "list in mapping proxy": types.MappingProxyType({"a": []}),
        }[kind]

    def _log(self) -> collections.abc.Collection:
        state = self.state
        return {"nested list": lambda: state[0], "dict of list": lambda: state["a"], "list in tuple": lambda: state[0],
                "set in dict": lambda: state["seen"], "deque in list": lambda: state[0],
                "namespace list": lambda: state.items, "object list": lambda: state.items,
                "tensors in nested list": lambda: state[0], "list in mapping proxy": lambda: state["a"]}[self.kind]()

    def forward(self, x):
        h = self.lin(x)
        log = self._log()
        if isinstance(log, set):
            log.add(len(log))
        elif self.kind == "tensors in nested list":
            log.append(h.detach())
        else:
            log.append(h.sum().item())
        return h * (len(log) + 1)


KINDS = ["nested list", "dict of list", "list in tuple", "set in dict", "deque in list", "namespace list",
         "object list", "tensors in nested list", "list in mapping proxy"]


def _written(module: Logs) -> list:
    return list(module._log())


@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_write_into_a_nested_container_leaves_no_trace_of_extraction_and_runs_eagerly(kind, front):
    torch.manual_seed(0)
    model = Outer(Logs(kind))
    torch.manual_seed(0)  # (a mapping proxy cannot be deep-copied)
    reference = Outer(Logs(kind))
    x = torch.randn(2, 4)
    run = nnbridge.bridge(model, x) if front == "bridge" else PatchableGraph(model, x)
    try:
        assert _written(model.inner) == [], "extraction's runs left their writes"
        for _ in range(3):
            assert torch.equal(run(x) if front == "patchable_graph" else model(x), reference(x))
        mine, theirs = _written(model.inner), _written(reference.inner)
        assert len(mine) == len(theirs) == (3 if kind != "deque in list" else 2)
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(mine, theirs))
    finally:
        if front == "bridge":
            explained = str(nnbridge.explain(model))
            nnbridge.unbridge(model)
    if front == "bridge":
        assert "inner (Logs): opaque" in explained
        # (an attribute of a held object the code reads is watched as a read value first)
        assert ("writes inner.state.items" if kind == "object list" else "inside its attribute 'state'") in explained


class Accumulates(nn.Module):
    """Adds its output into a tensor two containers deep, in place, and adds that tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.acc = {"sums": [torch.zeros(4)]}

    def forward(self, x):
        h = self.lin(x)
        self.acc["sums"][0].add_(h.detach().sum(0))
        return h + self.acc["sums"][0]


def test_an_in_place_write_to_a_tensor_two_containers_deep_runs_eagerly_and_is_put_back():
    torch.manual_seed(0)
    model = Outer(Accumulates())
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        assert torch.equal(model.inner.acc["sums"][0], torch.zeros(4)), "extraction's runs left their sums"
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
        assert torch.equal(model.inner.acc["sums"][0], reference.inner.acc["sums"][0])
        assert "inner" in nnbridge.explain(model).opaque
    finally:
        nnbridge.unbridge(model)


class Draws(nn.Module):
    """Scales by a number drawn from a random generator object held inside a container."""

    def __init__(self, kind: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kind = kind
        self.rngs = {"torch in list": [torch.Generator().manual_seed(0)], "random in dict": {"a": random.Random(0)},
                     "numpy in tuple": (np.random.default_rng(0),)}[kind]

    def forward(self, x):
        h = self.lin(x)
        if self.kind == "torch in list":
            return h * torch.rand(4, generator=self.rngs[0])
        if self.kind == "random in dict":
            return h * self.rngs["a"].random()
        return h * float(self.rngs[0].normal())


def _state(rngs) -> object:
    rng = rngs[0] if isinstance(rngs, (list, tuple)) else rngs["a"]
    if isinstance(rng, torch.Generator):
        return rng.get_state().tolist()
    return rng.getstate() if isinstance(rng, random.Random) else rng.bit_generator.state


@pytest.mark.parametrize("kind", ["torch in list", "random in dict", "numpy in tuple"])
def test_a_random_generator_inside_a_container_is_put_back_and_its_draws_equal_eager(kind):
    torch.manual_seed(0)
    model = Outer(Draws(kind))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        assert _state(model.inner.rngs) == _state(reference.inner.rngs), "extraction's runs drew from it"
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
        assert "inner" in nnbridge.explain(model).opaque
    finally:
        nnbridge.unbridge(model)


#: a module global holding a list inside a list, written by :class:`GlobalLog`
LOG: list[list[int]] = [[]]


class GlobalLog(nn.Module):
    """Appends to a list inside a module global (``where == "global"``), inside a class attribute
    (read through ``type(self)``), to a class attribute read through ``self`` or named by its class."""

    history: list[list[int]] = [[]]
    flat: list[int] = []

    def __init__(self, where: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.where = where

    def forward(self, x):
        log = {"global": lambda: LOG[0], "inside a class attribute": lambda: type(self).history[0],
               "class attribute through self": lambda: self.flat, "named class attribute": lambda: GlobalLog.flat,
               }[self.where]()
        log.append(1)
        return self.lin(x) * len(log)


@pytest.mark.parametrize("where", ["global", "inside a class attribute", "class attribute through self",
                                   "named class attribute"])
def test_a_list_in_a_module_global_or_class_attribute_is_put_back_after_extraction_and_runs_eagerly(where):
    log = {"global": LOG[0], "inside a class attribute": GlobalLog.history[0]}.get(where, GlobalLog.flat)
    log.clear()
    torch.manual_seed(0)
    model = Outer(GlobalLog(where))
    x = torch.randn(2, 4)
    expected = [model(x) for _ in range(2)]
    log.clear()
    nnbridge.bridge(model, x)
    try:
        assert log == [], "extraction's runs left their appends"
        assert all(torch.equal(model(x), e) for e in expected)
        assert log == [1, 1]
        assert "inner" in nnbridge.explain(model).opaque
    finally:
        nnbridge.unbridge(model)
        log.clear()


def test_reached_walks_containers_objects_and_tensors_at_any_depth_but_not_modules():
    tensor, generator, child = torch.zeros(2), torch.Generator(), nn.Linear(2, 2)
    inner = {"t": tensor, "g": [generator], "m": child}
    holder = Holder()
    holder.items.append(torch.ones(1))
    found = {r.where: r.value for r in reached([("a", ([inner],)), ("h", holder), ("lin", child)], set())}
    assert found["a[0]"] == [inner] and found["a[0][0]"] is inner
    assert found["a[0][0]['t']"] is tensor and found["a[0][0]['g'][0]"] is generator
    assert found["h.__dict__"] is vars(holder) and found["h.items"] is holder.items
    assert found["h.items[0]"] is holder.items[0]
    assert not any(value is child for value in found.values())
    assert "a" not in found, "an attribute's own value is the snapshot's, not the walk's"


def test_reached_skips_what_is_seen_and_adds_what_it_reaches():
    shared = [[1]]
    seen: set[int] = set()
    first = reached([("x", shared)], seen)
    assert [r.where for r in first] == ["x[0]"] and id(shared[0]) in seen
    assert reached([("y", shared)], seen) == []


def test_reached_stops_at_the_limit(monkeypatch):
    monkeypatch.setattr(reached_state, "LIMIT", 5)
    deep: list = []
    for _ in range(20):
        deep = [deep]
    assert len(reached([("x", deep)], set())) == 5


def test_reached_takes_no_more_items_of_a_long_container_than_its_limit(monkeypatch):
    monkeypatch.setattr(reached_state, "LIMIT", 5)
    taken = []

    class Counted(collections.abc.Sequence):
        def __len__(self):
            return 1_000_000

        def __getitem__(self, index):
            if index >= len(self):
                raise IndexError(index)
            taken.append(index)
            return [index]

    found = reached([("x", (Counted(),))], set())
    assert [r.where for r in found] == [f"x[0][{i}]" for i in range(4)] and len(taken) <= 5


def test_a_shared_config_is_in_the_snapshot_of_the_first_module_only():
    config = types.SimpleNamespace(scales={"a": [1.0]})
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    first.config = second.config = config
    states = snapshot([("first", first), ("second", second)], clone=False)
    assert [where for _, where in states["first"].nested] == ["config.scales", "config.scales['a']"]
    assert states["second"].nested == {}
    config.scales["a"].append(2.0)
    assert states["first"].changes() == ["mutates 'config.scales['a']' inside its attribute 'config' (list)"]
    states["first"].restore()
    assert config.scales == {"a": [1.0]}
    alone = ModuleState(second, clone=False)
    config.scales["b"] = []
    assert alone.changes() == ["mutates 'config.scales' inside its attribute 'config' (dict)"]


class Tallies(nn.Module):
    """Counts each output's argmax in a numpy array (``where``: an attribute, or inside a dict),
    and scales by a numpy counter when ``reads``; logs into a ``bytearray`` inside a list."""

    def __init__(self, where: str, reads: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.reads = reads
        self.tallies = np.zeros(4) if where == "attribute" else {"argmax": np.zeros(4)}
        self.steps = np.zeros(1)
        self.raw = [bytearray(2)]

    def forward(self, x):
        h = self.lin(x)
        tallies = self.tallies if isinstance(self.tallies, np.ndarray) else self.tallies["argmax"]
        tallies += np.bincount(h.argmax(-1).numpy(), minlength=4)
        self.raw[0][0] += 1
        if self.reads:
            self.steps += 1
            return h * float(self.steps[0])
        return h


@pytest.mark.parametrize("where", ["attribute", "inside a dict"])
@pytest.mark.parametrize("reads", [False, True])
def test_a_numpy_array_written_in_place_is_put_back_after_extraction_and_runs_eagerly(where, reads):
    torch.manual_seed(0)
    model = Outer(Tallies(where, reads))
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)

    def tallies(net):
        found = net.inner.tallies
        return (found if isinstance(found, np.ndarray) else found["argmax"]).tolist()
    nnbridge.bridge(model, x)
    try:
        assert tallies(model) == [0.0] * 4 and model.inner.steps.tolist() == [0.0], "extraction's runs wrote"
        assert model.inner.raw == [bytearray(2)]
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
        assert tallies(model) == tallies(reference) and sum(tallies(model)) == 9
        assert model.inner.raw == reference.inner.raw == [bytearray(b"\x03\x00")]
        assert model.inner.steps.tolist() == reference.inner.steps.tolist()
        assert "inner" in nnbridge.explain(model).opaque
    finally:
        nnbridge.unbridge(model)


def test_writable_array_takes_writable_contiguous_buffers_within_the_limit_only(monkeypatch):
    array = np.arange(4.0)
    assert bytes(plain_values.writable_array(array)) == array.tobytes()
    frozen = np.arange(4.0)
    frozen.flags.writeable = False
    for other in (frozen, np.arange(8.0)[::2], np.array([1, None], dtype=object), torch.zeros(2), b"ab",
                  bytearray(2), [1.0], 3.0):
        assert plain_values.writable_array(other) is None
    monkeypatch.setattr(plain_values, "ARRAY_LIMIT", 8)
    assert plain_values.writable_array(np.zeros(2)) is None and plain_values.writable_array(np.zeros(1)) is not None


def test_a_snapshot_names_an_array_written_in_place_and_puts_its_bytes_back():
    module = nn.Linear(2, 2)
    module.counts, module.inside = np.zeros(2), {"n": np.zeros(1)}
    state = ModuleState(module, clone=False)
    module.counts += 1
    module.inside["n"][0] = 5
    assert state.changes() == ["writes its array attribute 'counts' in place (ndarray)",
                               "writes the array 'inside['n']' inside its attribute 'inside' in place (ndarray)"]
    state.restore()
    assert module.counts.tolist() == [0.0, 0.0] and module.inside["n"].tolist() == [0.0]


#: a module global array :class:`ScaledByArrays` reads
SCALES = np.array([2.0])


class ScaledByArrays(nn.Module):
    """Scales by an element of a module global numpy array and of one it holds as an attribute."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.own = np.array([3.0])

    def forward(self, x):
        return self.lin(x) * float(SCALES[0]) * float(self.own[0])


@pytest.mark.parametrize("written", ["global", "attribute"])
def test_an_array_a_graph_read_written_in_place_afterwards_re_extracts(written):
    SCALES[0] = 2.0
    torch.manual_seed(0)
    model = Outer(ScaledByArrays())
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    try:
        assert torch.equal(model(x), reference(x))
        assert "inner" not in nnbridge.explain(model).opaque
        for net in (model, reference):
            if written == "global":
                SCALES[0] = 5.0
            else:
                net.inner.own[0] = 7.0
        assert torch.equal(model(x), reference(x)), "the graph kept the array's old value"
        assert f"{'SCALES' if written == 'global' else 'own'} was written in place" in str(nnbridge.explain(model))
    finally:
        nnbridge.unbridge(model)
        SCALES[0] = 2.0


def test_an_array_is_part_of_the_code_digest_by_its_bytes():
    from nnbridge.guards.code_digest import code_digest
    model = Outer(ScaledByArrays())
    before = code_digest(model)
    model.inner.own[0] = 4.0
    held = code_digest(model)
    SCALES[0] = 6.0
    try:
        assert len({before, held, code_digest(model)}) == 3
    finally:
        SCALES[0] = 2.0


class BoundLogs(nn.Module):
    """Appends through a ``functools.partial`` binding a list, or a list's bound ``append``."""

    def __init__(self, how: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log: list[int] = []
        self.add = functools.partial(list.append, self.log) if how == "partial" else self.log.append

    def forward(self, x):
        self.add(1)
        return self.lin(x)


@pytest.mark.parametrize("how", ["partial", "bound method"])
def test_a_list_reached_through_a_partial_or_a_bound_method_is_put_back_and_its_writer_runs_eagerly(how):
    model = Outer(BoundLogs(how))
    x = torch.randn(2, 4)
    del model.inner.__dict__["log"]  # reachable only through ``add``
    log = model.inner.add.args[0] if how == "partial" else model.inner.add.__self__
    nnbridge.bridge(model, x)
    try:
        assert log == [], "extraction's runs left their appends"
        model(x)
        assert log == [1]
        assert "inner" in nnbridge.explain(model).opaque
    finally:
        nnbridge.unbridge(model)


#: a module global array :class:`TalliesGlobally` writes in place
TALLIES = np.zeros(4)


class TalliesGlobally(nn.Module):
    """Counts each output's argmax in module global numpy arrays."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        counts = np.bincount(h.argmax(-1).numpy(), minlength=4)
        TALLIES[:] += counts
        return h


def test_a_module_global_array_written_in_place_is_put_back_after_extraction():
    TALLIES[:] = 0
    torch.manual_seed(0)
    model = Outer(TalliesGlobally())
    x = torch.randn(3, 4)
    nnbridge.bridge(model, x)
    try:
        assert TALLIES.tolist() == [0.0] * 4, "extraction's runs wrote"
        model(x)
        assert TALLIES.sum() == 3
        assert "inner" in nnbridge.explain(model).opaque
    finally:
        nnbridge.unbridge(model)
        TALLIES[:] = 0


class _PrefixedKeys(collections.abc.Mapping):
    """A mapping whose keys do not read back (as accelerate's ``PrefixedDataset`` in a hook)."""

    def __init__(self):
        self.data = {"a.b": [1]}

    def __getitem__(self, key):
        return self.data[f"a.{key}"]

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)


def test_a_mapping_whose_items_cannot_be_listed_is_not_walked_and_accelerates_hook_is_no_held_object():
    found = reached([("weights", _PrefixedKeys()), ("other", [[2]])], set())
    assert [r.where for r in found] == ["other[0]"]
    hook = Holder()
    hook.items.append([3])
    assert reached([("_hf_hook", hook)], set()) == []
    assert [r.where for r in reached([("hook", hook)], set())] == ["hook.__dict__", "hook.items", "hook.items[0]"]
