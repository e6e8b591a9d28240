"""ExtractionOptions: opaque fallback, skipping, custom extraction functions, postprocessing."""

import copy
import warnings

import pytest
import torch
from torch.fx import Graph

import nnbridge

from fixtures.data_dependent_module import Branchy
from fixtures.minimal_module import MinimalModule
from fixtures.unused_submodule import UnusedSubmoduleModule
from nnbridge import (CompiledGraphModule, ExtractionError, ExtractionOptions, NNBridgeWarning,
                      OpaqueGraphModule, PatchableGraph, ProbePatch, ZeroPatch)
from utils import assert_same, data_dependent, falls_back


def test_opaque_fallback_warns_once_by_default():
    model, x = data_dependent()
    with pytest.warns(NNBridgeWarning, match="1 module of DataDependentModule runs eagerly") as caught:
        pg = PatchableGraph(model, x)
    assert len(caught) == 1 and "\n  branchy | GuardOnDataDependentSymNode" in str(caught[0].message)
    assert isinstance(pg._graph_module.branchy, OpaqueGraphModule)


def test_opaque_fallback_prints_nothing_and_explain_keeps_the_reason(capfd):
    model, x = data_dependent()
    capfd.readouterr()
    with pytest.warns(NNBridgeWarning, match="runs eagerly"):  # a warning, not a print
        pg = PatchableGraph(model, x)
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert "GuardOnDataDependentSymNode" in str(nnbridge.explain(pg))


def test_warn_on_compilation_failure():
    model, x = data_dependent()
    with pytest.warns(NNBridgeWarning, match="Module 'branchy' is opaque"):
        PatchableGraph(model, x, options=ExtractionOptions(warn_on_compilation_failure=True))


def test_fallback_warnings_point_at_the_users_line():
    """Extracting at construction, at a call of the PatchableGraph with a new call structure, and
    at a call of a bridged model: each warning names this file."""
    options = ExtractionOptions(warn_on_compilation_failure=True)
    model, x = data_dependent()
    with pytest.warns(NNBridgeWarning, match="Module 'branchy' is opaque") as caught:
        pg = PatchableGraph(model, x, options=options)
    assert [w.filename for w in caught] == [__file__]
    with pytest.warns(NNBridgeWarning, match="Module 'branchy' is opaque") as caught:
        pg(x.unsqueeze(0))  # another rank: extracted again
    assert [w.filename for w in caught] == [__file__]
    model, x = data_dependent()
    with pytest.warns(NNBridgeWarning, match="Module 'branchy' is opaque") as caught:
        nnbridge.bridge(model, x, options=options)
        model(x.unsqueeze(0))
    assert len(caught) == 2 and all(w.filename == __file__ for w in caught)
    nnbridge.unbridge(model)


def test_error_on_compilation_failure_keeps_cause_and_model_intact():
    model, x = data_dependent()
    hook_calls = []
    model.branchy.register_forward_hook(lambda *a: hook_calls.append(1))
    with pytest.raises(ExtractionError, match="module 'branchy' \\(Branchy\\)") as info:
        PatchableGraph(model, ExtractionOptions(error_on_compilation_failure=True), x)
    assert info.value.__cause__ is not None
    assert "forward" not in model.branchy.__dict__ and "forward" not in model.__dict__
    model(x)
    assert hook_calls == [1]


def test_opaque_module_inputs_outputs_params_patchable():
    model, x = data_dependent()
    with falls_back("branchy"):
        pg = PatchableGraph(model, x)
    assert [n for n in dir(pg.graph.branchy) if not n.startswith("_")] == ["inner", "output", "x"]
    probe = ProbePatch()
    with pg.patch({"branchy.x": probe, "branchy.output": ZeroPatch()}):
        out = pg(x)
    assert torch.equal(probe.activation, model.pre(x))
    assert torch.equal(out, model.post(torch.zeros(2, 3)))
    with pg.patch({"branchy.inner.weight": ZeroPatch()}):
        out = pg(x)
    h = model.pre(x)
    inner = model.branchy.inner.bias.expand(2, 3)
    assert torch.equal(out, model.post(inner * 2 if h.sum() > 0 else inner - 1))
    assert_same(pg(x), model(x))


