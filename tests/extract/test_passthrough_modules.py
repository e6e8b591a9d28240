"""Issue 48 item 3c: a module that returns its inputs (``nn.Identity``, in a ``ModuleDict`` as
peft's ``lora_dropout``) no longer makes graph building fail for it and every ancestor.

torch.export.unflatten makes no graph for a module call that recorded no node; such a module
now runs as itself (opaque, called from its caller's graph) and everything around it is a graph.
"""

from __future__ import annotations

import copy

import pytest
import torch

import nnbridge
from nnbridge import ExtractionOptions, PatchableGraph
from nnbridge.inplace.bridging import bridge_of
from nnbridge.graph.kinds import StubKind
from nnbridge.patching.patches import RecordPatch, ZeroPatch


class Returns(torch.nn.Module):
    """``return x``, or its inputs as a tuple."""

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> object:
        return x if y is None else (y, x)


class Adapter(torch.nn.Module):
    """peft's LoRA layer's shape: base + B(A(dropout(x))), the dropout an Identity in a ModuleDict."""

    def __init__(self, dropout: str) -> None:
        super().__init__()
        self.base = torch.nn.Linear(4, 4)
        holder = {"identity": torch.nn.Identity(), "returns": Returns()}[dropout]
        self.lora_dropout = torch.nn.ModuleDict({"default": holder})
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(4, 2, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(2, 4, bias=False)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B["default"](self.lora_A["default"](self.lora_dropout["default"](x * 2)))


class Model(torch.nn.Module):
    def __init__(self, dropout: str = "identity") -> None:
        super().__init__()
        self.layer = Adapter(dropout)
        self.swap = Returns()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.swap(x, x.relu())
        return self.layer(a).tanh() + b


STRICT = ExtractionOptions(error_on_compilation_failure=True)


def _model(dropout: str = "identity") -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Model(dropout)
    return model, copy.deepcopy(model), torch.randn(3, 4)


@pytest.mark.parametrize("dropout", ["identity", "returns"])
def test_patchable_graph_extracts_around_a_module_returning_its_inputs(dropout: str) -> None:
    model, ref, x = _model(dropout)
    pg = PatchableGraph(model, x, options=STRICT)
    assert torch.equal(pg(x), ref(x))
    opaque = pg.extractions[0].opaque
    assert opaque == {"layer.lora_dropout.default": StubKind.PASSTHROUGH, "swap": StubKind.PASSTHROUGH}
    record = RecordPatch()
    with pg.patch({"layer.lora_A_default.linear": record, "layer.add": ZeroPatch()}):
        patched = pg(x)
    assert torch.equal(patched, torch.zeros(3, 4).tanh() + x)  # swap returns (x.relu(), x)
    assert torch.equal(record.activations[0], ref.layer.lora_A["default"](x.relu() * 2))


def test_bridge_runs_the_passthrough_module_with_its_hooks() -> None:
    model, ref, x = _model()
    seen: list[torch.Tensor] = []
    for m in (model, ref):
        m.layer.lora_dropout["default"].register_forward_hook(lambda mod, args, out: out * 3)
    model.layer.lora_dropout["default"].register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    nnbridge.bridge(model, x, options=STRICT)
    assert torch.equal(model(x), ref(x))
    assert len(seen) == 1  # the call's (extraction's own runs run no user hooks)
    state = bridge_of(model)
    assert state is not None
    graphs = [e for e in state.dispatcher.all_extractions()]
    assert set(graphs[0].opaque) == {"layer.lora_dropout.default", "swap"}
