"""Export's tracepoint nodes (removed by torch's own pass before the program is returned) get no
stack trace and no ``tensor_meta`` while nnbridge exports (``nnbridge.compat.torch.tracepoints``); every
other node keeps both, and torch's functions are restored afterwards."""

import operator

import pytest
import torch
from torch.fx import Graph
from torch.fx.experimental import proxy_tensor
from torch.fx.proxy import TracerBase

import nnbridge
from nnbridge.compat.torch.tracepoints import tracepoint_bookkeeping_skipped
from utils import assert_same, cached, llama


def tracer_with_nodes():
    """A proxy tracer recording stack traces, and a graph holding a tracepoint, a getitem of it and a plain op."""
    tracer = proxy_tensor.PythonKeyTracer()
    tracer.graph = Graph()
    tracer.record_stack_traces = True
    x = tracer.create_node("placeholder", "x", (), {})
    return tracer, x


def forward(tracer, x):
    """Named ``forward``: torch records a node's stack trace from the first frame of that name on."""
    tracepoint = tracer.create_node("call_function", torch.ops.higher_order._export_tracepoint, (x,),
                                    {"kind": "module_call_inputs", "path": "layer"})
    item = tracer.create_node("call_function", operator.getitem, (tracepoint, 0), {})
    plain = tracer.create_node("call_function", torch.ops.aten.relu.default, (item,), {})
    return {"tracepoint": tracepoint, "getitem": item, "plain": plain}


def test_tracepoint_nodes_skip_stack_traces_and_tensor_meta_and_other_nodes_keep_them():
    value = torch.randn(2, 3)
    tracer, x = tracer_with_nodes()
    with tracepoint_bookkeeping_skipped():
        nodes = forward(tracer, x)
        for node in nodes.values():
            proxy_tensor.set_meta(torch.fx.Proxy(node, tracer), value)
        assert tracer.record_stack_traces, "the tracer's own setting is back after each tracepoint node"
    for kind in ("tracepoint", "getitem"):
        assert nodes[kind].stack_trace is None and "tensor_meta" not in nodes[kind].meta, kind
        recorded = nodes[kind].meta["val"]  # its example value is still recorded (a fake copy)
        assert isinstance(recorded, torch.Tensor) and recorded.shape == value.shape, kind
    assert nodes["plain"].stack_trace and "tensor_meta" in nodes["plain"].meta
    # without the shim, torch records both on every node
    tracer, x = tracer_with_nodes()
    nodes = forward(tracer, x)
    proxy_tensor.set_meta(torch.fx.Proxy(nodes["getitem"], tracer), value)
    assert nodes["getitem"].stack_trace and "tensor_meta" in nodes["getitem"].meta


def test_tracepoint_nodes_record_the_fake_tensors_that_passed_through_and_other_nodes_a_copy():
    """A tracepoint returns its inputs themselves: its nodes record those fake tensors (a tuple of
    them for the tracepoint, one for its ``getitem``), other values as torch does; a plain node
    still records a detached copy."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode().from_tensor(torch.randn(2, 3))
    tracer, x = tracer_with_nodes()
    with tracepoint_bookkeeping_skipped():
        nodes = forward(tracer, x)
        proxy_tensor.set_meta(torch.fx.Proxy(nodes["tracepoint"], tracer), (fake, 4, None))
        proxy_tensor.set_meta(torch.fx.Proxy(nodes["getitem"], tracer), fake)
        proxy_tensor.set_meta(torch.fx.Proxy(nodes["plain"], tracer), fake)
    recorded = nodes["tracepoint"].meta["val"]
    assert type(recorded) is tuple and recorded[0] is fake and recorded[1:] == (4, None)
    assert nodes["getitem"].meta["val"] is fake
    plain = nodes["plain"].meta["val"]
    assert plain is not fake and plain.shape == fake.shape and plain.dtype == fake.dtype


def test_torch_functions_are_restored_also_on_error():
    set_meta, create_node = proxy_tensor.set_meta, TracerBase.create_node
    with pytest.raises(RuntimeError, match="inside"):
        with tracepoint_bookkeeping_skipped():
            assert proxy_tensor.set_meta is not set_meta
            raise RuntimeError("inside")
    assert proxy_tensor.set_meta is set_meta and TracerBase.create_node is create_node


def test_a_bridged_decode_step_with_a_filled_cache_equals_eager():
    """Many cache tensors cross every layer's and attention's tracepoints: the graphs are exact."""
    from transformers import DynamicCache
    eager, model = llama(), llama()
    prompt, token = torch.randint(1, 100, (1, 5)), torch.randint(1, 100, (1, 1))
    nnbridge.bridge(model, prompt)
    caches = []
    outputs = []
    for m in (eager, model):
        cache = DynamicCache(config=m.config)
        m(prompt, past_key_values=cache, use_cache=True)
        outputs.append(m(token, past_key_values=cache, use_cache=True).logits)
        caches.append(cached(cache))
    assert_same(outputs[1], outputs[0])
    assert_same(caches[1], caches[0])
