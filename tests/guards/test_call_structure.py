"""One extraction per call structure; other structures are extracted again, never run wrongly."""

from typing import Any, NamedTuple

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import nnbridge
from fixtures.minimal_module import MinimalModule
from nnbridge import PatchableGraph, ZeroPatch
from nnbridge.inplace.bridging import bridge_of
from nnbridge.guards.call_structure import ShapeGuard, memory_layout
from nnbridge.compat.torch.export import guard_view
from nnbridge.compat.torch.pytree import pytree
from utils import PastPlusNew, assert_same, gpt2, padded_batch, past_plus_new


def test_new_kwargs_and_values_are_extracted_again_and_cached():
    model = gpt2()
    ids, mask = padded_batch(6)
    pg = PatchableGraph(model, ids, attention_mask=mask)
    assert len(pg.extractions) == 1
    assert_same(pg(ids), model(ids))  # no attention_mask: another structure
    assert len(pg.extractions) == 2
    assert_same(pg(ids, attention_mask=mask, use_cache=False), model(ids, attention_mask=mask, use_cache=False))
    assert len(pg.extractions) == 3
    assert_same(pg(ids), model(ids))
    assert len(pg.extractions) == 3, "same structure reuses the cached extraction"


def test_sizes_outside_the_dynamic_range_are_extracted_again():
    model = gpt2()
    ids, mask = padded_batch(6)
    pg = PatchableGraph(model, ids, attention_mask=mask)
    one_token, one_mask = ids[:, :1], mask[:, -1:]
    assert not pg.extractions[0].guard.matches([one_token, one_mask])
    assert_same(pg(one_token, attention_mask=one_mask), model(one_token, attention_mask=one_mask))
    assert len(pg.extractions) == 2


def test_batch_of_one_example_is_static_in_batch():
    model = MinimalModule().eval()
    pg = PatchableGraph(model, torch.randn(1, 3))
    assert pg.extractions[0].guard.dims[0][0] == 1
    x = torch.randn(5, 3)
    assert_same(pg(x), model(x))
    assert len(pg.extractions) == 2


def test_active_patches_apply_to_new_extractions():
    model = MinimalModule().eval()
    x = torch.randn(4, 3)
    pg = PatchableGraph(model, x)
    with pg.patch({"linear.output": ZeroPatch()}):
        assert torch.equal(pg(x.double().float()), torch.zeros(4, 2))
        assert torch.equal(pg(x[0]), torch.zeros(2))  # rank 1: a new extraction, patched too
    assert len(pg.extractions) == 2
    assert torch.equal(pg(x[0]), model(x[0]))


def test_a_size_derived_from_another_stays_dynamic():
    """The mask's length is ``s + 1``: one extraction serves every past length (it was specialised to
    the example's, so each decode step extracted again), and a mask of another length is refused."""
    model = PastPlusNew()
    pg = PatchableGraph(model, *past_plus_new(5))
    guard = pg.extractions[0].guard
    assert guard.dims[2][1][3:] == (1, 1)  # (symbol, low, high, coefficient 1, offset 1)
    assert guard.dims[2][1][0] == guard.dims[0][1][0]
    for length in (3, 9, 17):
        inputs = past_plus_new(length)
        assert torch.equal(pg(*inputs), model(*inputs))
    assert len(pg.extractions) == 1
    wrong = past_plus_new(5, mask_length=7)
    assert not guard.matches(list(wrong), (wrong, {}))
    assert "(1 + L['args'][0].size()[1]) == L['args'][2].size()[1]" in guard.failed(list(wrong), (wrong, {}))


