"""transformers' default ``use_cache=True``: modules that receive a ``DynamicCache`` keep their real
call signature and output; one cache object flows through a forward and is updated in place."""

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import nnbridge
from nnbridge import ExtractionOptions, PatchableGraph, ProbePatch
from nnbridge.inplace.bridging import bridge_of
from nnbridge.graph.state import assign_state
from utils import CACHE_KWARG, assert_same, cached, gpt2, llama

# cache off: each test extracts for itself, whatever order xdist runs the files in (the key tells these
# llama extractions apart: with the cache on all tests passed, 2026-11-24)
pytestmark = [pytest.mark.no_extraction_cache,
              pytest.mark.integration]  # end to end: whole models with caches, every call recorded

MODELS = {"gpt2": gpt2, "llama": llama}


def cache_modules(name, model):
    """Decoder layer 0 and its attention: the modules a cache is passed to."""
    if name == "gpt2":
        return {"layer": model.transformer.h[0], "attention": model.transformer.h[0].attn}
    return {"layer": model.model.layers[0], "attention": model.model.layers[0].self_attn}


def record_calls(name, model):
    """Hooks recording ``(args, kwargs, output)`` of each cache-receiving module."""
    calls, handles = {}, []

    def recorder(key):
        def hook(module, args, kwargs, output):
            calls.setdefault(key, (args, dict(kwargs), output))
        return hook
    for key, module in cache_modules(name, model).items():
        handles.append(module.register_forward_hook(recorder(key), with_kwargs=True))
    return calls, handles


def same_call(got, want):
    """Same positional and keyword structure; tensors equal; caches of the same type and state."""
    (args, kwargs, out), (ref_args, ref_kwargs, ref_out) = got, want
    assert len(args) == len(ref_args) and list(kwargs) == list(ref_kwargs)
    for a, b in zip([*args, *kwargs.values()], [*ref_args, *ref_kwargs.values()]):
        assert type(a) is type(b)
        if isinstance(b, DynamicCache):
            assert_same(cached(a), cached(b))
        else:
            assert_same(a, b)
    assert_same(out, ref_out)


@pytest.mark.parametrize("name", list(MODELS))
def test_hooks_on_cache_modules_see_the_eager_call(name):
    ids = torch.randint(1, 100, (1, 6))
    eager = MODELS[name]()
    expected, handles = record_calls(name, eager)
    reference = eager(ids)  # use_cache defaults to True
    for h in handles:
        h.remove()
    model = MODELS[name]()
    nnbridge.bridge(model, ids)
    got, handles = record_calls(name, model)
    output = model(ids)
    for h in handles:
        h.remove()
    assert set(got) == {"layer", "attention"}
    for key in got:
        same_call(got[key], expected[key])
    assert_same(output.logits, reference.logits)
    assert_same(cached(output.past_key_values), cached(reference.past_key_values))
    nnbridge.unbridge(model)


@pytest.mark.parametrize("name", list(MODELS))
def test_one_cache_object_flows_through_a_forward(name):
    """As in eager: every decoder layer gets the very object the model returns."""
    ids = torch.randint(1, 100, (1, 6))
    for bridged in (False, True):
        model = MODELS[name]()
        if bridged:
            nnbridge.bridge(model, ids)
        layers = model.transformer.h if name == "gpt2" else model.model.layers
        seen = []
        handles = [layer.register_forward_pre_hook(
            lambda m, a, k: seen.append(k.get(CACHE_KWARG, a[1] if len(a) > 1 else None)), with_kwargs=True)
            for layer in layers]
        output = model(ids)
        for h in handles:
            h.remove()
        assert len(seen) == 2 and all(cache is output.past_key_values for cache in seen), f"bridged={bridged}"


@pytest.mark.parametrize("keyword", sorted({"past_key_values", CACHE_KWARG}))  # 5.24 adds ``cache=``
@pytest.mark.parametrize("name", list(MODELS))
def test_cache_passed_in_is_updated_in_place_over_decode_steps(name, keyword):
    prompt, steps = torch.randint(1, 100, (1, 5)), torch.randint(1, 100, (3, 1, 1))
    results = []
    for bridged in (False, True):
        model = MODELS[name]()
        if bridged:
            nnbridge.bridge(model, prompt, **{keyword: DynamicCache(config=model.config)}, use_cache=True)
        cache = DynamicCache(config=model.config)
        logits = [model(prompt, **{keyword: cache}, use_cache=True).logits]
        for token in steps:
            output = model(token, **{keyword: cache}, use_cache=True)
            assert output.past_key_values is cache, f"bridged={bridged}: the caller's object is the output"
            logits.append(output.logits)
        results.append((logits, cached(cache)))
        if bridged:
            assert len(bridge_of(model).dispatcher.extractions) == 2, "prefill and decode structures"
    assert_same(results[1], results[0])


@pytest.mark.parametrize("name", list(MODELS))
def test_patchable_graph_with_cache_and_cache_ops_reachable(name):
    model = MODELS[name]()
    ids = torch.randint(1, 100, (1, 6))
    pg = PatchableGraph(model, ids)
    reference = model(ids)
    output = pg(ids)
    assert_same(output.logits, reference.logits)
    assert_same(cached(output.past_key_values), cached(reference.past_key_values))
    # the cache update's concatenations are ops (Llama's first two cats are rotate_half's)
    attention, keys, values = (("transformer.h_0.attn", "cat", "cat_1") if name == "gpt2"
                               else ("model.layers_0.self_attn", "cat_2", "cat_3"))
    probes = {keys: ProbePatch(), values: ProbePatch()}
    with pg.patch({f"{attention}.{op}": probe for op, probe in probes.items()}):
        pg(ids)
    assert torch.equal(probes[keys].activation, reference.past_key_values.layers[0].keys)
    assert torch.equal(probes[values].activation, reference.past_key_values.layers[0].values)


