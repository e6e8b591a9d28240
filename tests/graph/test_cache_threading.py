"""Cache threading in linear time: each bridged module call reads and writes only the parts of a
``DynamicCache`` it uses or changes (:func:`nnbridge.graph.state.write_state`), and the cache
afterwards equals eager's, object for object."""

import copy
import operator
from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import nnbridge
from nnbridge import CompiledGraphModule
from nnbridge.inplace.bridging import bridge_of
from nnbridge.graph.state import SpecCheck, assign_state, read_state, write_state
from nnbridge.extract.state_graphs import drop_unused_reads
from nnbridge.compat.torch.pytree import pytree
from utils import CACHE_KWARG, ToyCacheStack


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=2, attn_implementation="eager")).eval()


def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                        attn_implementation="eager")).eval()


MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def attentions(model):
    layers = model.transformer.h if isinstance(model, GPT2LMHeadModel) else model.model.layers
    return [layer.attn if isinstance(model, GPT2LMHeadModel) else layer.self_attn for layer in layers]


def pair(name):
    """``(untouched model, bridged copy, prompt ids)``."""
    plain = MODELS[name]()
    ids = torch.randint(0, 100, (1, 7))
    bridged = nnbridge.bridge(copy.deepcopy(plain), ids)
    return plain, bridged, ids


def assert_same_cache(got, want):
    assert type(got) is type(want) and len(got.layers) == len(want.layers)
    for mine, theirs in zip(got.layers, want.layers):
        assert type(mine) is type(theirs)
        assert vars(mine).keys() == vars(theirs).keys()
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
        assert (mine.is_initialized, mine.keys.dtype, mine.device) == (theirs.is_initialized, theirs.keys.dtype,
                                                                         theirs.device)


@pytest.mark.parametrize("name", MODELS)
def test_cache_after_one_forward_equals_eager(name):
    plain, bridged, ids = pair(name)
    with torch.no_grad():
        want, got = plain(ids), bridged(ids)
    assert torch.equal(got.logits, want.logits)
    assert_same_cache(got.past_key_values, want.past_key_values)


@pytest.mark.parametrize("name", MODELS)
def test_cache_after_three_decode_steps_equals_eager_and_keeps_its_objects(name):
    plain, bridged, ids = pair(name)
    with torch.no_grad():
        want, got = plain(ids).past_key_values, bridged(ids).past_key_values
        layer_objects = list(got.layers)
        for step in range(3):
            token = torch.randint(0, 100, (1, 1))
            out, ref = bridged(token, past_key_values=got), plain(token, past_key_values=want)
            assert out.past_key_values is got and torch.equal(out.logits, ref.logits)
            assert_same_cache(got, want)
    assert all(a is b for a, b in zip(got.layers, layer_objects))


@pytest.mark.parametrize("name", MODELS)
def test_each_attention_call_changes_only_its_own_cache_layer(name):
    """Every value in every other layer's ``__dict__`` is the very same object after the call."""
    plain, bridged, ids = pair(name)
    changed: list[tuple[int, list[int]]] = []
    snapshots = {}

    def before(index):
        def hook(module, args, kwargs):
            cache = kwargs[CACHE_KWARG]
            snapshots[index] = [dict(vars(layer)) for layer in cache.layers]
        return hook

    def after(index):
        def hook(module, args, kwargs, output):
            cache = kwargs[CACHE_KWARG]
            now = [vars(layer) for layer in cache.layers]
            touched = [i for i, (old, new) in enumerate(zip(snapshots[index], now))
                       if old.keys() != new.keys() or any(old[k] is not new[k] for k in old)]
            changed.append((index, touched))
        return hook

    handles = []
    for i, attention in enumerate(attentions(bridged)):
        handles.append(attention.register_forward_pre_hook(before(i), with_kwargs=True))
        handles.append(attention.register_forward_hook(after(i), with_kwargs=True))
    with torch.no_grad():
        cache = bridged(ids).past_key_values
        bridged(torch.randint(0, 100, (1, 1)), past_key_values=cache)
    for handle in handles:
        handle.remove()
    assert changed == [(i, [i]) for i in range(3)] * 2