def test_a_derived_dimension_binds_its_symbol_when_no_plain_one_does():
    """``2 * s + 1`` alone: a size gives ``s`` when it is of that form and ``s`` in its range."""
    guard = ShapeGuard([[("s", 2, 10, 2, 1)], [("s", 2, 10, 2, 1)]])
    assert guard.matches([torch.empty(7), torch.empty(7)])          # s = 3
    assert not guard.matches([torch.empty(7), torch.empty(9)])      # s = 3, then 4
    assert not guard.matches([torch.empty(6), torch.empty(6)])      # not 2 * s + 1
    assert not guard.matches([torch.empty(3), torch.empty(3)])      # s = 1 < 2
    assert not guard.matches([torch.empty(23), torch.empty(23)])    # s = 11 > 10
    plain_first = ShapeGuard([[("s", 2, None, 1, 1)], [("s", 2, None)]])
    assert plain_first.matches([torch.empty(6), torch.empty(5)])
    assert not plain_first.matches([torch.empty(5), torch.empty(5)])


# -- memory layout: code that branches on contiguity or reads strides (as Dynamo's stride guards) ---
class _LayoutBranch(torch.nn.Module):
    def __init__(self, read: str):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.read = read

    def forward(self, x):
        y = self.linear(x)
        if self.read == "is_contiguous":
            return y * 2 if x.is_contiguous() else y * 3
        if self.read == "stride":
            return y * x.stride(0)
        return y + 1 if x.stride(0) == 0 else y - 1  # an expanded input


def _layouts(read: str):
    base = torch.randn(5, 4)
    if read == "expand":
        return [base, base[:1].expand(5, 4), base + 1]
    return [base, torch.randn(4, 5).t(), base + 1, torch.randn(4, 7).t()]


@pytest.mark.parametrize("read", ["is_contiguous", "stride", "expand"])
def test_an_input_of_another_memory_layout_is_extracted_again(read):
    """Before, the graph of the first call's layout served a transposed or expanded input: off from
    eager, with no error."""
    torch.manual_seed(0)
    model, reference = _LayoutBranch(read), _LayoutBranch(read)
    reference.load_state_dict(model.state_dict())
    inputs = _layouts(read)
    nnbridge.bridge(model, inputs[0])
    for x in inputs:
        assert torch.equal(model(x), reference(x))
    assert "memory layout of tensor argument 0 changed" in str(nnbridge.explain(model))
    assert len(bridge_of(model).dispatcher.extractions) == 2, "one extraction per layout"


def test_memory_layout_does_not_depend_on_sizes():
    assert memory_layout(torch.randn(3, 4)) == memory_layout(torch.randn(9, 2)) is True
    assert memory_layout(torch.randn(4, 3).t()) == memory_layout(torch.randn(8, 6).t()) != True  # noqa: E712
    assert memory_layout(torch.randn(1, 4).expand(3, 4)) == memory_layout(torch.randn(1, 6).expand(7, 6))
    assert memory_layout(torch.randn(1, 4).expand(3, 4)) != memory_layout(torch.randn(4, 3).t())
    assert memory_layout(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)) == \
        memory_layout(torch.randn(3, 2, 6, 7).to(memory_format=torch.channels_last))
    assert memory_layout(torch.randn(3, 3).to_sparse()) == torch.sparse_coo


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        return y * 2 if x.is_contiguous() else y * 3


