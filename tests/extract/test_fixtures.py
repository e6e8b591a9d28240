"""Every fixture: outputs and gradients equal the untouched module's; graphs lint; weights shared."""

import pytest
import torch

from nnbridge import CompiledGraphModule, ExtractionOptions, OpaqueGraphModule, PatchableGraph, ProbePatch
from utils import (EXTRACTION_MODES, FIXTURES, assert_same, compiled_only, graph_modules, leaves, load_fixture,
                   opaque_and_compiled)

# Its ``branchy`` child cannot compile: compiled mode would raise, so it runs with the default
# options there (that child falls back to opaque, the rest compiles).
FALLBACK = "data_dependent_module.DataDependentModule"


def _cases():
    """Every fixture in every extraction mode: ``(name, options factory)``."""
    for name in FIXTURES:
        for mode, make_options in EXTRACTION_MODES.items():
            if name == FALLBACK and mode == "compiled":
                mode, make_options = "fallback", ExtractionOptions
            yield pytest.param(name, make_options, id=f"{name.split('.')[1]}-{mode}")


CASES = list(_cases())


@pytest.mark.parametrize(("name", "make_options"), CASES)
def test_outputs_equal(name, make_options):
    model, args, kwargs = load_fixture(name)
    pg = PatchableGraph(model, *args, options=make_options(), **kwargs)
    for graph_module in graph_modules(pg):
        graph_module.graph.lint()
    assert_same(pg(*args, **kwargs), model(*args, **kwargs))


@pytest.mark.parametrize(("name", "make_options"), CASES)
def test_gradients_equal(name, make_options):
    """Gradients of parameters and of the inputs through the graphs equal eager autograd's."""
    model, args, kwargs = load_fixture(name)
    pg = PatchableGraph(model, *args, options=make_options(), **kwargs)
    params = list(model.parameters())

    def grads(fn):
        model.zero_grad()
        inputs = [a.detach().clone().requires_grad_() for a in args]
        total = sum(t.float().sum() for t in leaves(fn(*inputs, **kwargs)) if isinstance(t, torch.Tensor))
        total.backward()
        return [t.grad.clone() if t.grad is not None else None for t in params + inputs]

    got, want = grads(pg), grads(model)
    assert any(g is not None for g in want)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize(("name", "make_options"), CASES)
def test_parameters_and_buffers_are_shared(name, make_options):
    model, args, kwargs = load_fixture(name)
    pg = PatchableGraph(model, *args, options=make_options(), **kwargs)
    originals = {t.data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    for tensor in list(pg.parameters()) + list(pg.buffers()):
        assert tensor.data_ptr() in originals


@opaque_and_compiled
def test_weight_edits_are_seen(options):
    model, args, kwargs = load_fixture("minimal_module.MinimalModule")
    pg = PatchableGraph(model, *args, options=options, **kwargs)
    with torch.no_grad():
        model.linear.weight.mul_(3)
    assert torch.equal(pg(*args), model(*args))


@compiled_only
def test_nested_module_list_keeps_its_place(options):
    model, args, kwargs = load_fixture("nested_module.NestedModule")
    pg = PatchableGraph(model, *args, options=options, **kwargs)
    layers = pg._graph_module.layers
    assert type(layers) is torch.nn.ModuleList and len(layers) == 3
    assert all(isinstance(layer, CompiledGraphModule) for layer in layers)
    assert [c for c in dir(pg.graph) if c.startswith("layers")] == ["layers_0", "layers_1", "layers_2"]
    # keyword arguments passed out of order keep their names as placeholders
    assert {"x", "scale", "bias"} <= set(dir(pg.graph.layers_1))
    probe = ProbePatch()
    with pg.patch({"layers_1.x": probe}):
        pg(*args)
    assert torch.equal(probe.activation, model.layers[0](args[0], args[1], 1.5))


@compiled_only
def test_buffers_keep_persistence(options):
    model, args, kwargs = load_fixture("buffer_module.BufferModule")
    pg = PatchableGraph(model, *args, options=options, **kwargs)
    assert set(pg._graph_module.state_dict()) == {"offset"}
    assert {"offset", "scratch"} <= set(dir(pg.graph))


@compiled_only
def test_float_attribute_is_a_constant(options):
    model, args, kwargs = load_fixture("attribute_module.AttributeModule")
    pg = PatchableGraph(model, *args, options=options, **kwargs)
    assert "div" in dir(pg.graph)
    assert_same(pg(*args), model(*args))


@compiled_only
def test_varargs_placeholders(options):
    model, args, kwargs = load_fixture("varargs_module.VarargsModule")
    pg = PatchableGraph(model, *args, options=options, **kwargs)
    assert {"args_0", "args_1", "gain"} <= set(dir(pg.graph.inner))
    assert_same(pg(*args), model(*args))


@compiled_only
def test_layer_norm_graph(options):
    model, args, kwargs = load_fixture("layer_norm_module.LayerNormModule")
    pg = PatchableGraph(model, *args, options=options, **kwargs)
    assert "layer_norm" in dir(pg.graph.ln)
    assert pg.graph.ln.layer_norm._shape == torch.Size([2, 3, 5])


def test_data_dependent_branch_is_opaque_rest_is_graph():
    model, args, kwargs = load_fixture("data_dependent_module.DataDependentModule")
    pg = PatchableGraph(model, *args, **kwargs)
    root = pg._graph_module
    assert isinstance(root, CompiledGraphModule)
    assert isinstance(root.pre, CompiledGraphModule) and isinstance(root.post, CompiledGraphModule)
    assert isinstance(root.branchy, OpaqueGraphModule)
    assert isinstance(root.branchy.inner, CompiledGraphModule)
    assert "GuardOnDataDependentSymNode" in root.branchy.reason
    assert pg.extractions[0].opaque == {"branchy": root.branchy.reason}
    for x in (torch.randn(2, 3), -torch.ones(2, 3) * 5, torch.ones(2, 3) * 5):
        assert_same(pg(x), model(x))


@compiled_only
def test_protected_names_are_mangled(options):
    model, args, kwargs = load_fixture("protected_names_module.ProtectedNamesModule")
    pg = PatchableGraph(model, *args, options=options, **kwargs)
    assert {"_code_", "graph_"} <= set(dir(pg.graph))
    assert isinstance(pg.graph._code, str)
    assert pg.graph.graph_.linear._shape == torch.Size([3, 2])
    assert_same(pg(*args), model(*args))


def test_train_mode_is_honoured():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).eval()
    x = torch.randn(8, 4)
    pg = PatchableGraph(model, x)
    assert_same(pg(x), model(x))
    model.train()
    torch.manual_seed(1)
    want = model(x)
    torch.manual_seed(1)
    got = pg(x)
    assert torch.equal(got, want) and not torch.equal(got, model.eval()(x))
    assert len(pg.extractions) == 2
