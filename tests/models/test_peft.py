"""Issue 48: a PEFT LoRA model (peft's ``get_peft_model`` over a tiny random Llama, LoRA on
``q_proj``/``v_proj``, ``lora_dropout=0``, a non-zero adapter) through ``nnbridge.bridge``,
``PatchableGraph`` and ``nnbridge.NNsight``.

Each case compares with an untouched deep copy run eagerly (``torch.equal``): the logits, the
parameters and peft's ``merged`` flags after the calls, and an op-level patch, op-point hook or
nnsight op read inside a LoRA-wrapped layer against a torch hook on the module running that op.
The adapter is active, disabled (``with model.disable_adapter():``) while unmerged, disabled while
merged (peft then unmerges the weights through ``.data`` in forward), or merged and unloaded.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import nnbridge
from nnbridge.patching.patches import RecordPatch, ZeroPatch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

# peft 0.21 asks transformers 5.2x for is_gradient_checkpointing, which warns (not nnbridge's)
pytestmark = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
              pytest.mark.integration]  # end to end: PEFT models through every front end

FRONT_ENDS = ("bridge", "pg", "nnsight")
#: the adapter's states, in the order one script goes through them on one model: an unmerged
#: adapter used, then disabled; a merged adapter disabled (peft unmerges the weights through
#: ``.data`` in forward), then used
SCRIPTS = {"unmerged": ("active", "disabled"), "merged": ("disabled", "active")}
#: the NodePath prefix of layer 0's query projection (PeftModel calls the Llama itself)
Q_PROJ = "base_model_model.model.layers_0.self_attn.q_proj"


def _peft_model(merged: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base = transformers.LlamaForCausalLM(config).eval()
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(base, lora).eval()
    if merged:
        model.merge_adapter()
    return model


def _inputs() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, 64, (2, 8))


def _q_proj(model: torch.nn.Module) -> torch.nn.Module:
    return model.base_model.model.model.layers[0].self_attn.q_proj


def _adapter(state: str) -> Callable[[torch.nn.Module], contextlib.AbstractContextManager[Any]]:
    if state == "active":
        return lambda model: contextlib.nullcontext()
    return lambda model: model.disable_adapter()


def _op(state: str) -> tuple[str, Callable[[torch.nn.Module], torch.nn.Module]]:
    """The op patched or read inside the LoRA-wrapped q_proj, and the module whose output it is:
    the adapter's lora_B linear while the adapter is active, the base layer's when disabled."""
    if state == "active":
        return "lora_B_default", lambda model: _q_proj(model).lora_B["default"]
    return "base_layer", lambda model: _q_proj(model).base_layer


def _same_model_state(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    for (name, value), (_, expected) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(value, expected), name
    flags = [layer.merged for layer in model.modules() if hasattr(layer, "merged_adapters")]
    assert flags == [layer.merged for layer in ref.modules() if hasattr(layer, "merged_adapters")]


@contextlib.contextmanager
def _eager_hook(module: torch.nn.Module, record: list[torch.Tensor] | None = None, zero: bool = False
                ) -> Iterator[None]:
    def hook(mod: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if record is not None:
            record.append(out.detach().clone())
        return torch.zeros_like(out) if zero else None
    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_lora_model_equals_eager_and_its_ops_patch(front_end: str, script: str) -> None:
    model = _peft_model(merged=script == "merged")
    ref = copy.deepcopy(model)
    x = _inputs()
    holder: dict[str, Any] = {}
    for state in SCRIPTS[script]:
        adapter = _adapter(state)
        child, module_of = _op(state)
        with adapter(ref):
            expected = _logits(ref, x)
            seen: list[torch.Tensor] = []
            with _eager_hook(module_of(ref), record=seen, zero=True):
                zeroed = _logits(ref, x)
        assert not torch.equal(zeroed, expected)
        with adapter(model):
            _phase(front_end, model, x, state, holder, expected, zeroed, seen[0])
        _same_model_state(model, ref)


def _phase(front_end: str, model: torch.nn.Module, x: torch.Tensor, state: str, holder: dict[str, Any],
           expected: torch.Tensor, zeroed: torch.Tensor, seen: torch.Tensor) -> None:
    """One state of a script through a front-end (bridged once, on the first): the logits, then the op
    inside q_proj zeroed (patch, op-point hook or nnsight assignment), read where it can be."""
    child = "lora_B_default" if state == "active" else "base_layer"
    if front_end == "bridge":
        if not holder:
            holder["bridged"] = nnbridge.bridge(model, x)
        assert torch.equal(_logits(model, x), expected)
        module = "lora_B.default" if state == "active" else "base_layer"
        point = model.get_submodule(f"base_model.model.model.layers.0.self_attn.q_proj.{module}.linear")
        with _eager_hook(point, zero=True):
            assert torch.equal(_logits(model, x), zeroed)
        assert torch.equal(_logits(model, x), expected)
    elif front_end == "pg":
        with torch.no_grad():  # (pg.graph is its first extraction's: one PatchableGraph per state)
            pg = nnbridge.PatchableGraph(model, x)
            assert torch.equal(pg(x).logits, expected)
            record = RecordPatch()
            with pg.patch({f"{Q_PROJ}.{child}.linear": [record, ZeroPatch()]}):
                assert torch.equal(pg(x).logits, zeroed)
            assert len(record.activations) == 1 and torch.equal(record.activations[0], seen)
            assert torch.equal(pg(x).logits, expected)
    else:
        if not holder:
            holder["nn"] = nnbridge.NNsight(model)
        wrapped = holder["nn"]
        layer = wrapped.base_model.model.model.layers[0].self_attn.q_proj
        op_holder = layer.lora_B.default if state == "active" else layer.base_layer
        attention = wrapped.base_model.model.model.layers[0].self_attn
        with torch.no_grad(), wrapped.trace(x):  # (op envoys exist from the trace on)
            read = op_holder.linear.output.save()
            # an op of a module around the LoRA layer: that module is extracted for this trace
            attention.scaled_dot_product_attention.output.save()
            logits = wrapped.output.logits.save()
        assert torch.equal(logits, expected)
        assert torch.equal(read, seen)
        with torch.no_grad(), wrapped.trace(x):
            op_holder.linear.output = torch.zeros_like(op_holder.linear.output)
            logits = wrapped.output.logits.save()
        assert torch.equal(logits, zeroed)


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_bridged_lora_model_is_graphs_around_its_dropout(front_end: str) -> None:
    """peft's ``lora_dropout`` for ``lora_dropout=0`` (an ``nn.Identity`` in a ``ModuleDict``)
    runs as itself; every other module is a graph, also after ``merge_and_unload()``."""
    model = _peft_model()
    x = _inputs()
    if front_end == "pg":
        explained = nnbridge.explain(nnbridge.PatchableGraph(model, x))
    elif front_end == "nnsight":
        explained = nnbridge.explain(nnbridge.NNsight(model), x)
    else:
        nnbridge.bridge(model, x)
        explained = nnbridge.explain(model)
    assert set(explained.opaque) == {f"base_model_model.model.layers_{i}.self_attn.{p}_proj.lora_dropout_default"
                                     for i in range(2) for p in "qv"}
    unloaded = _peft_model().merge_and_unload()
    ref = copy.deepcopy(unloaded)
    expected = _logits(ref, x)
    if front_end == "pg":
        pg = nnbridge.PatchableGraph(unloaded, x)
        with torch.no_grad():
            assert torch.equal(pg(x).logits, expected)
        assert not nnbridge.explain(pg).opaque
    elif front_end == "nnsight":
        wrapped = nnbridge.NNsight(unloaded)
        with torch.no_grad(), wrapped.trace(x):
            logits = wrapped.output.logits.save()
        assert torch.equal(logits, expected)
    else:
        nnbridge.bridge(unloaded, x)
        assert torch.equal(_logits(unloaded, x), expected)