class _Stack(torch.nn.Module):
    """Identical layers, the second called with a transposed input: layer reuse must not pair it
    with the first."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer() for _ in range(3)])

    def forward(self, x):
        return self.layers[0](x) + self.layers[1](x.t()) + self.layers[2](x)


@pytest.mark.parametrize("opaque", [False, True], ids=["one-export", "sibling-roots"])
def test_layer_reuse_pairs_only_calls_of_the_same_memory_layout(opaque):
    """With the stack opaque, each layer is a root of its own and layers 1-2 are built from layer
    0's export when called alike (sibling roots): before, the transposed call got layer 0's
    contiguous branch, silently."""
    torch.manual_seed(0)
    x = torch.randn(4, 4)
    model, reference = _Stack(), _Stack()
    reference.load_state_dict(model.state_dict())
    options = nnbridge.ExtractionOptions(classes_to_skip_compiling={_Stack}) if opaque else None
    nnbridge.bridge(model, x, options=options)
    assert torch.equal(model(x), reference(x))


def test_copied_inputs_keep_their_memory_layout():
    """Inputs with autograd history are copied by cloning, which made an expanded tensor
    contiguous: an extraction made from the copy then missed the real call's layout, and Gemma 3's
    layers were extracted twice in one forward with output_attentions=True."""
    from nnbridge.extract.recording import copy_inputs
    weight = torch.randn(1, 6, requires_grad=True)
    expanded, transposed = (weight * 2).expand(3, 6), (weight.t() * torch.ones(6, 3)).t()
    copied = copy_inputs(((expanded, transposed), {"mask": expanded}))
    for original, copy in zip((expanded, transposed, expanded), (*copied[0], copied[1]["mask"])):
        assert copy.stride() == original.stride() and torch.equal(copy, original)
        assert memory_layout(copy) == memory_layout(original)
    assert copied[0][0].requires_grad


def test_gemma3_layers_are_extracted_once_per_forward_with_their_masks_layouts():
    from utils import gemma3
    layers = ("sliding_attention", "full_attention", "sliding_attention")
    model, reference = gemma3(layers), gemma3(layers)
    torch.manual_seed(1)
    ids = torch.randint(2, 100, (1, 6))
    nnbridge.bridge(model, ids)
    got, expected = model(ids, output_attentions=True), reference(ids, output_attentions=True)
    assert torch.equal(got.logits, expected.logits)
    assert all(torch.equal(a, b) for a, b in zip(got.attentions, expected.attentions))
    history = str(nnbridge.explain(model))
    assert "memory layout of tensor argument" not in history, history


class Pair(NamedTuple):
    first: Any
    second: Any


def test_guard_view_reads_every_leaf_by_its_key_path_as_tree_flatten_with_path_gives_it():
    """Export's guard sources address a call's leaves by pytree key path; the view flattens each
    node only when read, and must give exactly the leaves ``tree_flatten_with_path`` gives."""
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2)).eval()
    nnbridge.bridge(model, torch.randint(0, 100, (1, 4)))  # registers the cache pytrees
    with torch.no_grad():
        cache = model(torch.randint(0, 100, (1, 4))).past_key_values
    call = {"args": (torch.ones(2), [3, None, (torch.zeros(1), "s")]),
            "kwargs": {"cache": cache, "pair": Pair(torch.ones(3), {"k": 2.5}), "flag": True, "empty": []}}
    flat, _ = pytree.tree_flatten_with_path(call)
    assert len(flat) == 12  # 5 from args (None is a leaf), the cache's 4 tensors, the pair's 2, the flag
    for path, leaf in flat:
        node = guard_view(call)
        for entry in path:
            node = node[getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", None)))]
        assert node is leaf
    view = guard_view(call)
    assert view["kwargs"]["pair"].first is call["kwargs"]["pair"].first  # an attribute, as GetAttrKey addresses it
    with pytest.raises(KeyError):
        view["kwargs"]["cache"][4]  # the cache has four leaves
    with pytest.raises(AttributeError):
        view["kwargs"]["pair"].third


def test_a_changed_module_tree_is_named_as_such_not_as_a_mode_change():
    """The key holds one train/eval flag per module: a key with more flags means modules were
    added (graph surgery's insertions), which the reason says instead of a mode change."""
    from nnbridge.guards.call_structure import describe_key_change, structure_key

    model = torch.nn.Sequential(torch.nn.Linear(2, 2)).eval()
    x = torch.randn(1, 2)
    before = structure_key(list(model.modules()), (x,), {})
    model.append(torch.nn.ReLU())  # in training mode, as torch makes it
    grown = structure_key(list(model.modules()), (x,), {})
    assert describe_key_change(before, grown) == "modules were added or removed (2 -> 3 modules)"
    model.train()
    retrained = structure_key(list(model.modules()), (x,), {})
    assert describe_key_change(grown, retrained) == "train/eval mode of a module changed"
