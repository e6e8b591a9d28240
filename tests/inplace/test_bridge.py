"""In-place bridging: op points as real submodules, torch hooks on ops, reversibility, mixed patching."""

import pytest
import torch

import nnbridge
from fixtures.data_dependent_module import DataDependentModule
from fixtures.tuple_output_module import TupleOutputModule
from nnbridge import ExtractionError, ExtractionOptions, NNBridgeError, OpPoint, ProbePatch, ZeroPatch
from nnbridge.inplace.bridging import bridge_of
from utils import assert_same, gpt2, llama, padded_batch

MODELS = {"gpt2": gpt2, "llama": llama}


def call(model, ids, mask):
    return model(ids, attention_mask=mask, use_cache=False)


@pytest.fixture(params=list(MODELS))
def bridged(request):
    model = MODELS[request.param]()
    ids, mask = padded_batch(6)
    reference = call(model, ids, mask)
    before = {"names": [n for n, _ in model.named_modules()], "keys": list(model.state_dict()),
              "params": [id(p) for p in model.parameters()]}
    assert nnbridge.bridge(model, ids, attention_mask=mask, use_cache=False) is model
    yield request.param, model, ids, mask, reference, before
    if bridge_of(model) is not None:
        nnbridge.unbridge(model)


def softmax_path(name):
    return "transformer.h.0.attn.softmax" if name == "gpt2" else "model.layers.0.self_attn.softmax"


def test_model_stays_itself(bridged):
    name, model, ids, mask, reference, before = bridged
    assert type(model).__name__ in ("GPT2LMHeadModel", "LlamaForCausalLM") and model.config is not None
    assert list(model.state_dict()) == before["keys"]
    assert [id(p) for p in model.parameters()] == before["params"]
    assert_same(call(model, ids, mask), reference)
    ids2, mask2 = padded_batch(9)
    model_reference = call(model, ids2, mask2)  # other sequence length through the same graphs
    nnbridge.unbridge(model)
    assert_same(call(model, ids2, mask2), model_reference)


def test_every_node_is_a_real_submodule(bridged):
    name, model, ids, mask, reference, _ = bridged
    point = model.get_submodule(softmax_path(name))
    assert isinstance(point, OpPoint) and isinstance(point, torch.nn.Module)
    layer = "transformer.h.0" if name == "gpt2" else "model.layers.0"
    names = dict(model.named_modules())
    assert isinstance(names[f"{layer}.add"], OpPoint)
    assert isinstance(names[f"{layer}.output_"], OpPoint), "a node called output is mangled to output_"
    norm = "transformer.ln_f" if name == "gpt2" else "model.norm"
    assert isinstance(names[f"{norm}.weight_"], OpPoint), "parameter nodes do not shadow the parameter"
    assert isinstance(model.get_submodule(norm).weight, torch.nn.Parameter)


def test_forward_hook_replaces_op_output_and_handle_restores(bridged):
    name, model, ids, mask, reference, _ = bridged
    point = model.get_submodule(softmax_path(name))
    seen = []
    handle = point.register_forward_hook(lambda module, args, output: seen.append(output) or torch.zeros_like(output))
    patched = call(model, ids, mask)
    assert len(seen) == 1 and seen[0].shape == (2, 4, 6, 6)
    with torch.no_grad():
        reference_attn = MODELS[name]()(ids, attention_mask=mask, use_cache=False, output_attentions=True).attentions[0]
    assert torch.equal(seen[0], reference_attn)
    assert not torch.allclose(patched.logits, reference.logits)
    handle.remove()
    assert not any(g._routed for g in point.owners())
    assert_same(call(model, ids, mask), reference)


def test_pre_hooks_with_kwargs_prepend_and_always_call(bridged):
    name, model, ids, mask, reference, _ = bridged
    point = model.get_submodule(softmax_path(name))
    order = []
    h1 = point.register_forward_pre_hook(lambda module, args: order.append("first"))
    h2 = point.register_forward_pre_hook(lambda module, args: order.append("prepended"), prepend=True)
    h3 = point.register_forward_pre_hook(
        lambda module, args, kwargs: (order.append("kwargs") or ((args[0] * 0,), kwargs)), with_kwargs=True)
    h4 = point.register_forward_hook(lambda module, args, output: order.append("always"), always_call=True)
    patched = call(model, ids, mask)
    assert order == ["prepended", "first", "kwargs", "always"]
    assert not torch.allclose(patched.logits, reference.logits)
    for handle in (h1, h2, h3, h4):
        handle.remove()
    assert_same(call(model, ids, mask), reference)


def test_full_backward_hook_on_op(bridged):
    name, model, ids, mask, reference, _ = bridged
    point = model.get_submodule(softmax_path(name))
    grads = []
    handle = point.register_full_backward_hook(lambda module, grad_in, grad_out: grads.append(grad_out[0]))
    probe_grad = {}

    def keep(module, args, output):
        output.register_hook(lambda g: probe_grad.setdefault("g", g))
    h2 = point.register_forward_hook(keep)
    call(model, ids, mask).logits.pow(2).mean().backward()
    handle.remove()
    h2.remove()
    assert len(grads) == 1 and torch.equal(grads[0], probe_grad["g"])


