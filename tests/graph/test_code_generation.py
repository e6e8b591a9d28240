"""Code generation of graph modules deferred while a dispatcher adds an extraction
(:func:`nnbridge.graph.codegen.code_generation_deferred`): every graph's code is generated
once, after the in-place bridge's edits, and a graph that waits for its code still runs, and shows,
its current graph."""

from __future__ import annotations

import operator
from collections import Counter

import pytest
import torch

import nnbridge
from nnbridge.inplace.bridging import bridge_of
from nnbridge import AddPatch, CompiledGraphModule, PatchableGraph
from nnbridge.graph import codegen
from nnbridge.graph.codegen import code_generation_deferred
from utils import gpt2


def _graphs(root):
    return [m for m in root.modules() if isinstance(m, CompiledGraphModule)]


@pytest.mark.no_extraction_cache
def test_bridging_generates_each_graphs_code_once_and_equals_eager(monkeypatch):
    model, ids = gpt2(), torch.randint(0, 100, (1, 6))
    with torch.no_grad():
        expected = model(ids).logits
    generated: Counter[int] = Counter()
    real = CompiledGraphModule._generate_code

    def counting(self):
        generated[id(self)] += 1
        return real(self)
    monkeypatch.setattr(CompiledGraphModule, "_generate_code", counting)
    nnbridge.bridge(model, ids)
    graphs = _graphs(bridge_of(model).dispatcher.all_extractions()[0].root)
    assert len(graphs) > 20 and all(generated[id(g)] == 1 for g in graphs), "once each, after the bridge's edits"
    assert codegen._deferred is None
    assert all("_nnbridge_call_" in g.code or not any(n.op == "call_module" for n in g.graph.nodes) for g in graphs)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


def _ln_f(pg):
    [ln] = [g for g in _graphs(pg) if g.graph_meta.node_path == "transformer.ln_f"]
    return ln


def _final_norm():
    """A GPT-2 PatchableGraph, its final layer norm's graph, an input and the graph's output for it."""
    pg = PatchableGraph(gpt2(), torch.randint(0, 100, (1, 6)))
    ln = _ln_f(pg)
    x = torch.randn(1, 6, ln.weight.shape[0])
    with torch.no_grad():
        return pg, ln, x, ln(x)