@pytest.mark.parametrize("name", MODELS)
def test_graphs_write_only_their_layer_and_never_the_whole_cache(name):
    _, bridged, _ = pair(name)
    writes = {}
    graphs, seen = [bridge_of(bridged).dispatcher.all_extractions()[0].root], []
    while graphs:
        graph = graphs.pop()
        seen.append(graph)
        graphs += list((graph.graph_meta.graph_children or {}).values())
    for graph in seen:
        if not isinstance(graph, CompiledGraphModule):
            continue  # an opaque module (Llama's rotary embedding) has no graph
        for node in graph.graph.nodes:
            assert node.target is not assign_state, graph.code
            if node.target is write_state:
                _, _, deleted, paths, _ = node.args
                writes.setdefault(id(graph), set()).update(path[:2] for path in (*deleted, *paths))
    assert sorted(map(sorted, writes.values())) == [[("layers", (i,))] for i in range(3)]


def test_spec_check_remembers_structures_and_still_refuses_other_ones():
    model = tiny_gpt2()
    nnbridge.bridge(model, torch.randint(0, 100, (1, 4)))  # registers the cache pytrees
    with torch.no_grad():
        cache = model(torch.randint(0, 100, (1, 4))).past_key_values
        other = model(torch.randint(0, 100, (1, 4))).past_key_values
    check = SpecCheck(pytree.tree_flatten(cache)[1])
    assert check(cache) and len(check.held) == 1
    assert check(other) and len(check.held) == 1  # same structure, other tensors
    cache.layers[1].is_initialized = False
    assert not check(cache)
    del cache.layers[2].device
    assert not check(cache)


# -- the cache layers each graph compares before a call (what its code touched while exported) ---
def _untouched(model):
    root = bridge_of(model).dispatcher.all_extractions()[0].root
    return {name: m.graph_meta.untouched for name, m in root.named_modules() if isinstance(m, CompiledGraphModule)}


@pytest.mark.parametrize("reuse", [True, False], ids=["reused", "every layer exported"])
@pytest.mark.parametrize("name", MODELS)
def test_each_attention_compares_its_own_cache_layer_and_what_its_code_touched(name, reuse):
    """An attention's code touches its own cache layer (``Cache.update``); a decoder layer's code
    touches none (export flattening the cache for the attention's call is not its code)."""
    model = MODELS[name]()
    ids = torch.randint(0, 100, (1, 5))
    nnbridge.bridge(model, ids, options=nnbridge.ExtractionOptions(reuse_layers=reuse))
    untouched = _untouched(model)
    every = {("layers", (i,)) for i in range(3)}
    for i, attention in enumerate(attentions(model)):
        path = next(p for p, m in model.named_modules() if m is attention)
        assert untouched[path] == every - {("layers", (i,))}
        assert untouched[path.rpartition(".")[0]] == every  # the decoder layer (reused: as its representative)


class NormedAgain(LlamaDecoderLayer):
    """A decoder layer whose last call is a second call of a child (module level: code identity)."""

    def forward(self, hidden_states, *args, **kwargs):
        return self.post_attention_layernorm(super().forward(hidden_states, *args, **kwargs))


@pytest.mark.parametrize("reuse", [True, False], ids=["reused", "every layer exported"])
def test_a_layer_whose_last_call_is_a_childs_second_compares_what_its_own_code_touched(reuse):
    """A graph's untouched cache layers are those of its own invocation, not of the invocation of
    the last child it calls (here the second call of ``post_attention_layernorm``: invocation 1 of
    a layer called once, which once made the layer compare every cache layer)."""
    model = tiny_llama()
    for layer in model.model.layers:
        layer.__class__ = NormedAgain
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 100, (1, 5))
    nnbridge.bridge(model, ids, options=nnbridge.ExtractionOptions(reuse_layers=reuse))
    untouched = _untouched(model)
    every = {("layers", (i,)) for i in range(3)}
    for i, layer in enumerate(model.model.layers):
        assert untouched[f"model.layers.{i}"] == every
        assert untouched[f"model.layers.{i}.self_attn"] == every - {("layers", (i,))}
    with torch.no_grad():
        out, expected = model(ids), plain(ids)
    assert torch.equal(out.logits, expected.logits)
    assert_same_cache(out.past_key_values, expected.past_key_values)



