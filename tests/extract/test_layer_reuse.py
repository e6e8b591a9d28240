"""Layer reuse (``ExtractionOptions(reuse_layers=True)``, issue 13): a sibling layer's graph is its
representative's graph bound to its own parameters, indistinguishable from a full extraction.

Each model is extracted twice, fully and with reuse; the two must have the same graph code and
NodePaths per module, and give ``torch.equal`` outputs, gradients and per-layer patched outputs
(also equal to eager). Gemma 3 with alternating layer kinds must fall back (two layers, one of
each kind) or reuse only within a kind (sliding, sliding, full).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import re

import pytest
import torch
from transformers.cache_utils import DynamicLayer

import nnbridge
from nnbridge import CompiledGraphModule, ExtractionOptions, PatchableGraph, ProbePatch, ZeroPatch
from nnbridge.extract.building import BuiltTemplate, GraphBuilder, TemplateCall
from nnbridge.inplace.bridging import bridge_of
from utils import ToyIndexedLayer, assert_same_records, gemma3, gpt2, llama, named_graph_modules, toy_layer_cache

pytestmark = pytest.mark.integration  # end to end: whole models extracted twice, fully and with reuse

# not strict: Llama's and Gemma's rotary embeddings change grad mode (transformers < 5.24) and are opaque either way
REUSE = ExtractionOptions(reuse_layers=True)
FULL = ExtractionOptions(reuse_layers=False)


def _three_layers(factory):
    def make():
        model = factory()
        config = model.config
        torch.manual_seed(0)
        config.num_hidden_layers = 3
        if hasattr(config, "n_layer"):
            config.n_layer = 3
        return type(model)(config).eval()
    return make


def _gemma3_three():
    """Tiny Gemma 3 with layers sliding, sliding, full (as ``utils.gemma3``, three layers)."""
    config = gemma3().config.to_dict()
    config.pop("attn_implementation", None)
    config.update(num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(**config, attn_implementation="eager")).eval()


MODELS = {
    # (factory, layer prefix, expected {sibling: representative}, a node in every layer)
    "gpt2": (_three_layers(gpt2), "transformer.h",
             {"transformer.h.1": "transformer.h.0", "transformer.h.2": "transformer.h.0"}, "attn.softmax"),
    "llama": (_three_layers(llama), "model.layers",
              {"model.layers.1": "model.layers.0", "model.layers.2": "model.layers.0"}, "self_attn.softmax"),
    "gemma3_alternating": (lambda: gemma3(("sliding_attention", "full_attention")), "model.layers", {},
                           "self_attn.softmax"),
    "gemma3_sliding_sliding_full": (_gemma3_three,
                                    "model.layers", {"model.layers.1": "model.layers.0"}, "self_attn.softmax"),
}


def _graphs(pg: PatchableGraph) -> dict[str, CompiledGraphModule]:
    return named_graph_modules(pg._graph_module)


def _reused(pg: PatchableGraph) -> dict[str, str]:
    return {name: m.graph_meta.reused_from for name, m in _graphs(pg).items() if m.graph_meta.reused_from}


def _layers(model, prefix):
    return len(model.get_submodule(prefix))


def _node_path(prefix: str, i: int, node: str) -> str:
    owner, _, container = prefix.rpartition(".")
    return f"{owner}.{container}_{i}.{node}"


@pytest.fixture(params=list(MODELS), scope="module")
def case(request):
    factory, prefix, expected, node = MODELS[request.param]
    model = factory()
    torch.manual_seed(1)
    ids = torch.randint(1, 100, (2, 7))
    full = PatchableGraph(model, ids, use_cache=False, options=FULL)
    reused = PatchableGraph(model, ids, use_cache=False, options=REUSE)
    return model, ids, prefix, expected, node, full, reused


def test_reuse_happens_where_expected(case):
    model, ids, prefix, expected, node, full, reused = case
    assert _reused(reused) == expected
    assert _reused(full) == {}


def test_same_graphs_and_node_paths(case):
    model, ids, prefix, expected, node, full, reused = case
    assert full.node_paths() == reused.node_paths()
    a, b = _graphs(full), _graphs(reused)
    assert list(a) == list(b)
    for name in a:
        assert a[name].code == b[name].code, name
        assert [n.name for n in a[name].graph.nodes] == [n.name for n in b[name].graph.nodes], name
        # each graph reads its own module's parameters
        assert [(k, v.data_ptr()) for k, v in a[name].named_parameters()] == \
            [(k, v.data_ptr()) for k, v in b[name].named_parameters()], name


def test_outputs_and_grads_equal(case):
    model, ids, prefix, expected, node, full, reused = case
    eager = model(ids, use_cache=False).logits
    outputs, grads = [], []
    for pg in (full, reused):
        model.zero_grad(set_to_none=True)
        out = pg(ids, use_cache=False).logits
        out.pow(2).sum().backward()
        outputs.append(out.detach())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    assert torch.equal(outputs[0], eager) and torch.equal(outputs[1], eager)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for k in grads[0]:
        assert torch.equal(grads[0][k], grads[1][k]), k


def test_per_layer_patches_equal(case):
    model, ids, prefix, expected, node, full, reused = case
    plain = full(ids, use_cache=False).logits
    probes_per_layer = []
    for i in range(_layers(model, prefix)):
        path = _node_path(prefix, i, node)
        results, probes = [], []
        for pg in (full, reused):
            probe = ProbePatch()
            with pg.patch({path: [probe, ZeroPatch()]}):
                results.append(pg(ids, use_cache=False).logits)
            probes.append(probe.activation)
        assert torch.equal(results[0], results[1]), path
        assert torch.equal(probes[0], probes[1]), path
        assert not torch.equal(results[0], plain), path  # the patch took effect
        probes_per_layer.append(probes[1])
    # each layer's op saw its own layer's values (siblings are bound to their own parameters)
    for i in range(1, len(probes_per_layer)):
        assert not torch.equal(probes_per_layer[0], probes_per_layer[i])


def test_gemma3_alternating_falls_back(caplog):
    model = gemma3(("sliding_attention", "full_attention"))
    ids = torch.randint(1, 100, (1, 6))
    with caplog.at_level(logging.INFO, logger="nnbridge.dispatch.extraction"):
        pg = PatchableGraph(model, ids, use_cache=False, options=REUSE)
    assert _reused(pg) == {}
    assert "fell back" in caplog.text


# -- transformers' default DynamicCache (use_cache=True): each layer writes its own cache layer ------
CACHE_MODELS = {name: MODELS[name] for name in ("gpt2", "llama")}


def _reused_in(pg: PatchableGraph) -> list[dict[str, str]]:
    """``{sibling: representative}`` of every extraction of ``pg`` (one per call structure)."""
    return [{name: m.graph_meta.reused_from for name, m in e.root.named_modules()
             if isinstance(m, CompiledGraphModule) and m.graph_meta.reused_from} for e in pg.extractions]


def _assert_same_cache(actual, expected):
    assert len(actual.layers) == len(expected.layers)
    for i, (a, b) in enumerate(zip(actual.layers, expected.layers)):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), i


def _code(gm) -> str:
    """Generated code, lifted constants' numbering aside (export numbers them per program)."""
    return re.sub(r"lifted_tensor_\d+", "lifted_tensor", gm.code)


