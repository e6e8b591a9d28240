"""Opaque mode numbers the invocations of a child called several times (``linear_0``,
``linear_1``), as compiled mode and graphpatch do: a patch on one invocation changes only that call."""

import pytest
import torch
from torch import nn

from nnbridge import ExtractionOptions, PatchableGraph, ZeroPatch

MODES = {"compiled": ExtractionOptions(), "opaque": ExtractionOptions(skip_compilation=True)}


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(torch.relu(self.linear(x)))


def _made():
    torch.manual_seed(0)
    return Twice().eval()


def _zero_call(model, which):
    """Eager reference: a forward hook zeroing the output of call number ``which`` (0-based)."""
    calls = []

    def hook(module, args, output):
        calls.append(module)
        return torch.zeros_like(output) if len(calls) - 1 == which else output
    return model.linear.register_forward_hook(hook)


@pytest.mark.parametrize("mode", list(MODES))
def test_each_invocation_is_its_own_node_path(mode):
    model, x = _made(), torch.randn(3, 4)
    pg = PatchableGraph(model, x, options=MODES[mode])
    assert {"linear_0.output", "linear_1.output", "linear_0.weight", "linear_1.weight"} <= set(pg.graph.keys())
    assert "linear.output" not in pg.graph.keys()
    assert torch.equal(pg(x), _made()(x))
    for which in (0, 1):
        reference = _made()
        handle = _zero_call(reference, which)
        with pg.patch({f"linear_{which}.output": ZeroPatch()}):
            patched = pg(x)
        assert torch.equal(patched, reference(x)), f"{mode}: linear_{which}"
        handle.remove()
        assert not torch.equal(patched, reference(x)), "the patch changes the output"
    assert torch.equal(pg(x), _made()(x)), "patches are undone; the call count restarts every run"


def test_opaque_invocations_share_the_parameters():
    model, x = _made(), torch.randn(3, 4)
    pg = PatchableGraph(model, x, options=MODES["opaque"])
    weights = dict(pg.named_parameters())
    assert all(w is model.linear.weight for n, w in weights.items() if n.endswith("weight"))
    pg(x).sum().backward()
    reference = _made()
    reference(x).sum().backward()
    assert torch.equal(model.linear.weight.grad, reference.linear.weight.grad)


def test_opaque_invocations_survive_torch_save_and_pg_save(tmp_path):
    import io
    model, x = _made(), torch.randn(3, 4)
    pg = PatchableGraph(model, x, options=MODES["opaque"])
    buffer = io.BytesIO()
    torch.save(pg, buffer)
    buffer.seek(0)
    pg.save(tmp_path / "pg")
    for loaded in (torch.load(buffer, weights_only=False),
                   PatchableGraph.load(tmp_path / "pg", model, options=MODES["opaque"])):
        assert torch.equal(loaded(x), _made()(x))
        reference = _made()
        handle = _zero_call(reference, 1)
        with loaded.patch({"linear_1.output": ZeroPatch()}):
            assert torch.equal(loaded(x), reference(x))
        handle.remove()
