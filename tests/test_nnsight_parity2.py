"""nnsight 0.8.1 parity, second batch: envoy classes by default, ``.source`` next to op envoys,
loading from a directory, the printed tree, old spellings and errors, memory after ``del``."""

import gc
import weakref
from collections import OrderedDict

import nnsight
import pytest
import torch

import nnbridge
from nnbridge.bridge.op_point import OpPoint, OpPointContainer
from nnbridge.envoys import BridgeEnvoy


def nested_net():
    """Two levels of Sequential around two Linears and a ReLU (5 -> 10 -> 2), seeded."""
    torch.manual_seed(0)
    inner = torch.nn.Sequential(OrderedDict([("act", torch.nn.ReLU()), ("layer2", torch.nn.Linear(10, 2))]))
    return torch.nn.Sequential(OrderedDict([("layer1", torch.nn.Linear(5, 10)), ("inner", inner)]))


# -- 1. envoy classes without envoys= (nnsight tests/test_envoys.py, TestEnvoysParam) ------------
def test_default_module_envoys_are_nnsights_envoy_before_and_after_a_trace():
    model = nnbridge.NNsight(nested_net())
    for envoy in model.modules():
        if envoy is not model:
            assert type(envoy) is nnsight.Envoy, envoy.path
    x = torch.randn(3, 5)
    with model.trace(x):
        relu = model.inner.act.relu.output.save()  # an op envoy
        out = model.output.save()
    reference = nested_net()
    assert torch.equal(out, reference(x))
    assert torch.equal(relu, torch.relu(reference.layer1(x)))
    for envoy in model.modules():
        if envoy is model:
            continue
        is_op = isinstance(envoy._module, (OpPoint, OpPointContainer))
        assert type(envoy) is (BridgeEnvoy if is_op else nnsight.Envoy), envoy.path
    assert model.inner.act.relu.node_path == "inner.act.relu"


def test_envoys_bridge_envoy_gives_op_aware_errors_on_modules():
    model = nnbridge.NNsight(nested_net(), envoys=BridgeEnvoy)
    model.extract(torch.randn(3, 5))
    assert type(model.inner.act) is BridgeEnvoy
    with pytest.raises(AttributeError, match="model.inner.act \\(ReLU\\) has no attribute or op 'rleu'; closest"):
        model.inner.act.rleu
    default = nnbridge.NNsight(nested_net())
    default.extract(torch.randn(3, 5))
    with pytest.raises(AttributeError, match="has attribute 'rleu'"):  # nnsight's own message
        default.inner.act.rleu
