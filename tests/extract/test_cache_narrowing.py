"""Reused siblings exported with a stand-in cache holding only their own layer, and their parent's
graph widened back to the whole cache (nnbridge.extract.cache_narrowing, .cache_widening).

End to end: each sibling's preserved signature carries its own layer's keys and values only, and the
bridged model (outputs, caches, a decode step, a patch) equals eager for GPT-2, Llama and Gemma 3's
sliding and full layers. Unit level: the stand-in, its write-back and the spec arithmetic on a
transformers ``DynamicCache``, and every refusal (``ReuseFallback``).
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch.fx import Graph
from transformers import DynamicCache

import nnbridge
from nnbridge import ExtractionOptions, PatchableGraph, ZeroPatch
from nnbridge.compat.torch.export import register_cache_pytrees
from nnbridge.compat.torch.pytree import fx_pytree, pytree
from nnbridge.extract import exporting
from nnbridge.extract.cache_narrowing import MARK, narrowed_index, narrowed_spec, narrowing, stand_in, widened_spec
from nnbridge.extract.cache_widening import widen_narrowed_calls
from nnbridge.extract.reuse_plan import ReuseFallback
from utils import gemma3, gpt2, llama

REUSE = ExtractionOptions(reuse_layers=True)


def _deeper(factory, layers: int, **config):
    def make():
        model = factory()
        settings = model.config.to_dict()
        settings.update(config)
        settings["num_hidden_layers" if "num_hidden_layers" in settings else "n_layer"] = layers
        settings["attn_implementation"] = "eager"  # the softmax is an op (patched below)
        torch.manual_seed(0)
        return type(model)(type(model.config)(**settings)).eval()
    return make


MODELS = {  # (factory, layer prefix, cache index of each sibling that is expected to be reused)
    "gpt2": (_deeper(gpt2, 4), "transformer.h", {1: 1, 2: 2, 3: 3}),
    "llama": (_deeper(llama, 4), "model.layers", {1: 1, 2: 2, 3: 3}),
    "gemma3": (_deeper(gemma3, 5, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                               "full_attention", "sliding_attention"]),
               "model.layers", {2: 2, 3: 3, 4: 4}),
}


def _cache_parts(spec):
    """The custom-object subtrees (the cache) of a preserved signature's spec."""
    if spec.is_leaf():
        return []
    if spec.type not in (tuple, list, dict) and not issubclass(spec.type, (tuple, list, dict)):
        return [spec]
    return [part for child in spec.children() for part in _cache_parts(child)]