def test_skip_compilation_and_classes_to_skip():
    model, x = data_dependent()
    pg = PatchableGraph(model, x, options=ExtractionOptions(skip_compilation=True))
    assert isinstance(pg._graph_module, OpaqueGraphModule)
    assert isinstance(pg._graph_module.pre, OpaqueGraphModule)
    assert_same(pg(x), model(x))
    model = MinimalModule().eval()
    x = torch.randn(4, 3)
    pg = PatchableGraph(model, x, options=ExtractionOptions(classes_to_skip_compiling={torch.nn.Linear}))
    assert isinstance(pg._graph_module, CompiledGraphModule)
    assert isinstance(pg._graph_module.linear, OpaqueGraphModule) and pg._graph_module.linear.reason == "skipped"
    with pg.patch({"linear.weight": ZeroPatch()}):
        assert torch.equal(pg(x), model.linear.bias.expand(4, 2))


def test_custom_extraction_function():
    def extract_branchy(module):
        graph = Graph()
        x = graph.placeholder("x")
        weight = graph.get_attr("inner.weight")
        matmul = graph.call_function(torch.matmul, (x, weight))
        matmul.name = "my_custom_name"
        graph.output((matmul,))
        return graph

    model, x = data_dependent()
    pg = PatchableGraph(model, x, options=ExtractionOptions(custom_extraction_functions={Branchy: extract_branchy}))
    assert isinstance(pg._graph_module.branchy, CompiledGraphModule)
    assert "my_custom_name" in dir(pg.graph.branchy)
    assert torch.equal(pg(x), model.post(model.pre(x) @ model.branchy.inner.weight))
    with pg.patch({"branchy.my_custom_name": ZeroPatch()}):
        assert torch.equal(pg(x), model.post(torch.zeros(2, 3)))


def test_custom_extraction_function_errors():
    def no_tuple(module):
        graph = Graph()
        graph.output(graph.placeholder("x"))
        return graph

    def wrong_name(module):
        graph = Graph()
        graph.output((graph.placeholder("y"),))
        return graph

    model, x = data_dependent()
    untouched = copy.deepcopy(model)
    with pytest.raises(ExtractionError, match="not a 1-tuple"):
        PatchableGraph(model, x, options=ExtractionOptions(custom_extraction_functions={Branchy: no_tuple}))
    with pytest.raises(ExtractionError, match="placeholders \\['y'\\].*\\['x'\\]"):
        PatchableGraph(model, x, options=ExtractionOptions(custom_extraction_functions={Branchy: wrong_name}))
    assert_same(model(x), untouched(x))
    assert "forward" not in model.branchy.__dict__


def test_postprocessing_function():
    seen = []

    def postprocess(graph_module, module):
        seen.append(type(module).__name__)
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and "linear" in str(node.target):
                with graph_module.graph.inserting_after(node):
                    doubled = graph_module.graph.call_function(torch.mul, (node, 2))
                node.replace_all_uses_with(doubled, delete_user_cb=lambda user: user is not doubled)

    model = MinimalModule().eval()
    x = torch.randn(4, 3)
    pg = PatchableGraph(model, x, options=ExtractionOptions(postprocessing_function=postprocess))
    assert seen == ["Linear", "MinimalModule"]
    assert torch.equal(pg(x), model(x) * 2)


def test_allow_unused_submodules():
    """As graphpatch: unused submodules are kept (opaque, not in NodePaths) unless strict."""
    model = UnusedSubmoduleModule().eval()
    x = torch.randn(2, 3)
    pg = PatchableGraph(model, x)
    assert "unused" not in dir(pg.graph)
    assert isinstance(pg._graph_module.unused, OpaqueGraphModule)
    assert pg._graph_module.unused.reason == "not invoked during extraction"
    assert_same(pg(x), model(x))
    with pytest.raises(ExtractionError, match="module 'unused' \\(Linear\\): it was never called"):
        PatchableGraph(model, x, options=ExtractionOptions(error_on_compilation_failure=True))
    pg = PatchableGraph(model, x, options=ExtractionOptions(error_on_compilation_failure=True,
                                                            allow_unused_submodules=True))
    assert isinstance(pg._graph_module.unused, OpaqueGraphModule)


def test_options_are_keyword_only_and_given_once():
    with pytest.raises(TypeError):
        ExtractionOptions(True)
    model = MinimalModule().eval()
    with pytest.raises(TypeError, match="ExtractionOptions twice"):
        PatchableGraph(model, ExtractionOptions(), torch.randn(4, 3), options=ExtractionOptions())