def test_user_hooks_registered_before_bridging_fire_with_same_arguments():
    model = gpt2()
    ids, mask = padded_batch(6)
    seen = []
    model.transformer.h[1].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((args, dict(kwargs))), with_kwargs=True)
    model.transformer.h[1].mlp.register_forward_hook(lambda module, args, output: seen.append(output))
    call(model, ids, mask)
    before = list(seen)
    seen.clear()
    nnbridge.bridge(model, ids, attention_mask=mask, use_cache=False)
    assert seen == [], "extraction does not run the user's hooks"
    call(model, ids, mask)
    assert len(seen) == len(before) == 2
    (args_b, kwargs_b), (args_a, kwargs_a) = before[0], seen[0]
    assert_same(args_a, args_b)
    assert kwargs_a.keys() == kwargs_b.keys()
    assert_same(kwargs_a, kwargs_b)
    assert torch.equal(seen[1], before[1])


def test_module_hook_can_replace_output_after_bridging():
    model = gpt2()
    ids, mask = padded_batch(6)
    nnbridge.bridge(model, ids, attention_mask=mask, use_cache=False)
    handle = model.transformer.h[0].mlp.register_forward_hook(lambda module, args, output: output * 0)
    bridged = call(model, ids, mask).logits
    nnbridge.unbridge(model)
    eager = call(model, ids, mask).logits
    handle.remove()
    assert torch.equal(bridged, eager)


def test_unbridge_restores_modules_and_forwards(bridged):
    name, model, ids, mask, reference, before = bridged
    nnbridge.unbridge(model)
    assert [n for n, _ in model.named_modules()] == before["names"]
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert_same(call(model, ids, mask), reference)
    with pytest.raises(NNBridgeError, match="not bridged"):
        nnbridge.unbridge(model)


def test_bridging_twice_is_refused(bridged):
    _, model, ids, mask, _, _ = bridged
    with pytest.raises(NNBridgeError, match="already bridged"):
        nnbridge.bridge(model, ids)


def test_failed_extraction_leaves_model_untouched():
    import nnsight

    model = DataDependentModule().eval()
    x = torch.randn(2, 3)
    calls = []
    model.branchy.register_forward_hook(lambda *a: calls.append(1))
    nnsight.NNsight(model)  # installs nnsight's controllers on every module
    controllers = {n: m.__dict__["forward"] for n, m in model.named_modules()}
    names = [n for n, _ in model.named_modules()]
    with pytest.raises(ExtractionError):
        nnbridge.bridge(model, x, options=ExtractionOptions(error_on_compilation_failure=True))
    assert bridge_of(model) is None
    assert {n: m.__dict__["forward"] for n, m in model.named_modules()} == controllers
    assert [n for n, _ in model.named_modules()] == names
    model(x)
    assert calls == [1]


def test_opaque_module_children_bridged():
    model = DataDependentModule().eval()
    x = torch.randn(2, 3)
    reference = model(x)
    nnbridge.bridge(model, x)
    assert isinstance(model.get_submodule("branchy.inner.linear"), OpPoint)
    handle = model.get_submodule("branchy.inner.linear").register_forward_hook(lambda m, a, o: o * 0)
    out = model(x)
    handle.remove()
    branch = model.pre(x).sum() > 0  # Branchy: inner(x) * 2 if positive else inner(x) - 1
    assert torch.equal(out, model.post(torch.zeros(2, 3) * 2 if branch else torch.zeros(2, 3) - 1))
    assert torch.equal(model(x), reference)
    nnbridge.unbridge(model)


def test_multiply_invoked_module_points():
    model = TupleOutputModule().eval()
    x = torch.randn(3, 2)
    first, second = model(x)
    nnbridge.bridge(model, x)
    h0 = model.get_submodule("linear.linear").register_forward_hook(lambda m, a, o: o * 0)
    out = model(x)
    assert torch.equal(out[0], torch.zeros(3, 3)) and torch.equal(out[1], second)
    h0.remove()
    h1 = model.get_submodule("linear.invocation_1.linear").register_forward_hook(lambda m, a, o: o * 0)
    out = model(x)
    assert torch.equal(out[0], first) and torch.equal(out[1], torch.zeros(3, 3))
    h1.remove()