@pytest.fixture(params=list(CACHE_MODELS), scope="module")
def cache_case(request):
    factory, prefix, expected, node = CACHE_MODELS[request.param]
    model = factory()
    torch.manual_seed(1)
    ids = torch.randint(1, 100, (2, 7))
    full = PatchableGraph(model, ids, options=FULL)
    reused = PatchableGraph(model, ids, options=REUSE)
    return model, ids, prefix, expected, node, full, reused


def test_cache_reuse_happens(cache_case):
    """With the default cache one layer is exported: the others are built from it."""
    model, ids, prefix, expected, node, full, reused = cache_case
    assert _reused(reused) == expected and _reused(full) == {}


def test_cache_same_graphs(cache_case):
    model, ids, prefix, expected, node, full, reused = cache_case
    assert full.node_paths() == reused.node_paths()
    a, b = _graphs(full), _graphs(reused)
    assert list(a) == list(b)
    for name in a:
        assert _code(a[name]) == _code(b[name]), name  # the cache layer index and spec are each layer's own


def test_cache_outputs_and_decode_step_equal(cache_case):
    """Prefill and a decode step with the returned cache: logits and every key/value tensor of
    the cache equal a full extraction's and eager's; the decode step reuses too."""
    model, ids, prefix, expected, node, full, reused = cache_case
    eager = model(ids)
    step = torch.randint(1, 100, (2, 1))
    eager_next = model(step, past_key_values=eager.past_key_values)
    for pg in (full, reused):
        out = pg(ids)
        assert torch.equal(out.logits, eager.logits)
        _assert_same_cache(out.past_key_values, model(ids).past_key_values)
        nxt = pg(step, past_key_values=out.past_key_values)
        assert torch.equal(nxt.logits, eager_next.logits)
        _assert_same_cache(nxt.past_key_values, eager_next.past_key_values)
    assert len(reused.extractions) == len(full.extractions) == 2
    assert all(r == expected for r in _reused_in(reused))


