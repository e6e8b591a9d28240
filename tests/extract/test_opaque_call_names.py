"""An opaque module counts a child's calls per name its code reaches the child by.

One module object held under several names (``self.linear`` and ``self.blocks["b"][1]``, and
inside a Sequential) gets each name's own invocations, as graphpatch numbers them; a call made
inside another child is that child's. Before, calls were counted on the object, so a name got
another name's calls (``sequential.1_1``: never run) or only the object's first call.
"""

import pytest
import torch
from torch import nn

from nnbridge import ExtractionOptions, PatchableGraph, ProbePatch, ZeroPatch


class Shared(nn.Module):
    """``linear`` called 3 times by name, once through a ModuleDict and twice inside a Sequential."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.other = nn.Linear(3, 3)
        self.blocks = nn.ModuleDict({"a": self.other, "b": nn.ModuleList([self.other, self.linear])})
        self.sequential = nn.Sequential(self.other, nn.Sequential(self.linear, self.linear))

    def forward(self, x):
        y = self.linear(x)
        for _ in range(2):
            y = y + self.linear(x) * self.blocks["b"][1](y)
        return self.sequential(y) + self.blocks["a"](y)


def _made():
    torch.manual_seed(0)
    return Shared().eval()


def _pg(x):
    return PatchableGraph(_made(), x, options=ExtractionOptions(skip_compilation=True))


def test_each_name_has_its_own_invocations():
    x = torch.randn(2, 3)
    pg = _pg(x)
    keys = set(pg.graph.keys())
    assert {"linear_0.output", "linear_1.output", "linear_2.output"} <= keys
    assert "linear_3.output" not in keys and "linear.output" not in keys
    assert {"blocks_b_1_0.output", "blocks_b_1_1.output", "blocks_a.output"} <= keys
    # the Sequential's entry 1 is a Sequential: the calls of ``linear`` inside it are its own
    assert {"sequential.0.output", "sequential.1.0.output", "sequential.1.1.output"} <= keys
    assert not any(k.startswith("sequential.0_") for k in keys), sorted(keys)
    assert torch.equal(pg(x), _made()(x))


def test_every_invocation_runs():
    """No name lists an invocation the code never makes: each one's probe sees a value, but for
    the two names the code never calls a module by (``self.other``, ``self.blocks["b"][0]``)."""
    x = torch.randn(2, 3)
    pg = _pg(x)
    outputs = [k for k in pg.graph.keys() if k.endswith(".output") and k != "output"]
    probes = {k: ProbePatch() for k in outputs}
    with pg.patch({k: [p] for k, p in probes.items()}):
        pg(x)
    assert sorted(k for k, p in probes.items() if p.activation is None) == ["blocks_b_0.output", "other.output"]


@pytest.mark.parametrize("name, call", [("linear_1", ("linear", 1)), ("blocks_b_1_0", ("blocks.b.1", 0)),
                                        ("sequential.1.1", ("sequential.1.1", 0))])
def test_a_patch_changes_that_call_only(name, call):
    """Zeroing one name's invocation equals eager with that one call's output zeroed (a forward
    hook on the shared object, told apart by the call's place in the run)."""
    x = torch.randn(2, 3)
    pg = _pg(x)
    reference = _made()
    order = {  # the order the shared linear is called in, by name
        ("linear", 0): 0, ("linear", 1): 1, ("blocks.b.1", 0): 2, ("linear", 2): 3,
        ("blocks.b.1", 1): 4, ("sequential.1.0", 0): 5, ("sequential.1.1", 0): 6}
    seen = []

    def zero_one(module, args, output):
        seen.append(None)
        return torch.zeros_like(output) if len(seen) - 1 == order[call] else output
    reference.linear.register_forward_hook(zero_one)
    want = reference(x)
    assert len(seen) == 7
    with pg.patch({f"{name}.output": ZeroPatch()}):
        got = pg(x)
    assert torch.equal(got, want)
    assert not torch.equal(got, _made()(x))


class Aliased(nn.Module):
    """``self.alias`` is ``self.linear`` (not in a container): export knows it by its first name."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.alias = self.linear

    def forward(self, x):
        return self.alias(self.linear(x)) + self.linear(x)


def test_a_call_through_a_second_name_is_no_invocation_of_the_first():
    """In an opaque module the calls through ``alias`` run the child eagerly; ``linear_k`` are the
    calls through ``linear`` only, so none is listed that never runs (before: ``linear_2``)."""
    torch.manual_seed(0)
    model, x = Aliased(), torch.randn(1, 2)
    pg = PatchableGraph(model, x, options=ExtractionOptions(skip_compilation=True))
    assert sorted(k for k in pg.graph.keys() if k.endswith(".output")) == ["linear_0.output", "linear_1.output"]
    with pg.patch({"linear_1.output": ZeroPatch()}):
        got = pg(x)
    assert torch.equal(got, model.alias(model.linear(x)))  # the last call, through ``linear``, zeroed