@pytest.mark.integration
@pytest.mark.no_extraction_cache
@pytest.mark.parametrize("name", list(MODELS))
def test_siblings_carry_only_their_own_cache_layer_and_the_model_equals_eager(monkeypatch, tmp_path, name):
    monkeypatch.setenv("NNBRIDGE_CACHE", str(tmp_path))
    factory, prefix, siblings = MODELS[name]
    model = factory()
    reference = factory()
    programs = []
    real = exporting.export

    def export(*args, **kwargs):
        programs.append(real(*args, **kwargs))
        return programs[-1]
    monkeypatch.setattr(exporting, "export", export)
    torch.manual_seed(1)
    ids = torch.randint(1, 100, (2, 7))
    pg = PatchableGraph(model, ids, options=REUSE)
    assert len(programs) == 1, "one export, with reuse"
    signatures = {entry.fqn: entry.signature for entry in programs[0].module_call_graph}
    for i, index in siblings.items():
        (cache,) = _cache_parts(signatures[f"model.{prefix}.{i}"].in_spec)
        assert narrowed_index(cache) == index
        whole = next(p for p in _cache_parts(signatures[f"model.{prefix}.0"].in_spec))
        assert narrowed_index(whole) is None
    with torch.no_grad():
        out, expected = pg(ids), reference(ids)
        assert torch.equal(out.logits, expected.logits)
        for a, b in zip(out.past_key_values.layers, expected.past_key_values.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        step = torch.randint(1, 100, (2, 1))
        after = pg(step, past_key_values=out.past_key_values).logits
        assert torch.equal(after, reference(step, past_key_values=expected.past_key_values).logits)
    last = max(siblings)
    owner, _, container = prefix.rpartition(".")
    node = f"{owner}.{container}_{last}.{'attn' if name == 'gpt2' else 'self_attn'}.softmax"
    with torch.no_grad(), pg.patch({node: ZeroPatch()}):
        patched = pg(ids).logits
    with torch.no_grad():
        eager = reference(ids).logits
    assert not torch.equal(patched, eager), "the patch of the last sibling's softmax changes the output"


# -- unit level -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cache():
    """A 3-layer DynamicCache whose layer 0 is written, with transformers' cache pytree registered."""
    register_cache_pytrees(llama())
    made = DynamicCache(config=llama().config)
    while len(made.layers) < 3:
        made.layers.append(type(made.layers[0])())
    made.update(torch.ones(1, 2, 3, 16), torch.ones(1, 2, 3, 16), 0)
    return made


def test_a_stand_in_keeps_one_layer_marked():
    made = DynamicCache(config=llama().config)
    narrow = stand_in(made, 1)
    assert narrow is not made and type(narrow) is DynamicCache
    assert narrow.layers == [None, made.layers[1]] and vars(narrow)[MARK] == 1
    assert len(made.layers) == 2 and MARK not in vars(made), "the cache itself is left as it was"
    assert stand_in(made, 2) is None and stand_in(made, -1) is None, "no such layer"
    assert stand_in(narrow, 1) is None, "a stand-in is not narrowed again"
    assert stand_in(torch.zeros(2), 0) is None and stand_in([1, 2], 0) is None


def test_the_write_back_fills_the_cache_and_keeps_its_layer_objects(cache):
    full = pytree.tree_unflatten(*pytree.tree_flatten(cache))
    layers = list(full.layers)
    narrow, write_back = narrowing({"layers.1": 1})("layers.1", full)
    assert narrowing({"layers.1": 1})("layers.2", full) is None, "only the paths given are narrowed"
    new = pytree.tree_unflatten(*pytree.tree_flatten(narrow))
    new.update(torch.full((1, 2, 3, 16), 2.0), torch.full((1, 2, 3, 16), 3.0), 1)
    write_back(new)
    assert [id(layer) for layer in full.layers] == [id(layer) for layer in layers]
    assert torch.equal(full.layers[1].keys, torch.full((1, 2, 3, 16), 2.0))
    assert torch.equal(full.layers[0].keys, torch.ones(1, 2, 3, 16)) and not full.layers[2].is_initialized
    assert MARK not in vars(full)


def test_a_write_back_of_a_stand_in_that_set_another_layer_falls_back(cache):
    full = pytree.tree_unflatten(*pytree.tree_flatten(cache))
    narrow, write_back = narrowing({"layers.1": 1})("layers.1", full)
    new = pytree.tree_unflatten(*pytree.tree_flatten(narrow))
    new.layers[2] = type(full.layers[2])()
    with pytest.raises(ReuseFallback, match="'layers.1' changed cache layers other than its own"):
        write_back(new)


def test_the_widened_spec_is_the_spec_of_the_cache_written_back(cache):
    before = pytree.tree_flatten(cache)[1]
    full = pytree.tree_unflatten(*pytree.tree_flatten(cache))
    narrow, write_back = narrowing({"x": 2})("x", full)
    new = pytree.tree_unflatten(*pytree.tree_flatten(narrow))
    new.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 2)
    stand_in_leaves, stand_in_spec = pytree.tree_flatten(new)
    assert narrowed_index(stand_in_spec) == 2 and narrowed_index(before) is None
    assert narrowed_spec(before, 2) == pytree.tree_flatten(narrow)[1]
    spec, origins = widened_spec(before, stand_in_spec)
    write_back(new)
    leaves, expected = pytree.tree_flatten(full)
    assert spec == expected
    old_leaves = pytree.tree_flatten(cache)[0]
    assert [(stand_in_leaves if ours else old_leaves)[k] is leaf for (ours, k), leaf in zip(origins, leaves)] \
        == [True] * len(leaves)


def test_a_spec_that_is_not_a_stand_ins_is_not_widened(cache):
    before = pytree.tree_flatten(cache)[1]
    with pytest.raises(ReuseFallback, match="stand-in changed other layers"):
        widened_spec(before, before)