def test_mixed_patching_order(bridged):
    """Module hooks, op hooks and PatchableGraph patches in one forward; each sees the value the
    previous one left: pre-hook -> graph patches -> forward hook."""
    name, model, ids, mask, reference, _ = bridged
    path = softmax_path(name)
    node_path = "transformer.h_0.attn.softmax" if name == "gpt2" else "model.layers_0.self_attn.softmax"
    pg = nnbridge.PatchableGraph(model, ids, attention_mask=mask, use_cache=False)
    log = {}
    point = model.get_submodule(path)
    h1 = point.register_forward_pre_hook(lambda m, args: (log.setdefault("pre", args[0].clone()), (args[0] + 1,))[1])
    h2 = point.register_forward_hook(lambda m, args, out: (log.setdefault("hook_in", out.clone()), out * 2)[1])
    module = model.get_submodule(path.rpartition(".")[0])
    h3 = module.register_forward_hook(lambda m, args, out: log.setdefault("module_out", out))
    probe = ProbePatch()
    with pg.patch({node_path: [probe, nnbridge.AddPatch(value=10.0)]}):
        pg(ids, attention_mask=mask, use_cache=False)
    for h in (h1, h2, h3):
        h.remove()
    assert torch.equal(probe.activation, log["pre"] + 1), "patches see the pre-hook's value"
    assert torch.equal(log["hook_in"], log["pre"] + 1 + 10.0), "forward hooks see the patched value"
    assert "module_out" in log
    assert_same(pg(ids, attention_mask=mask, use_cache=False), reference)


def test_trace_dict_by_name(bridged):
    """A baukit-style TraceDict: plain register_forward_hook by module name, retain and edit."""
    name, model, ids, mask, reference, _ = bridged
    layers = ["transformer.h.0.attn.softmax", "transformer.h.1.add"] if name == "gpt2" else \
        ["model.layers.0.self_attn.softmax", "model.layers.1.add"]
    retained, handles = {}, []
    for layer in layers:
        def hook(module, args, output, layer=layer):
            retained[layer] = output.detach().clone()
            return output * 0.5 if layer.endswith("softmax") else output
        handles.append(model.get_submodule(layer).register_forward_hook(hook))
    edited = call(model, ids, mask)
    for handle in handles:
        handle.remove()
    assert set(retained) == set(layers)
    assert not torch.allclose(edited.logits, reference.logits)
    with torch.no_grad():
        eager = MODELS[name]()(ids, attention_mask=mask, use_cache=False, output_attentions=True)
    assert torch.equal(retained[layers[0]], eager.attentions[0])


@pytest.mark.integration  # end to end: torch.compile
def test_torch_compile(bridged):
    name, model, ids, mask, reference, _ = bridged
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    assert torch.equal(compiled(ids, attention_mask=mask, use_cache=False).logits, reference.logits)
    handle = model.get_submodule(softmax_path(name)).register_forward_hook(lambda m, a, o: o * 0)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    hooked = compiled(ids, attention_mask=mask, use_cache=False).logits
    handle.remove()
    eager_hooked_handle = model.get_submodule(softmax_path(name)).register_forward_hook(lambda m, a, o: o * 0)
    expected = call(model, ids, mask).logits
    eager_hooked_handle.remove()
    assert torch.equal(hooked, expected) and not torch.equal(hooked, reference.logits)


def test_accelerate_cpu_and_disk_offload(tmp_path):
    from transformers import AutoModelForCausalLM

    gpt2().save_pretrained(tmp_path / "model")
    device_map = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.drop": "cpu",
                  "transformer.h.0": "cpu", "transformer.h.1": "disk", "transformer.ln_f": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                 offload_folder=tmp_path / "offload").eval()
    assert model.transformer.h[1].attn.c_attn.weight.device.type == "meta"
    ids, mask = padded_batch(6)
    reference = call(model, ids, mask)
    nnbridge.bridge(model, ids, attention_mask=mask, use_cache=False)
    assert model.transformer.h[1].attn.c_attn.weight.device.type == "meta", "weights offloaded again"
    assert_same(call(model, ids, mask), reference)
    probe = []
    handle = model.get_submodule("transformer.h.1.attn.c_attn.addmm").register_forward_hook(
        lambda m, a, o: probe.append(o))
    call(model, ids, mask)
    handle.remove()
    assert probe and probe[0].device.type == "cpu"
    nnbridge.unbridge(model)
    assert "_hf_hook" in model.transformer.h[1].__dict__
    assert_same(call(model, ids, mask), reference)


def test_global_module_hooks_are_cleared_for_extraction_and_restored():
    from torch.nn.modules.module import register_module_forward_hook

    model = gpt2()
    ids, mask = padded_batch(6)
    calls = []
    handle = register_module_forward_hook(lambda m, a, o: calls.append(type(m).__name__))
    try:
        nnbridge.bridge(model, ids, attention_mask=mask, use_cache=False)
        assert calls == []
        call(model, ids, mask)
        assert "GPT2Attention" in calls and "GPT2LMHeadModel" in calls
    finally:
        handle.remove()
        nnbridge.unbridge(model)


def test_nnsight_source_rewritten_forward_is_restored():
    import nnsight

    model = gpt2()
    ids, mask = padded_batch(6)
    reference = call(model, ids, mask)
    wrapped = nnsight.NNsight(model)
    _ = wrapped.transformer.h[0].attn.source  # rewrites the attention forward (nnsight 0.8)
    state = model.transformer.h[0].attn.__dict__["__nnsight__"]
    body_before = state.body
    nnbridge.bridge(model, ids, attention_mask=mask, use_cache=False)
    assert state.body is not body_before
    assert_same(call(model, ids, mask), reference)
    nnbridge.unbridge(model)
    assert state.body is body_before
    assert_same(call(model, ids, mask), reference)