def test_opaque_decoder_layer_with_cache():
    """A cache-receiving module that falls back to opaque keeps the cache exact."""
    model = llama()
    ids = torch.randint(1, 100, (1, 6))
    pg = PatchableGraph(model, ids, options=ExtractionOptions(
        classes_to_skip_compiling={LlamaDecoderLayer}, warn_on_compilation_failure=False))
    assert any(path.startswith("model.layers") for path in pg.extractions[0].opaque)
    reference = model(ids)
    output = pg(ids)
    assert_same(output.logits, reference.logits)
    assert_same(cached(output.past_key_values), cached(reference.past_key_values))


def test_assign_state_keeps_identity_and_refuses_other_types():
    cache, other = DynamicCache(), DynamicCache()
    keys, values = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    cache.update(keys, values, 0)
    other.update(keys * 2, values * 2, 0)
    layer = cache.layers[0]
    assign_state(cache, other)
    assert cache.layers[0] is layer, "the layer objects the cache holds stay the same objects"
    assert torch.equal(cache.layers[0].keys, keys * 2)
    with pytest.raises(TypeError, match="cannot copy the state of a dict into a DynamicCache"):
        assign_state(cache, {})


class _Branchy(torch.nn.Module):
    """Updates a cache, then branches on data (torch.export cannot trace that)."""

    def __init__(self, index):
        super().__init__()
        self.index = index
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, cache):
        keys, _ = cache.update(x.unsqueeze(1), x.unsqueeze(1), self.index)
        out = self.proj(keys.sum(2))
        return out * 2 if out.sum() > 0 else out


class _Block(torch.nn.Module):
    def __init__(self, index):
        super().__init__()
        self.inner = _Branchy(index)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x, cache):
        return self.norm(x + self.inner(x, cache))


class _CacheModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(0), _Block(1)])

    def forward(self, x, cache):
        for block in self.blocks:
            x = block(x, cache)
        return x


def test_unexportable_module_with_a_cache_makes_its_callers_opaque():
    """A stub cannot write the cache state a failing module would have: its callers fall back to
    opaque (children still extracted), and values and the cache stay exact."""
    model = _CacheModel().eval()
    x = torch.randn(1, 4, 8)
    pg = PatchableGraph(model, x, DynamicCache(), options=ExtractionOptions(warn_on_compilation_failure=False))
    assert set(pg.extractions[0].opaque) >= {"<root>", "blocks.0", "blocks.0.inner"}
    for steps in (4, 1):  # a prompt, then one more position on the same cache
        eager_cache, graph_cache = DynamicCache(), DynamicCache()
        y = torch.randn(1, steps, 8)
        assert_same(pg(y, graph_cache), model(y, eager_cache))
        assert_same(cached(graph_cache), cached(eager_cache))
    probe = ProbePatch()
    with pg.patch({"blocks_0.inner.proj.linear": probe}):
        pg(x, DynamicCache())
    assert probe.activation.shape == (1, 1, 8)


def test_write_states_back_refuses_a_graph_without_threaded_output():
    from nnbridge import ExtractionError
    from nnbridge.extract.state_graphs import write_states_back

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.relu, (x,)))
    with pytest.raises(ExtractionError, match=r"no \(output, \[states\]\) graph output"):
        write_states_back(graph, {}, ["past_key_values"])


def test_plain_container_decides_as_the_flattened_spec_does():
    """``plain_container`` (which call arguments are state) decides a leaf or a registered container of
    another kind without flattening it: the same answer as walking the whole flattened spec, with
    transformers' cache pytrees registered (as extraction registers them) and without."""
    from collections import namedtuple

    from transformers.modeling_outputs import BaseModelOutputWithPast

    from nnbridge.graph.state import plain_container, simple_spec
    from nnbridge.compat.torch.export import register_cache_pytrees
    from nnbridge.compat.torch.pytree import pytree, registered_class

    def flattened(value):
        return simple_spec(pytree.tree_flatten(value)[1], subclasses=True)

    pair = namedtuple("pair", "a b")
    cache = DynamicCache()
    for i in range(3):
        cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), i)
    values = [torch.ones(2), None, 3, "x", torch.float32, torch.Size([1, 2]), (torch.ones(1), None),
              [1, {"a": torch.ones(1)}], pair(1, torch.ones(1)), BaseModelOutputWithPast(last_hidden_state=torch.ones(1)),
              cache, (cache,), {"past": cache}, [pair(cache, 1)], DynamicCache()]
    unregistered = [plain_container(v) for v in values]
    assert unregistered == [flattened(v) for v in values]
    register_cache_pytrees(llama())
    assert registered_class(cache) is DynamicCache and registered_class(pair(1, 2)) is None
    assert registered_class(torch.ones(1)) is None and registered_class((1,)) is tuple
    registered = [plain_container(v) for v in values]
    assert registered == [flattened(v) for v in values]
    assert registered[10:] == [False] * 5 and all(registered[:10])
