"""A transformers ``Cache`` argument is exported with duck-sized dimensions (equal sizes share one
symbol, see ``nnbridge.compat.torch.duck_sizing``): the export of a layer called with many filled cache
layers stays as cheap as with one, and a call whose cache layers no longer have equal sizes is
extracted again rather than served by a graph that assumed they were."""

import copy

import torch
from transformers import DynamicCache

import nnbridge
from nnbridge.inplace.bridging import bridge_of
from nnbridge.guards.call_structure import tensor_leaves
from utils import assert_same, cached, llama


def filled_cache(lengths, heads=2, head_dim=4, seed=0):
    """A DynamicCache whose layer ``i`` holds keys and values of ``lengths[i]`` positions."""
    generator = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for index, length in enumerate(lengths):
        cache.update(torch.randn(1, heads, length, head_dim, generator=generator),
                     torch.randn(1, heads, length, head_dim, generator=generator), index)
    return cache


class ReadsAnotherLayersLength(torch.nn.Module):
    """Sums layer 0's keys up to layer 1's length: with both lengths one symbol, the slice is the
    whole tensor (and the length may be read off layer 0), so a graph reused for a longer layer 0
    would sum all of its keys."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, past_key_values):
        length = past_key_values.layers[1].keys.shape[-2]
        return self.proj(x) + past_key_values.layers[0].keys[:, :, :length, :].sum()


def cache_symbols(extraction, call):
    """The symbol names of the guard's dynamic dimensions of the call's cache tensors."""
    leaves = tensor_leaves(*call)
    cache_ids = {id(t) for t in cached(call[1]["past_key_values"])}
    return {rule[0] for tensor, dims in zip(leaves, extraction.guard.dims) if id(tensor) in cache_ids
            for rule in dims if isinstance(rule, tuple)}


def test_cache_dimensions_of_equal_size_share_one_symbol_and_the_layer_equals_eager():
    model = llama()
    model.config.num_hidden_layers = 4
    layer = model.model.layers[1]
    eager_layer = copy.deepcopy(layer)
    hidden = torch.randn(1, 3, 64)
    position_ids = torch.arange(5, 8)[None]
    embeddings = model.model.rotary_emb(hidden, position_ids)
    cache, eager_cache = filled_cache([5, 5, 5], heads=2, head_dim=16), filled_cache([5, 5, 5], heads=2, head_dim=16)
    # layer 1 appends to its own cache layer; layers 0 and 2 only pass through its export
    expected = eager_layer(hidden, position_embeddings=embeddings, past_key_values=eager_cache, use_cache=True,
                           position_ids=position_ids)
    def call():
        return ((hidden,), {"position_embeddings": embeddings, "past_key_values": filled_cache([5, 5, 5], 2, 16),
                            "use_cache": True, "position_ids": position_ids})
    args, kwargs = call()
    nnbridge.bridge(layer, *args, **kwargs)
    extraction = bridge_of(layer).dispatcher.all_extractions()[0]
    # 6 cache tensors of sizes (1, 2, 5, 16): heads, positions and head size, one symbol each at most
    # (a symbol of its own per tensor and dimension gave 12 or more)
    assert 1 <= len(cache_symbols(extraction, call())) <= 3
    output = layer(hidden, position_embeddings=embeddings, past_key_values=cache, use_cache=True,
                   position_ids=position_ids)
    assert_same(output, expected)
    assert_same(cached(cache), cached(eager_cache))


def test_cache_layers_of_unequal_length_extract_again_and_equal_eager():
    torch.manual_seed(0)
    module = ReadsAnotherLayersLength().eval()
    eager = copy.deepcopy(module)
    x = torch.randn(1, 4)
    nnbridge.bridge(module, x, past_key_values=filled_cache([5, 5]))
    dispatcher = bridge_of(module).dispatcher
    assert_same(module(x, past_key_values=filled_cache([6, 6], seed=1)),
                eager(x, past_key_values=filled_cache([6, 6], seed=1)))
    assert len(dispatcher.history) == 1, "equal lengths of another size: the same dynamic extraction"
    # unequal lengths break the shared symbol's assumption: a new extraction, exact again
    assert_same(module(x, past_key_values=filled_cache([5, 3], seed=2)),
                eager(x, past_key_values=filled_cache([5, 3], seed=2)))
    assert len(dispatcher.history) == 2
    assert_same(module(x, past_key_values=filled_cache([7, 4], seed=3)),
                eager(x, past_key_values=filled_cache([7, 4], seed=3)))


def test_a_cache_length_equal_to_the_head_size_shares_its_symbol_and_stays_exact():
    """Duck sizing also unifies sizes that are equal by coincidence (16 positions, head size 16):
    the head size is specialised, so that first extraction serves only that length; a new length
    extracts again, and every call equals eager."""
    model = llama()
    model.config.num_hidden_layers = 4
    layer = model.model.layers[1]
    eager = copy.deepcopy(layer)

    def call(length, seed):
        hidden = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(seed))
        positions = torch.tensor([[length]])
        return (hidden,), {"position_embeddings": model.model.rotary_emb(hidden, positions), "use_cache": True,
                           "past_key_values": filled_cache([length] * 3, heads=2, head_dim=16, seed=seed),
                           "position_ids": positions}
    args, kwargs = call(16, 0)
    nnbridge.bridge(layer, *args, **kwargs)
    extractions = []
    for length, seed in ((16, 1), (17, 2), (2, 3), (9, 4)):
        (args, kwargs), (eager_args, eager_kwargs) = call(length, seed), call(length, seed)
        assert_same(layer(*args, **kwargs), eager(*eager_args, **eager_kwargs))
        assert_same(cached(kwargs["past_key_values"]), cached(eager_kwargs["past_key_values"]))
        extractions.append(len(bridge_of(layer).dispatcher.history))
    assert extractions == [1, 2, 2, 2], "17 positions extract again; later lengths share that dynamic extraction"