def _negated_output(gm):
    """Edit ``gm``'s graph: its output is negated."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    value = output.args[0]
    with gm.graph.inserting_before(output):
        negated = gm.graph.call_function(operator.neg, (value,))
    output.args = (negated,)


def test_a_graph_waiting_for_its_code_runs_and_shows_its_current_graph():
    pg, ln, x, before = _final_norm()
    with code_generation_deferred():
        _negated_output(ln)
        ln.recompile()
        assert id(ln) in codegen._deferred
        with torch.no_grad():
            assert torch.equal(ln(x), -before), "the first call generates the code of the edited graph"
        assert id(ln) not in codegen._deferred
        _negated_output(ln)
        ln.recompile()
        assert "neg_1" in ln.code and id(ln) not in codegen._deferred, "reading code generates it"
    with torch.no_grad():
        assert torch.equal(ln(x), before)


def test_a_routed_forward_of_the_graph_before_an_edit_does_not_run():
    """A patch routes the output through its op point; an edit under deferral must not leave the
    routed code of the old graph in place."""
    pg, ln, x, before = _final_norm()
    with torch.no_grad(), pg.patch({"transformer.ln_f.output": AddPatch(value=1.0)}):
        assert torch.equal(ln(x), before + 1.0)
        with code_generation_deferred():
            _negated_output(ln)
            ln.recompile()
            assert torch.equal(ln(x), -before + 1.0), "still patched, through the new graph's code"
    with torch.no_grad():
        with code_generation_deferred():
            with pg.patch({"transformer.ln_f.output": AddPatch(value=1.0)}):
                assert torch.equal(ln(x), -before + 1.0)
                _negated_output(ln)
                ln.recompile()
            # the patch's end switches back to the unrouted forward: the new graph's, not the old one
            assert torch.equal(ln(x), before)
        assert "neg_1" in ln.code


def test_graphs_waiting_when_the_body_raises_get_their_code_and_the_error_propagates():
    pg, ln, x, before = _final_norm()
    with pytest.raises(RuntimeError, match="the body's error"):
        with code_generation_deferred():
            _negated_output(ln)
            ln.recompile()
            raise RuntimeError("the body's error")
    assert codegen._deferred is None and "neg" in ln.__dict__["_code"]
    with torch.no_grad():
        assert torch.equal(ln(x), -before)


# -- torch.export.unflatten's own graph modules generate no code (compat.torch.export._code_generated_lazily)

def _spy_unflatten(monkeypatch, fail: bool = False):
    """Keep the graph modules ``torch.fx.GraphModule.recompile`` ran for inside
    ``torch.export.unflatten`` and what it returned; ``fail``: make it raise after unflattening."""
    seen = {"inside": False, "recompiled": [], "unflattened": []}
    real_unflatten, real_recompile = torch.export.unflatten, torch.fx.GraphModule.recompile

    def recompile(self):
        if seen["inside"]:
            seen["recompiled"].append(self)
        return real_recompile(self)

    def unflatten(*args, **kwargs):
        seen["inside"] = True
        try:
            seen["unflattened"].append(real_unflatten(*args, **kwargs))
        finally:
            seen["inside"] = False
        if fail:
            raise RuntimeError("unflatten failed on purpose")
        return seen["unflattened"][-1]
    monkeypatch.setattr(torch.fx.GraphModule, "recompile", recompile)
    monkeypatch.setattr(torch.export, "unflatten", unflatten)
    return seen


@pytest.mark.no_extraction_cache
def test_unflatten_generates_no_code_for_its_graph_modules_which_still_run_and_the_bridge_equals_eager(monkeypatch):
    from torch.export.unflatten import InterpreterModule, UnflattenedModule
    finalizers = (InterpreterModule.finalize, UnflattenedModule.finalize)
    model, ids = gpt2(), torch.randint(0, 100, (1, 6))
    with torch.no_grad():
        expected = model(ids).logits
    seen = _spy_unflatten(monkeypatch)
    nnbridge.bridge(model, ids)
    [unflattened] = seen["unflattened"]
    made = [m.__dict__["graph_module"] for m in unflattened.modules() if "graph_module" in m.__dict__]
    assert len(made) > 20, "each unflattened module has its graph module"
    assert not {id(m) for m in made} & {id(m) for m in seen["recompiled"]}, "none generated its code"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
    assert (InterpreterModule.finalize, UnflattenedModule.finalize) == finalizers
    # the unflattened modules still run (through fx.Interpreter, which reads their graphs): the first
    # MLP's activation (no parameters: unflatten's are meta tensors) gives what the model's gives
    [activation] = [m for name, m in unflattened.named_modules() if name.endswith("h.0.mlp.act")]
    assert isinstance(activation, InterpreterModule)
    hidden = torch.randn(1, 6, 4 * model.config.n_embd)
    with torch.no_grad():
        assert torch.equal(activation(hidden), model.transformer.h[0].mlp.act(hidden))


@pytest.mark.no_extraction_cache
def test_unflatten_puts_torchs_finalize_back_also_when_it_raises(monkeypatch):
    from torch.export.unflatten import InterpreterModule, UnflattenedModule
    finalizers = (InterpreterModule.finalize, UnflattenedModule.finalize)
    from nnbridge.compat.torch.export import unflatten
    model, ids = gpt2(), torch.randint(0, 100, (1, 6))
    exported = torch.export.export(model, (ids,), strict=False)
    _spy_unflatten(monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="on purpose"):
        unflatten(exported)
    assert (InterpreterModule.finalize, UnflattenedModule.finalize) == finalizers