def test_cache_grads_equal(cache_case):
    model, ids, prefix, expected, node, full, reused = cache_case
    grads = []
    for run in (model, full, reused):
        model.zero_grad(set_to_none=True)
        out = run(ids)
        (out.logits.pow(2).sum() + out.past_key_values.layers[-1].keys.pow(2).sum()).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys() == grads[2].keys() and grads[0]
    for k in grads[0]:
        assert torch.equal(grads[0][k], grads[1][k]) and torch.equal(grads[1][k], grads[2][k]), k


def test_cache_per_layer_patch_equal(cache_case):
    """ZeroPatch on layer 1's softmax: logits, probed values and the cache equal a full extraction's."""
    model, ids, prefix, expected, node, full, reused = cache_case
    path = _node_path(prefix, 1, node)
    results = []
    for pg in (full, reused):
        probe = ProbePatch()
        with pg.patch({path: [probe, ZeroPatch()]}):
            out = pg(ids)
        results.append((out, probe.activation))
    (a, probe_a), (b, probe_b) = results
    assert torch.equal(a.logits, b.logits) and torch.equal(probe_a, probe_b)
    _assert_same_cache(b.past_key_values, a.past_key_values)
    assert not torch.equal(b.logits, model(ids).logits)  # the patch took effect
    # layers after the patched one see its changed output: their cache entries differ from eager's
    assert not torch.equal(b.past_key_values.layers[2].keys, model(ids).past_key_values.layers[2].keys)


def _built_from_templates(monkeypatch, model, ids, **kwargs) -> tuple[PatchableGraph, list[str]]:
    """A reused extraction, and the graphs built from a representative's built graph."""
    made: list[str] = []
    from_template = GraphBuilder.from_template

    def spy(self, built, fqn, *args, **kwargs):
        made.append(fqn)
        return from_template(self, built, fqn, *args, **kwargs)
    monkeypatch.setattr(GraphBuilder, "from_template", spy)
    return PatchableGraph(model, ids, options=REUSE, **kwargs), made


@pytest.mark.no_extraction_cache  # built cold: a disk-cache hit builds the same way (test_cache_reuse_disk_cache_hit)
@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma3_sliding_sliding_full"])
def test_siblings_built_from_the_representatives_built_graph_equal_a_full_extraction(monkeypatch, name):
    """Each sibling's graph is a copy of its representative's built graph with its own children,
    module paths, lifted constants and tensors: with and without a cache, every record equals a
    full extraction's, and every graph of every sibling is made that way."""
    factory, prefix, expected, _ = MODELS[name]
    model = factory()
    torch.manual_seed(1)
    ids = torch.randint(1, 100, (2, 7))
    for kwargs in ({"use_cache": False}, {}) if name != "gemma3_sliding_sliding_full" else ({"use_cache": False},):
        reused, made = _built_from_templates(monkeypatch, model, ids, **kwargs)
        assert _reused(reused) == expected
        in_siblings = [n for n in _graphs(reused) if any(n == s or n.startswith(f"{s}.") for s in expected)]
        assert len(made) == len(in_siblings) > len(expected), kwargs
        assert_same_records(PatchableGraph(model, ids, options=FULL, **kwargs)._graph_module, reused._graph_module)


@pytest.mark.no_extraction_cache
def test_siblings_whose_state_keys_differ_are_built_again_from_the_unflattened_graph(monkeypatch):
    """When a representative's built graph does not fit a sibling (other state keys), the sibling's
    graph is built again from a copy of the representative's unflattened graph: still reused, and
    every record equals a full extraction's."""
    factory, prefix, expected, _ = MODELS["llama"]
    model = factory()
    ids = torch.randint(1, 100, (2, 7))
    monkeypatch.setattr(BuiltTemplate, "fits", lambda self, builder, fqn, source, *, invocation: False)
    reused, made = _built_from_templates(monkeypatch, model, ids)
    assert made == [] and _reused(reused) == expected
    assert_same_records(PatchableGraph(model, ids, options=FULL)._graph_module, reused._graph_module)
    assert torch.equal(reused(ids).logits, model(ids).logits)


def test_built_graph_fits_only_the_same_state_keys():
    """A representative's built graph fits a sibling whose invocation, and each call in it, has the
    representative's state keys."""
    template = BuiltTemplate(torch.fx.Graph(), {}, (TemplateCall("self_attn", "self_attn", 0, True),),
                             frozenset(), True)

    class Builder:
        def __init__(self, keys):
            self.keys = keys

        def state_keys(self, fqn, invocation):
            return self.keys.get((fqn, invocation), [])
    rep = {("layers.0", 0): ["cache"], ("layers.0.self_attn", 0): ["cache"]}
    assert template.fits(Builder({**rep, ("layers.1", 0): ["cache"], ("layers.1.self_attn", 0): ["cache"]}),
                         "layers.1", "layers.0", invocation=0)
    assert not template.fits(Builder({**rep, ("layers.1", 0): ["cache"]}), "layers.1", "layers.0",
                             invocation=0)  # the call's differ
    assert not template.fits(Builder({**rep, ("layers.1.self_attn", 0): ["cache"]}),
                             "layers.1", "layers.0", invocation=0)  # its own differ