def _graph(*specs):
    graph = Graph()
    attrs = {}
    nodes = []
    for i, spec in enumerate(specs):
        attrs[f"_spec_{i}"] = spec
        nodes.append(graph.get_attr(f"_spec_{i}"))
    return graph, attrs, nodes


def test_a_stand_in_rebuilt_before_the_graph_holds_the_cache_falls_back(cache):
    narrow = narrowed_spec(pytree.tree_flatten(cache)[1], 1)
    graph, attrs, (spec,) = _graph(narrow)
    leaves = [graph.placeholder(f"x{i}") for i in range(narrow.num_leaves)]
    graph.output(graph.call_function(pytree.tree_unflatten, (leaves, spec)))
    with pytest.raises(ReuseFallback, match="made from a cache in another state"):
        widen_narrowed_calls(graph, attrs)


def test_a_stand_in_of_a_cache_in_another_state_falls_back(cache):
    empty = DynamicCache(config=llama().config)
    whole, narrow = pytree.tree_flatten(empty)[1], narrowed_spec(pytree.tree_flatten(cache)[1], 1)
    graph, attrs, (first, second) = _graph(whole, narrow)
    held = graph.call_function(pytree.tree_unflatten, ([], first))
    leaves = [graph.placeholder(f"x{i}") for i in range(narrow.num_leaves)]
    graph.output((held, graph.call_function(pytree.tree_unflatten, (leaves, second))))
    with pytest.raises(ReuseFallback, match="made from a cache in another state"):
        widen_narrowed_calls(graph, attrs)


@pytest.mark.parametrize("second", ["stand-in", "whole"])
def test_a_cache_rebuilt_from_other_values_than_its_newest_falls_back(cache, second):
    """Widening gives a rebuild the newest leaves only where they hold the values it was given."""
    whole = pytree.tree_flatten(cache)[1]
    narrow = narrowed_spec(whole, 0)
    graph, attrs, (first, other) = _graph(whole, narrow if second == "stand-in" else whole)
    attrs["_spec_9"] = narrow  # the graph holds a stand-in's spec: it is widened
    held = graph.call_function(pytree.tree_unflatten, ([graph.placeholder("k"), graph.placeholder("v")], first))
    again = graph.call_function(pytree.tree_unflatten, ([graph.placeholder("k2"), graph.placeholder("v2")], other))
    graph.output((held, again))
    with pytest.raises(ReuseFallback, match="rebuilt from values other than its layers' newest"):
        widen_narrowed_calls(graph, attrs)


def test_a_stand_ins_output_read_otherwise_than_by_getitem_falls_back(cache):
    whole = pytree.tree_flatten(cache)[1]
    narrow = narrowed_spec(whole, 1)
    graph, attrs, (first, second) = _graph(whole, narrow)
    x = graph.placeholder("x")
    held = graph.call_function(pytree.tree_unflatten, ([graph.placeholder("k"), graph.placeholder("v")], first))
    flat = graph.call_function(fx_pytree.tree_flatten_spec, (x, second))
    graph.output((held, flat, graph.call_function(operator.getitem, (flat, 0))))
    with pytest.raises(ReuseFallback, match="read otherwise than by getitem"):
        widen_narrowed_calls(graph, attrs)


def test_a_graph_without_stand_ins_is_left_as_it_is(cache):
    graph, attrs, (spec,) = _graph(pytree.tree_flatten(cache)[1])
    leaves = [graph.placeholder("k"), graph.placeholder("v")]
    graph.output(graph.call_function(pytree.tree_unflatten, (leaves, spec)))
    before = str(graph)
    widen_narrowed_calls(graph, attrs)
    assert str(graph) == before


def test_bridge_with_narrowed_siblings_keeps_reading_every_layer():
    """A bridged deep model (the default path: reuse with the cache) generates as eager does."""
    model, reference = _deeper(llama, 6)(), _deeper(llama, 6)()
    ids = torch.randint(1, 100, (1, 5))
    nnbridge.bridge(model, ids)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(out, reference.generate(ids, max_new_tokens=4, do_sample=False))
