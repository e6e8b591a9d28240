"""``tracer.cache()`` is nnsight's (issue 48, item 4): with no arguments it records every module's
output under nnsight's keys, in nnsight's order, with equal values, and no op; ops are recorded
when asked (``ops=True``, or op envoys and op paths named in ``modules=``)."""

import copy

import nnsight
import pytest
import torch
from torch import nn

import nnbridge
from nnbridge.inplace.bridging import bridge_of
from nnbridge.errors import NNBridgeError
from nnbridge.compat.nnsight.remote import typing_kept
from utils import assert_same, wrap


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        return self.norm(torch.relu(self.lin(x)) + x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h).softmax(-1)


def _model():
    torch.manual_seed(0)
    return Model()


X = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))


def _entries(cache):
    return list(cache._cache.entries.items())


def _assert_same_entries(actual, expected):
    assert [path for path, _ in actual] == [path for path, _ in expected]
    for (path, got), (_, want) in zip(actual, expected):
        assert len(got) == len(want), path
        for a, b in zip(got, want):
            assert torch.equal(a.output, b.output), path


def _extractions(wrapper):
    state = bridge_of(wrapper._module)
    return 0 if state is None else sum(len(d.all_extractions()) for d in state.dispatchers.values())


@pytest.mark.parametrize("extracted_before", [False, True], ids=["fresh", "extracted"])
def test_default_cache_equals_nnsights(extracted_before):
    """Keys, order and values of nnsight's own cache of a copy of the model, whether or not the
    model has op envoys already (an earlier op read extracted it)."""
    module = _model()
    reference = nnsight.NNsight(copy.deepcopy(module))
    with reference.trace(X) as tracer:
        expected = tracer.cache()
    model = nnbridge.NNsight(module)
    if extracted_before:
        with model.trace(X):
            model.blocks[0].lin.linear.output.save()
        assert _extractions(model) >= 1
    with model.trace(X) as tracer:
        actual = tracer.cache()
    _assert_same_entries(_entries(actual), _entries(expected))
    assert not any("linear" in path.rsplit(".", 1)[-1] for path, _ in _entries(actual))
    if not extracted_before:
        assert _extractions(model) == 0  # a module-only trace: the model's own code, as nnsight
    # the default cache's keys by path and by navigation, as nnsight's
    assert torch.equal(actual["model.blocks.1"].output, expected["model.blocks.1"].output)
    assert torch.equal(actual.model.blocks[1].norm.output, expected.model.blocks[1].norm.output)


def test_default_cache_with_inputs_equals_nnsights():
    module = _model()
    reference = nnsight.NNsight(copy.deepcopy(module))
    with reference.trace(X) as tracer:
        expected = tracer.cache(include_inputs=True, include_output=False)
    model = nnbridge.NNsight(module)
    with model.trace(X) as tracer:
        actual = tracer.cache(include_inputs=True, include_output=False)
        model.blocks[0].lin.linear.output.save()  # an op read: the graphs run
    assert [path for path, _ in _entries(actual)] == [path for path, _ in _entries(expected)]
    for (path, got), (_, want) in zip(_entries(actual), _entries(expected)):
        assert torch.equal(got[0].inputs[0][0], want[0].inputs[0][0]), path


def test_ops_true_adds_every_op():
    module = _model()
    reference = nnsight.NNsight(copy.deepcopy(module))
    with reference.trace(X) as tracer:
        expected = tracer.cache()
    model = nnbridge.NNsight(module)
    with model.trace(X) as tracer:
        actual = tracer.cache(ops=True)
    paths = [path for path, _ in _entries(actual)]
    module_paths = [path for path, _ in _entries(expected)]
    assert [path for path in paths if path in module_paths] == module_paths
    ops = [path for path in paths if path not in module_paths]
    assert "model.blocks.0.lin.linear" in ops and "model.blocks.1.relu" in ops
    for path, entries in _entries(actual):
        if path in module_paths:
            assert torch.equal(entries[0].output, expected[path].output)
    lin = module.blocks[0].lin
    assert torch.equal(actual["model.blocks.0.lin.linear"].output,
                       torch.nn.functional.linear(actual["model.inp"].output, lin.weight, lin.bias).detach())


def test_ops_true_with_modules_adds_the_ops_below_them():
    model = nnbridge.NNsight(_model())
    with model.trace(X) as tracer:
        cache = tracer.cache(modules=[model.blocks[1]], ops=True)
    paths = [path for path, _ in _entries(cache)]
    assert "model.blocks.1" in paths and "model.blocks.1.relu" in paths and "model.blocks.1.lin.linear" in paths
    assert all(path.startswith("model.blocks.1") for path in paths)


def test_an_op_named_in_modules_is_cached():
    module = _model()
    model = nnbridge.NNsight(module)
    with model.trace(X) as tracer:
        cache = tracer.cache(modules=[model.blocks[0].relu, "model.blocks.1.lin.linear", model.out])
    assert [path for path, _ in _entries(cache)] == ["model.blocks.0.relu", "model.blocks.1.lin.linear", "model.out"]
    with torch.no_grad():
        h = module.blocks[0](module.inp(X))
        expected = torch.relu(module.blocks[0].lin(module.inp(X)))
        assert torch.equal(cache["model.blocks.0.relu"].output, expected)
        assert torch.equal(cache["model.blocks.1.lin.linear"].output, module.blocks[1].lin(h))


def test_language_model_default_cache_equals_nnsights():
    """A TransformersModel (GPT-2): the default cache has nnsight's keys, order and values."""
    values = {}
    for library in (nnsight, nnbridge):
        model = wrap(library, "gpt2")
        with torch.no_grad(), model.trace("Hello world") as tracer:
            values[library] = tracer.cache()
    actual, expected = _entries(values[nnbridge]), _entries(values[nnsight])
    assert [path for path, _ in actual] == [path for path, _ in expected]
    for (path, got), (_, want) in zip(actual, expected):
        assert_same(got[0].output, want[0].output)


def test_a_remote_default_cache_equals_nnsights_and_ops_are_refused():
    """``remote="local"`` (nnsight's simulation of a server, which runs nnsight): the trace context
    travels as nnsight's, so the default cache equals nnsight's; ``ops=True`` is refused before
    anything is sent (a server has no op envoys).

    The trace's block names no library module: what it names is sent, and ``nnbridge`` sent would
    be imported anew while the simulation hides the loaded one (a second nnbridge whose import
    installs its own envoy hint process-wide, over op points of its own classes)."""
    values = {}
    for library in (nnsight, nnbridge):
        model = wrap(library, "gpt2")
        with typing_kept(), torch.no_grad(), model.trace("Hello world", remote="local") as tracer:
            cache = tracer.cache()  # (typing_kept: plain nnsight's "local" may replace typing's functions)
        values[library] = cache
    assert list(values[nnbridge].keys()) == list(values[nnsight].keys())
    assert torch.equal(values[nnbridge]["model.lm_head"].output, values[nnsight]["model.lm_head"].output)
    with pytest.raises(NNBridgeError, match="remote trace may read op envoys"):
        with torch.no_grad(), model.trace("Hello world", remote="local") as tracer:
            tracer.cache(ops=True)