@pytest.mark.no_extraction_cache
def test_a_sibling_child_taking_other_arguments_makes_the_extraction_export_every_layer(monkeypatch, caplog):
    """A sibling's child that takes its arguments otherwise than the representative's child (here:
    the representative's record says its extra arguments stayed) raises ReuseFallback: the
    extraction starts again with per-layer export, and the result equals eager."""
    factory, prefix, expected, _ = MODELS["gpt2"]
    model = factory()
    ids = torch.randint(1, 100, (2, 7))
    keep = GraphBuilder.keep_template

    def flipped(self, fqn, invocation, graph, *, made, **rest):
        return keep(self, fqn, invocation, graph,
                    made=[(node, dataclasses.replace(call, trimmed=not call.trimmed)) for node, call in made], **rest)
    monkeypatch.setattr(GraphBuilder, "keep_template", flipped)
    with caplog.at_level(logging.INFO, logger="nnbridge.dispatch.extraction"):
        pg = PatchableGraph(model, ids, use_cache=False, options=REUSE)
    assert "fell back" in caplog.text and "takes other arguments than" in caplog.text
    assert _reused(pg) == {}
    assert torch.equal(pg(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


@pytest.mark.no_extraction_cache  # a cache of its own: exports are counted
def test_cache_reuse_disk_cache_hit(tmp_path, monkeypatch, exports):
    """A second reused extraction of the same call is a disk-cache hit (no export) whose record
    carries the reuse plan: the same graphs, reuse markers, outputs and cache; a full extraction
    does not take the reused record (nor the reverse)."""
    monkeypatch.setenv("NNBRIDGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("NNBRIDGE_EXTRACTION_CACHE", raising=False)
    count = exports
    factory, prefix, expected, node = MODELS["gpt2"]
    model = factory()
    ids = torch.randint(1, 100, (2, 7))
    first = PatchableGraph(model, ids, options=REUSE)
    second = PatchableGraph(model, ids, options=REUSE)
    assert count[0] == 1
    assert _reused(first) == _reused(second) == expected
    a, b = _graphs(first), _graphs(second)
    assert list(a) == list(b) and all(a[name].code == b[name].code for name in a)
    eager = model(ids)
    out = second(ids)
    assert torch.equal(out.logits, eager.logits)
    _assert_same_cache(out.past_key_values, eager.past_key_values)
    full = PatchableGraph(model, ids, options=FULL)
    assert count[0] == 2 and _reused(full) == {}
    assert torch.equal(full(ids).logits, eager.logits)


def test_bridged_in_place_with_cache_reuses_every_extraction():
    """Bridged in place (each module gets its copy hook) with the default cache: the prefill and
    a decode step's extraction both reuse, and the model's outputs and cache equal eager's."""
    model = _three_layers(gpt2)()
    ids, step = torch.randint(1, 100, (1, 6)), torch.randint(1, 100, (1, 1))
    with torch.no_grad():
        eager = model(ids)
        eager_next = model(step, past_key_values=eager.past_key_values)
    nnbridge.bridge(model, ids, options=REUSE)
    try:
        with torch.no_grad():
            out = model(ids)
            nxt = model(step, past_key_values=out.past_key_values)
        roots = [e.root for e in bridge_of(model).dispatcher.all_extractions()]
    finally:
        nnbridge.unbridge(model)
    assert torch.equal(out.logits, eager.logits) and torch.equal(nxt.logits, eager_next.logits)
    _assert_same_cache(nxt.past_key_values, eager_next.past_key_values)
    expected = {"transformer.h.1": "transformer.h.0", "transformer.h.2": "transformer.h.0"}
    assert len(roots) >= 2
    for root in roots:
        assert {name: m.graph_meta.reused_from for name, m in root.named_modules()
                if isinstance(m, CompiledGraphModule) and m.graph_meta.reused_from} == expected


class _Toy(torch.nn.Module):
    def __init__(self, **layer_options):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(ToyIndexedLayer(i, **layer_options) for i in range(3))

    def forward(self, x, past_key_values):
        for layer in self.layers:
            x = layer(x, past_key_values)
        return x


def _toy_run(model, x, cache_factory, caplog):
    """(eager output and cache, bridged output and cache, reuse plan, log) for one call."""
    eager_cache, bridged_cache = cache_factory(), cache_factory()
    eager = model(x, eager_cache)
    with caplog.at_level(logging.INFO, logger="nnbridge.dispatch.extraction"):
        pg = PatchableGraph(model, x, cache_factory(), options=REUSE)
    out = pg(x, bridged_cache)
    assert torch.equal(out, eager)
    _assert_same_cache(bridged_cache, eager_cache)
    return _reused(pg), caplog.text


def test_toy_cache_layers_reused(caplog):
    x = torch.randn(2, 5, 8)
    reused, log = _toy_run(_Toy(), x, toy_layer_cache, caplog)
    assert reused == {"layers.1": "layers.0", "layers.2": "layers.0"}, log
    reused, log = _toy_run(_Toy(), x, lambda: toy_layer_cache([3, 3, 3]), caplog)  # a decode step
    assert reused == {"layers.1": "layers.0", "layers.2": "layers.0"}, log


def test_a_cache_update_taking_an_input_tensor_is_reused(caplog):
    """An update taking one of the layer's inputs besides keys and values (transformers 5.24 passes
    the attention's ``position_ids``): each sibling's update takes its own input, exactly."""
    reused, log = _toy_run(_Toy(extra="input"), torch.randn(2, 5, 8), toy_layer_cache, caplog)
    assert reused == {"layers.1": "layers.0", "layers.2": "layers.0"}, log


class SeenLayer(DynamicLayer):
    """A cache layer whose update adds the ``seen`` tensor it is given to the keys (module level:
    the cache pytree rebuilds it by its dotted path)."""

    def update(self, key_states, value_states, *args, kwargs=None, **more):
        return super().update(key_states + kwargs["seen"].unsqueeze(1), value_states, *args, **more)


def test_a_cache_layer_using_the_input_an_update_takes_sees_each_layers_own(caplog):
    """A cache layer whose update uses the extra tensor: each sibling's graph, copied from its
    representative's, writes with its own input (outputs and cache equal eager)."""
    def seen_cache():
        cache = toy_layer_cache()
        cache.layers = [SeenLayer() for _ in cache.layers]
        return cache
    torch.manual_seed(3)
    x = torch.randn(2, 5, 8)
    reused, log = _toy_run(_Toy(extra="input"), x, seen_cache, caplog)
    assert reused == {"layers.1": "layers.0", "layers.2": "layers.0"}, log


@pytest.mark.no_extraction_cache  # counts the root's export
def test_a_siblings_first_cache_update_leaves_one_export_node_per_tensor_it_writes(caplog, monkeypatch):
    """A sibling's first update of its (empty) cache layer runs the cache's own code out of the
    trace: the root's export holds, for each sibling, one ``sibling_zeros`` node per tensor the
    update wrote and one for its output (no lifted empty tensors, no ``cat``), and the bridged
    model still equals eager, outputs and cache."""
    from nnbridge.compat.torch.sibling_zeros import sibling_zeros
    from nnbridge.extract import exporting
    exported = []

    def spy(*args, **kwargs):
        exported.append(export(*args, **kwargs))
        return exported[-1]
    export = exporting.export
    monkeypatch.setattr(exporting, "export", spy)
    reused, log = _toy_run(_Toy(), torch.randn(2, 5, 8), toy_layer_cache, caplog)
    assert reused == {"layers.1": "layers.0", "layers.2": "layers.0"}, log
    [root] = exported
    for sibling in ("layers.1", "layers.2"):
        nodes = [n for n in root.graph.nodes
                 if any(path.endswith(sibling) for path, _ in (n.meta.get("nn_module_stack") or {}).values())]
        assert [n.target for n in nodes] == [sibling_zeros._opoverload] * 3, sibling  # keys, values, output


class _RaisingLayer(DynamicLayer):
    """A cache layer whose update writes its keys, then raises."""

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys, self.is_initialized = key_states, True
        raise ValueError("no update here")


def test_an_update_not_replayed_out_of_the_trace_leaves_the_cache_as_it_was():
    """A sibling's cache update is replayed out of the trace only on an empty layer and only when
    it assigns the layer's own tensors: otherwise (the layer holds tensors, or the update raises)
    the replay reports so and leaves the layer and the cache as they were (the update is then
    traced as it runs). Out of an export the replay runs on real tensors."""
    from nnbridge.extract.sibling_stubs import _StubInputs
    x = torch.randn(2, 5, 8)
    k = torch.randn(2, 1, 5, 8)
    inputs = _StubInputs("layers.0", [x], [x], [x])
    cache = toy_layer_cache()
    assert inputs._replayed_untraced(cache, 1, (k, k, (), {}))
    assert torch.equal(cache.layers[1].keys, torch.zeros(2, 1, 5, 8)) and cache.layers[1].is_initialized
    assert inputs.depends_on[1:] == [cache.layers[1].keys, cache.layers[1].values]
    held = toy_layer_cache([3, 3, 3])
    before = dict(vars(held.layers[1]))
    assert not inputs._replayed_untraced(held, 1, (k, k, (), {}))
    assert vars(held.layers[1]) == before
    raising = toy_layer_cache()
    raising.layers = [_RaisingLayer() for _ in raising.layers]
    before = dict(vars(raising.layers[1]))
    assert not inputs._replayed_untraced(raising, 1, (k, k, (), {}))
    assert vars(raising.layers[1]) == before and not raising.layers[1].is_initialized


def test_a_cache_update_taking_a_computed_tensor_falls_back(caplog):
    """An update taking a tensor the layer computed: a sibling's stub cannot make it, so every
    layer is exported (exactly)."""
    reused, log = _toy_run(_Toy(extra="computed"), torch.randn(2, 5, 8), toy_layer_cache, caplog)
    assert reused == {} and "takes tensors besides keys, values and its inputs" in log


def test_cache_index_used_in_arithmetic_falls_back(caplog):
    """``layer_idx + 1`` inside the layer: the index reaches the graph otherwise than through the
    cache update, every layer is exported."""
    reused, log = _toy_run(_Toy(scaled=True), torch.randn(2, 5, 8), toy_layer_cache, caplog)
    assert reused == {} and "layer_idx (__add__)" in log


def test_constant_cache_layer_read_falls_back(caplog):
    """Reading ``cache.layers[0].keys`` in every layer: representative 0's graph reads the same
    path as its own layer, which must not be rebound for the siblings."""
    reused, log = _toy_run(_Toy(peek=True), torch.randn(2, 5, 8), lambda: toy_layer_cache([3, 3, 3]), caplog)
    assert reused == {} and "outside Cache.update" in log


def test_lazily_appended_cache_not_reused(caplog):
    """A ``DynamicCache()`` without a config appends its layers as they are first written: each
    layer sees a cache of another length, every layer is exported (exactly)."""
    from transformers import DynamicCache
    reused, log = _toy_run(_Toy(), torch.randn(2, 5, 8), DynamicCache, caplog)
    assert reused == {}


def test_cache_layers_in_other_states_not_reused(caplog):
    """Cache layers of different lengths (layer 1 holds more tokens): the layers are not called
    alike, so they are not reused, and the result is exact."""
    reused, log = _toy_run(_Toy(), torch.randn(2, 5, 8), lambda: toy_layer_cache([3, 4, 3]), caplog)
    assert "layers.1" not in reused


def test_differing_attribute_read_falls_back(caplog):
    """GPT-2 built with ``scale_attn_by_inverse_layer_idx`` scales each layer's attention by its
    own ``scaling`` attribute, read while exporting: the layers differ, so every layer is exported
    (and the graphs stay exact)."""
    torch.manual_seed(0)
    model = type(gpt2())(type(gpt2().config)(n_layer=3, n_embd=64, n_head=4, vocab_size=100,
                                            attn_implementation="eager", scale_attn_by_inverse_layer_idx=True)).eval()
    ids = torch.randint(1, 100, (1, 6))
    with caplog.at_level(logging.INFO, logger="nnbridge.dispatch.extraction"):
        pg = PatchableGraph(model, ids, use_cache=False, options=REUSE)
    assert _reused(pg) == {}
    assert "scaling" in caplog.text
    assert torch.equal(pg(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


def test_in_place_op_point_hooks_per_layer():
    """Bridged in place with reuse, every layer's op points are its own: a torch hook on layer k's
    softmax changes the output exactly as with a full extraction."""
    ids = torch.randint(1, 100, (1, 6))
    results = {}
    for label, options in (("full", FULL), ("reuse", REUSE)):
        model = _three_layers(gpt2)()
        nnbridge.bridge(model, ids, use_cache=False, options=options)
        bridge = bridge_of(model)
        assert bridge is not None
        per_layer = []
        for i in range(3):
            point = model.get_submodule(f"transformer.h.{i}.attn.softmax")
            handle = point.register_forward_hook(lambda module, args, output: output * 0.5)
            try:
                per_layer.append(model(ids, use_cache=False).logits)
            finally:
                handle.remove()
        results[label] = per_layer
        nnbridge.unbridge(model)
    for a, b in zip(results["full"], results["reuse"]):
        assert torch.equal(a, b)
    assert not torch.equal(results["reuse"][1], results["reuse"][2])


def test_nnsight_envoys_per_layer():
    """nnsight envoys over a model bridged with reuse see and set each layer's own op values,
    exactly as over a fully extracted one."""
    ids = torch.randint(1, 100, (1, 6))
    results = {}
    for label, options in (("full", FULL), ("reuse", REUSE)):
        model = _three_layers(gpt2)()
        nnbridge.bridge(model, ids, use_cache=False, options=options)
        roots = [e.root for e in bridge_of(model).dispatcher.all_extractions()]
        reused = {name: m.graph_meta.reused_from for root in roots for name, m in root.named_modules()
                  if isinstance(m, CompiledGraphModule) and m.graph_meta.reused_from}
        wrapped = nnbridge.NNsight(model)
        with wrapped.trace(ids, use_cache=False):
            seen_0 = wrapped.transformer.h[0].attn.softmax.output.save()
            seen_1 = wrapped.transformer.h[1].attn.softmax.output.save()
            seen_2 = wrapped.transformer.h[2].attn.softmax.output.save()
            wrapped.transformer.h[2].attn.softmax.output[:] = 0
            logits = wrapped.lm_head.output.save()
        results[label] = ([seen_0, seen_1, seen_2], logits, reused)
        nnbridge.unbridge(model)
    (seen_full, logits_full, reused_full), (seen_reuse, logits_reuse, reused) = results["full"], results["reuse"]
    assert reused_full == {} and reused == {"transformer.h.1": "transformer.h.0", "transformer.h.2": "transformer.h.0"}
    for a, b in zip(seen_full, seen_reuse):
        assert torch.equal(a, b)
    assert torch.equal(logits_full, logits_reuse)


def test_other_sequence_length(case):
    """Dynamic shapes: the reused graphs serve another length exactly, as the full ones do."""
    model, ids, prefix, expected, node, full, reused = case
    other = torch.randint(1, 100, (2, 11))
    eager = model(other, use_cache=False).logits
    assert torch.equal(full(other, use_cache=False).logits, eager)
    assert torch.equal(reused(other, use_cache=False).logits, eager)
    assert len(full.extractions) == len(reused.extractions)


@pytest.mark.parametrize("factory", [gpt2, llama], ids=["gpt2", "llama"])
def test_a_fallback_whose_per_layer_export_fails_too_goes_on(factory):
    """``output_attentions=True``: the reusing export meets transformers' output collection and
    falls back; the per-layer export then fails the same way (the model runs its own code, its
    children are graphs), which must not be taken for the reuse fallback again."""
    model, reference = factory(), factory()
    ids = torch.randint(0, 100, (1, 8))
    nnbridge.bridge(model, ids, options=REUSE)
    out = model(ids, output_attentions=True)
    expected = reference(ids, output_attentions=True)
    assert torch.equal(out.logits, expected.logits)
    assert len(out.attentions) == len(expected.attentions)
    assert all(torch.equal(a, b) for a, b in zip(out.attentions, expected.attentions))


def test_decode_steps_of_a_deep_model_after_an_extraction_without_cache():
    """A 12-layer Llama extracted with ``use_cache=False``, then prefill and decode steps with a
    ``DynamicCache``. Export takes the cache length of a decode step from some layer's keys (here
    layer 7's, not the representative's own); the siblings must take it from their own layer,
    since the layers before them have already grown by the time they run. Before the fix, layers
    from 7 on raised a shape error in ``repeat_kv`` (a size from a later layer could as well have
    been silently wrong)."""
    from transformers import DynamicCache
    model = llama()
    config = type(model.config)(**{**model.config.to_dict(), "num_hidden_layers": 12})
    torch.manual_seed(0)
    model = type(model)(config).eval()
    torch.manual_seed(1)
    ids = torch.randint(1, 100, (1, 7))
    mask = torch.ones_like(ids)
    pg = PatchableGraph(model, input_ids=ids, attention_mask=mask, use_cache=False, options=REUSE)
    bridged_cache, eager_cache = DynamicCache(config=config), DynamicCache(config=config)
    with torch.no_grad():
        for step in range(3):
            out = pg(input_ids=ids, attention_mask=mask, past_key_values=bridged_cache, use_cache=True)
            expected = model(input_ids=ids, attention_mask=mask, past_key_values=eager_cache, use_cache=True)
            assert torch.equal(out.logits, expected.logits), step
            _assert_same_cache(bridged_cache, eager_cache)
            ids = expected.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(ids)], 1)
    layers = {f"model.layers.{i}": "model.layers.0" for i in range(1, 12)}
    assert [{k: v for k, v in r.items() if k.startswith("model.layers.")} for r in _reused_in(pg)] == [layers] * 3


def test_a_size_read_from_another_cache_layer_that_differs_falls_back():
    """Rebinding a sibling's graph: a size the representative's graph takes from another cache
    layer moves to the sibling's own layer only when, in the export, it equals the size of the
    representative's own layer; otherwise the graph cannot be rebound (per-layer export)."""
    from nnbridge.extract.cache_rebinding import rebind_cache_state
    from nnbridge.extract.reuse_plan import CacheRebinding, ReuseFallback
    from nnbridge.graph.state import read_state

    def graph(other_length: int) -> torch.fx.GraphModule:
        g = torch.fx.Graph()
        cache = g.placeholder("past_key_values")
        read = g.call_function(read_state, (cache, None, (("layers", (0,), "keys"), ("layers", (3,), "keys"))))
        own, other = (g.call_function(operator.getitem, (read, k)) for k in (0, 1))
        own.meta["val"], other.meta["val"] = torch.empty(1, 2, 5, 4), torch.empty(1, 2, other_length, 4)
        size = g.call_function(torch.ops.aten.sym_size.int, (other, 2))
        g.output(g.call_function(operator.add, (size, own)))
        return torch.fx.GraphModule(torch.nn.Module(), g)

    from transformers import DynamicCache
    spec = torch.utils._pytree.tree_flatten(DynamicCache())[1]
    rebinding = CacheRebinding(rep_index=0, index=2, rep_spec=spec, spec=spec)
    same = graph(5)
    rebind_cache_state(same, rebinding, "layers.2")
    read = next(n for n in same.graph.nodes if n.target is read_state)
    assert read.args[2] == (("layers", (2,), "keys"), ("layers", (2,), "keys"))
    with pytest.raises(ReuseFallback, match=r"'layers.2' reads or writes a cache layer other than its own"):
        rebind_cache_state(graph(6), rebinding, "layers.2")
    unused = graph(6)
    size = next(n for n in unused.graph.nodes if n.target is torch.ops.aten.sym_size.int)
    size.replace_all_uses_with(1)
    unused.graph.erase_node(size)
    rebind_cache_state(unused, rebinding, "layers.2")  # another layer read but unused: kept as it is
    read = next(n for n in unused.graph.nodes if n.target is read_state)
    assert read.args[2] == (("layers", (2,), "keys"), ("layers", (3,), "keys"))


def test_layers_of_a_model_wrapped_by_nnsight_first_are_reused():
    """The usual order: wrap (nnsight gives every module its own wrapping state), then trace.
    That per-module state is not an attribute that differs between layers: the whole-model
    extraction a ``tracer.cache(ops=True)`` needs reuses layer 0, and the cache equals nnsight's."""
    import nnsight
    ids = torch.randint(1, 100, (1, 6))
    model = _three_layers(gpt2)()
    wrapped, reference = nnbridge.NNsight(model), nnsight.NNsight(_three_layers(gpt2)())
    caches = []
    for wrapper in (wrapped, reference):
        with torch.no_grad(), wrapper.trace(ids) as tracer:
            caches.append(tracer.cache(ops=True) if wrapper is wrapped else tracer.cache())
    reused = {name: m.graph_meta.reused_from for d in bridge_of(model).dispatchers.values()
              for e in d.all_extractions() for name, m in e.root.named_modules()
              if isinstance(m, CompiledGraphModule) and m.graph_meta.reused_from}
    assert reused == {"transformer.h.1": "transformer.h.0", "transformer.h.2": "transformer.h.0"}
    bridged_cache, nnsight_cache = caches
    for i in range(3):
        assert torch.equal(bridged_cache[f"model.transformer.h.{i}"].output[0],
                           nnsight_cache[f"model.transformer.h.{i}"].output[0])
    assert torch.equal(bridged_cache["model.lm_head"].output, nnsight_cache["model.lm_head"].output)
    assert any(key.endswith("h.2.attn.softmax") for key in bridged_cache.keys())


def test_sibling_zeros_is_one_node_depending_on_every_input_and_passes_no_gradient():
    """The stand-in values of a sibling stub: zeros of the asked size and dtype, one export node
    that takes every input (so export keeps what only siblings read), no gradient through it."""
    from nnbridge.compat.torch.sibling_zeros import sibling_zeros

    class Stub(torch.nn.Module):
        def forward(self, x, mask):
            return sibling_zeros([x, mask], [x.shape[0], x.shape[1] + 1], torch.float64)

    x, mask = torch.randn(2, 5, requires_grad=True), torch.ones(5, dtype=torch.bool)
    made = Stub()(x, mask)
    assert torch.equal(made, torch.zeros(2, 6, dtype=torch.float64)) and made.device == x.device
    assert made.requires_grad
    (made.sum() + x.sum()).backward()
    assert torch.equal(x.grad, torch.ones_like(x)), "no gradient flows through the stand-in"
    exported = torch.export.export(Stub(), (x.detach(), mask), strict=False,
                                   dynamic_shapes=({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}, None))
    [node] = [n for n in exported.graph.nodes if n.op == "call_function" and n.target is sibling_zeros._opoverload]
    assert [str(a) for a in node.args[0]] == ["x", "mask"]
    # the two size reads, the size arithmetic (+ 1) and the node itself
    assert len([n for n in exported.graph.nodes if n.op == "call_function"]) == 4
    assert torch.equal(exported.module()(torch.ones(3, 7), mask), torch.zeros(3, 8, dtype=torch.float64))
