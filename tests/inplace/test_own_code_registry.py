"""A bridged module's own code sees the registry the user built: while it runs (a submodule called
on its own, an opaque module, a trace that runs the model's code or nnsight's ``.source`` of it,
Dynamo tracing a call no graph serves), the op points of its tree are out of ``_modules`` (still attributes), so a forward that
walks ``self.children()`` or counts ``self.named_modules()`` computes what it computes eagerly.
They are back in their places after the run, also when it raises."""

import copy

import pytest
import torch
from torch import nn

import nnbridge
from nnbridge.graph.op_point import OpPoint


class Loop(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, x, scale=1):
        for child in self.children():
            x = child(x) * 2
        if x.shape[0] == 7:
            raise ValueError("seven rows")
        return x * scale + len(list(self.named_modules()))


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.loop = Loop()
        self.head = nn.Linear(3, 2)

    def forward(self, x, scale=1):
        return self.head(self.loop(x, scale))


def _models(options=None):
    torch.manual_seed(0)
    eager = Root()
    model = copy.deepcopy(eager)
    x = torch.randn(2, 3)
    nnbridge.bridge(model, x, options=options)
    return eager, model, x


def _registries(model):
    return {path: list(module._modules) for path, module in model.named_modules()}


def test_a_submodule_called_on_its_own_walks_the_users_children_and_keeps_its_op_points():
    eager, model, x = _models()
    before = _registries(model)
    assert isinstance(model.loop.mul, OpPoint)
    assert torch.equal(model.loop(x), eager.loop(x))
    assert _registries(model) == before


def test_an_opaque_module_walks_the_users_children():
    eager, model, x = _models(nnbridge.ExtractionOptions(classes_to_skip_compiling={Loop}))
    x.requires_grad_(True)
    expected = eager(x)
    expected.sum().backward()
    grad, x.grad = x.grad, None
    output = model(x)
    output.sum().backward()
    assert torch.equal(output, expected)
    assert torch.equal(x.grad, grad)
    assert torch.equal(model.loop.a.weight.grad, eager.loop.a.weight.grad)


def test_nnsight_traces_running_the_models_own_code_over_a_bridged_model():
    eager, model, x = _models()
    wrapped = nnbridge.NNsight(model)
    with wrapped.trace(x):
        output = wrapped.output.save()
    with wrapped.trace(x):
        loop = wrapped.loop.output.save()
    assert torch.equal(output, eager(x))
    assert torch.equal(loop, eager.loop(x))


def test_an_nnsight_source_trace_over_a_bridged_model_walks_the_users_children():
    eager, model, x = _models()
    wrapped = nnbridge.NNsight(model)
    with wrapped.trace(x):
        first = wrapped.loop.source.child_0.output.save()
        output = wrapped.output.save()
    assert torch.equal(first, eager.loop.a(x))
    assert torch.equal(output, eager(x))


def test_op_points_registered_while_the_models_own_code_runs_join_the_registry_after_it():
    torch.manual_seed(0)
    eager = Root()
    model = copy.deepcopy(eager)
    x = torch.randn(2, 3)
    wrapped = nnbridge.NNsight(model)
    with wrapped.trace(x):  # extracts loop.a only, inside Loop's own code
        linear = wrapped.loop.a.linear.output.save()
        output = wrapped.output.save()
    assert torch.equal(output, eager(x))
    assert torch.equal(linear, eager.loop.a(x))
    assert isinstance(model.loop.a._modules["linear"], OpPoint)
    assert "linear" not in model.loop.a.__dict__
    assert list(model.loop._modules)[:2] == ["a", "b"]


@pytest.mark.integration  # end to end: torch.compile
def test_a_compiled_call_no_graph_serves_traces_the_users_children():
    eager, model, x = _models()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    try:
        assert torch.equal(compiled(x, 3), eager(x, 3))  # a new call structure: Dynamo traces the code
    finally:
        torch._dynamo.reset()
    assert isinstance(model.loop._modules["mul"], OpPoint)


def test_hooks_in_the_run_reach_op_points_as_attributes():
    eager, model, x = _models()
    seen = []

    def hook(module, args, output):
        seen.append((type(model.loop.a.linear), [name for name, _ in model.loop.named_children()]))

    model.loop.a.register_forward_hook(hook)
    assert torch.equal(model.loop(x), eager.loop(x))
    assert seen == [(OpPoint, ["a", "b"])]


def test_the_registry_is_back_in_place_when_the_code_raises():
    eager, model, x = _models()
    before = _registries(model)
    with pytest.raises(ValueError, match="seven rows"):
        model.loop(torch.randn(7, 3))
    assert _registries(model) == before
    assert all(not isinstance(value, OpPoint) for value in vars(model.loop).values())
    assert torch.equal(model(x), eager(x))


def test_a_module_only_trace_that_raises_leaves_the_registry_in_place():
    eager, model, x = _models()
    before = _registries(model)
    wrapped = nnbridge.NNsight(model)
    with pytest.raises(ValueError, match="seven rows"):
        with wrapped.trace(torch.randn(7, 3)):
            wrapped.loop.output.save()
    assert _registries(model) == before
    with wrapped.trace(x):
        output = wrapped.output.save()
    assert torch.equal(output, eager(x))



class Growing(nn.Module):
    """Once told to (``edit``), adds a child and deletes its op point ``mul`` (an attribute while
    its own code runs)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.edit = False

    def forward(self, x):
        if self.edit:
            self.edit = False
            self.extra = nn.Identity()
            del self.mul
        return self.b(self.a(x)) * 2


class GrowingRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.grow = Growing()

    def forward(self, x):
        return self.grow(x) + 1


def test_a_run_that_adds_a_child_or_deletes_an_op_point_keeps_its_edits_in_registration_order():
    torch.manual_seed(0)
    model = GrowingRoot()
    x = torch.randn(2, 3)
    nnbridge.bridge(model, x)
    names = list(model.grow._modules)
    assert isinstance(model.grow._modules["mul"], OpPoint) and names.index("mul") < len(names) - 1
    expected = model.grow.b(model.grow.a(x)) * 2
    model.grow.edit = True
    assert torch.equal(model.grow(x), expected)  # called on its own: its own code runs
    assert "mul" not in model.grow._modules and "mul" not in vars(model.grow)
    assert list(model.grow._modules) == [name for name in names if name != "mul"] + ["extra"]
    again = list(model.grow._modules)
    assert torch.equal(model.grow(x), expected)  # nothing changed in this run: all back in place
    assert list(model.grow._modules) == again