def _state_reads(model):
    """``[(graph module path, graph, {cache layer paths its read_state nodes read})]`` over every
    extraction, for the graphs that read a cache."""
    reads = []
    for extraction in bridge_of(model).dispatcher.all_extractions():
        for name, graph in extraction.root.named_modules():
            if isinstance(graph, CompiledGraphModule):
                layers = {path[:2] for node in graph.graph.nodes if node.target is read_state for path in node.args[2]}
                if layers:
                    reads.append((name, graph, layers))
    return reads


@pytest.mark.parametrize("reuse", [True, False], ids=["reused", "every layer exported"])
@pytest.mark.parametrize("name", MODELS)
def test_a_decode_steps_attention_reads_only_its_own_cache_layer_and_checks_the_others_by_type(name, reuse):
    """Export reads every leaf of a cache argument; a decode step's attention graph uses its own
    layer's keys and values only, so it reads only those (:func:`drop_unused_reads`) and its cache
    check compares the other layers by type alone (before: every layer in full, ``O(L^2)`` per step).
    Logits and the cache after each step equal eager's."""
    plain = MODELS[name]()
    model = copy.deepcopy(plain)
    ids = torch.randint(0, 100, (1, 5))
    nnbridge.bridge(model, ids, options=nnbridge.ExtractionOptions(reuse_layers=reuse))
    with torch.no_grad():
        want, got = plain(ids).past_key_values, model(ids).past_key_values
        for step in range(2):
            token = torch.randint(0, 100, (1, 1))
            ref, out = plain(token, past_key_values=want), model(token, past_key_values=got)
            assert torch.equal(out.logits, ref.logits)
            assert_same_cache(got, want)
    every = {("layers", (i,)) for i in range(3)}
    paths = [next(p for p, m in model.named_modules() if m is attention) for attention in attentions(model)]
    decode = [(path, graph, layers) for path, graph, layers in _state_reads(model) if path in paths]
    assert len(decode) == 3  # the decode structure's attentions (prefill's have no cache argument)
    for path, graph, layers in decode:
        own = ("layers", (paths.index(path),))
        assert layers == {own}
        assert [check.untouched for _, check in graph.graph_meta.state_specs] == [frozenset(every - {own})]


def test_drop_unused_reads_keeps_the_used_paths_in_order_and_renumbers_their_readers():
    graph = torch.fx.Graph()
    cache = graph.placeholder("cache")
    paths = tuple(("layers", (i,), "keys") for i in range(4))
    read = graph.call_function(read_state, (cache, None, paths))
    third, first = graph.call_function(operator.getitem, (read, 3)), graph.call_function(operator.getitem, (read, 1))
    whole = graph.call_function(read_state, (cache, None, paths))  # read as a whole: left as it is
    graph.output((third, first, whole))
    drop_unused_reads(graph)
    assert read.args[2] == (paths[1], paths[3]) and third.args == (read, 1) and first.args == (read, 0)
    assert whole.args[2] == paths
    layers = [SimpleNamespace(keys=torch.full((1,), float(i))) for i in range(4)]
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    got = module(SimpleNamespace(layers=layers))
    assert got[0] is layers[3].keys and got[1] is layers[1].keys and len(got[2]) == 4

def test_spec_check_with_untouched_layers_compares_them_by_type_only():
    model = tiny_gpt2()
    nnbridge.bridge(model, torch.randint(0, 100, (1, 4)))  # registers the cache pytrees
    with torch.no_grad():
        cache = model(torch.randint(0, 100, (1, 4))).past_key_values
    check = SpecCheck(pytree.tree_flatten(cache)[1], untouched=frozenset({("layers", (0,)), ("layers", (2,))}))
    assert check(cache)
    cache.layers[0].is_initialized = False
    del cache.layers[2].device
    assert check(cache)  # layers 0 and 2: type only
    cache.layers[1].is_initialized = False
    assert not check(cache)  # layer 1 is compared
    cache.layers[1].is_initialized = True
    cache.layers[0] = object()
    assert not check(cache)  # another type
    cache.layers[0] = cache.layers[1]
    cache.layers.append(cache.layers[1])
    assert not check(cache)  # another number of layers


class Watching(DynamicLayer):
    """A cache layer whose class defines ``__getattribute__`` (module level: the cache pytree
    rebuilds it by its dotted path)."""

    def __getattribute__(self, name):
        return super().__getattribute__(name)


def test_a_cache_layer_class_that_overrides_getattribute_is_compared_in_full():
    """Touches of a layer whose class defines ``__getattribute__`` cannot be seen: nothing is
    assumed untouched, and every layer is compared (as before a skip could be told apart)."""
    model = tiny_gpt2()
    ids = torch.randint(0, 100, (1, 5))
    cache = DynamicCache()
    cache.layers = [Watching() for _ in range(3)]
    cache.layer_class_to_replicate = None
    reference = copy.deepcopy(cache)
    nnbridge.bridge(model, ids, past_key_values=cache, use_cache=True)
    assert all(u is None for path, u in _untouched(model).items() if path.endswith("attn"))
    plain, mine = tiny_gpt2(), copy.deepcopy(reference)
    with torch.no_grad():
        expected = plain(ids, past_key_values=reference, use_cache=True).logits
        assert torch.equal(model(ids, past_key_values=mine, use_cache=True).logits, expected)
    assert_same_cache(mine, reference)


@pytest.mark.no_extraction_cache
def test_a_cache_write_nothing_reads_is_kept_as_eager_keeps_it():
    """A layer writes values into its cache layer that nothing reads afterwards: the graph keeps
    the write (torch's dead-code pass is skipped for a program without effect tokens), so each
    layer's graph, called with a cache, leaves the keys and values eager leaves."""
    torch.manual_seed(0)
    model = ToyCacheStack(2, use_values=False)
    plain, x = copy.deepcopy(model), torch.randn(2, 3, 4)
    nnbridge.bridge(model, x)
    root = bridge_of(model).dispatcher.all_extractions()[0].root
    assert all(isinstance(root.get_submodule(f"layers.{i}"), CompiledGraphModule) for i in range(2))  # graphs
    assert torch.equal(model(x), plain(x))
    for i in range(2):
        mine, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
        assert torch.equal(model.layers[i](x, past_key_values=mine), plain.layers[i](x, past_key_values=theirs))
        assert [layer.is_initialized for layer in mine.layers] == [layer.is_initialized for layer in theirs.layers]
        assert torch.equal(mine.layers[i].keys, theirs.layers[i].keys)
        assert torch.equal(mine.layers[i].values, theirs.layers[i].values)


@pytest.mark.no_extraction_cache
def test_a_cache_write_torch_drops_is_refused_when_extracting(monkeypatch):
    """Where torch's token pass runs (a program with effect tokens, forced here), it drops a written
    tensor nothing reads; the graph would leave None in the cache where eager leaves the tensor, so
    extraction raises, naming the module."""
    from nnbridge.compat.torch import export as torch_export

    monkeypatch.setattr(torch_export, "_has_effect_tokens", lambda exported: True)
    model = ToyCacheStack(2, use_values=False)
    with pytest.raises(nnbridge.ExtractionError, match=r"'layers\.0' writes a tensor into its state argument"):
        nnbridge.bridge(model, torch.ones(2, 3, 4))
    assert bridge_of(model) is None  # nothing left half-bridged
    assert torch.equal(model(torch.ones(2, 3, 4)), ToyCacheStack.forward(model, torch.ones(2, 3, 4)))