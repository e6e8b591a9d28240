"""Variable-name aliases: graphpatch's node names (``attn_weights_2``, ``query_states``) as second
names of nnbridge's ATen-op-named nodes, derived from each node's source line."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2Model

import nnbridge
from nnbridge import ExtractionOptions, NodePathError, PatchableGraph, ZeroPatch
from nnbridge.graph.aliases import aliases_of, assigned_names
from nnbridge.patching.inspection import format_tree
from nnbridge.cli import main
from utils import gpt2, gpt2_tokenizer_dir

ATTN = "transformer.h_0.attn"


def _helper(t):
    r = t * 3
    return r - 1


class Reassigning(nn.Module):
    """Assigns ``h`` three times, unpacks a tuple, and calls a helper that assigns a local."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        h = x * 2
        h = h + 1
        h = torch.softmax(h, dim=-1)
        a, b = h.split(2, dim=-1)
        c = _helper(a)
        out = self.linear(torch.cat([b, c], dim=-1))
        return out


class Clashing(nn.Module):
    """Variables named like an op (``softmax``), like the child module (``linear``), and a
    variable ``y_1`` that collides with the second assignment of ``y``."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        softmax = x + 1
        y = torch.softmax(softmax, dim=-1)
        y_1 = y * 2
        y = y_1 - 1
        linear = y * 3
        return self.linear(linear)


@pytest.fixture(scope="module")
def reassigning():
    torch.manual_seed(0)
    model = Reassigning().eval()
    x = torch.randn(3, 4)
    return model, x, PatchableGraph(model, x)


@pytest.fixture(scope="module")
def gpt2_pg():
    model = gpt2()
    ids = torch.randint(0, 100, (1, 8))
    return model, ids, PatchableGraph(model, ids)


def _attention(pg):
    return pg.graph.transformer.h_0.attn._graph_module


# -- the alias pass -------------------------------------------------------------------------------
@pytest.mark.parametrize("line, names", [
    ("h = x * 2", ("h",)),
    ("    attn_weights = nn.functional.softmax(attn_weights, dim=-1)", ("attn_weights",)),
    ("x: torch.Tensor = f(y)", ("x",)),
    ("query_states, key_states, value_states = self.c_attn(h).split(8, dim=2)",
     ("query_states", "key_states", "value_states")),
    ("attn_output, attn_weights = attention_interface(", ("attn_output", "attn_weights")),
    ("h += 1", ()),
    ("self.cache = x", ()),
    ("d[k] = x", ()),
    ("return x + 1", ()),
    ("if a == b:", ()),
    ("f(x=1)", ()),
    ("", ()),
])
def test_assigned_names(line, names):
    assert assigned_names(line) == names


def test_reassigned_names_are_numbered_like_dynamo(reassigning):
    _, _, pg = reassigning
    assert aliases_of(pg.graph._graph_module) == {
        "h": "mul", "h_1": "add", "h_2": "softmax",  # three assignments to h, numbered in order
        "a": "getitem", "b": "getitem_1",            # a tuple unpacking: one getitem per name
        "r": "mul_1",                                # a helper's own local names its value first
        "c": "sub",                                  # the helper's result, stored in the caller
    }  # not 'out' (a submodule's value), not 'x' (a forward() argument)


def test_gpt2_attention_aliases(gpt2_pg):
    _, _, pg = gpt2_pg
    aliases = aliases_of(_attention(pg))
    assert {alias: aliases[alias] for alias in ("query_states", "key_states", "value_states")} == {
        "query_states": "getitem", "key_states": "getitem_1", "value_states": "getitem_2"}
    # transformers 5.23's eager_attention_forward: matmul * scaling, + mask, softmax, .type(), dropout
    assert [aliases[f"attn_weights{suffix}"] for suffix in ("", "_1", "_2", "_3", "_4")] == [
        "mul", "add", "softmax", "to", "dropout"]
    assert aliases["attn_output"] == "matmul_1" and aliases["attn_output_1"] == "transpose_4"
    assert "nn.functional.softmax(attn_weights, dim=-1)" in pg.graph[f"{ATTN}.softmax"]._code
    # the block: 'hidden_states = attn_output + residual' is a forward() argument's name (not made,
    # number consumed); the ln_2 call on the next line does not take the add's line over
    assert aliases_of(pg.graph.transformer.h_0._graph_module) == {"hidden_states_1": "add_1"}
    # 'logits = self.lm_head(...)' is a submodule's value: no alias; the helper's slice is hidden_states
    assert aliases_of(pg.graph._graph_module) == {"hidden_states": "slice"}


def test_aliases_never_shadow_ops_children_or_arguments():
    torch.manual_seed(0)
    model = Clashing().eval()
    x = torch.randn(3, 4)
    pg = PatchableGraph(model, x)
    # 'softmax' (the add) would shadow the op, 'linear' the child; 'y_1' is ambiguous: none made
    assert aliases_of(pg.graph._graph_module) == {"y": "softmax"}
    assert pg.graph.softmax._path == "softmax" and "torch.softmax" in pg.graph.softmax._code
    assert pg.graph.linear._graph_module is not None, "the child module, not the 'linear = y * 3' node"
    assert "y_1" not in pg.graph
    with pytest.raises(NodePathError, match="'y_1' is not a node"):
        with pg.patch({"y_1": ZeroPatch()}):
            pass
    with pg.patch({"y": ZeroPatch()}):
        by_alias = pg(x)
    with pg.patch({"softmax": ZeroPatch()}):
        by_op = pg(x)
    expected = model.linear((torch.zeros(3, 4) * 2 - 1) * 3)
    assert torch.equal(by_alias, by_op) and torch.equal(by_alias, expected)


# -- look-ups -------------------------------------------------------------------------------------
def test_patch_by_alias_equals_patch_by_op_and_eager(reassigning):
    model, x, pg = reassigning
    with pg.patch({"h_2": ZeroPatch()}):
        by_alias = pg(x)
    with pg.patch({"softmax": ZeroPatch()}):
        by_op = pg(x)
    with pg.patch({pg.graph.h_2: ZeroPatch()}):
        by_view = pg(x)
    zeros = torch.zeros(3, 4)
    a, b = zeros.split(2, dim=-1)
    expected = model.linear(torch.cat([b, _helper(a)], dim=-1))
    assert torch.equal(by_alias, by_op) and torch.equal(by_view, by_op) and torch.equal(by_alias, expected)
    assert not torch.equal(pg(x), expected)


def test_gpt2_softmax_alias_patch(gpt2_pg):
    """ZeroPatch on the softmax by its alias == by its op name == zeroing the attention output in
    eager (zero weights make the value matmul zero: c_proj sees zeros)."""
    model, ids, pg = gpt2_pg
    with pg.patch({f"{ATTN}.attn_weights_2": ZeroPatch()}):
        by_alias = pg(ids).logits
    with pg.patch({f"{ATTN}.softmax": ZeroPatch()}):
        by_op = pg(ids).logits
    hook = model.transformer.h[0].attn.c_proj.register_forward_pre_hook(lambda m, args: (torch.zeros_like(args[0]),))
    try:
        expected = model(ids).logits
    finally:
        hook.remove()
    assert torch.equal(by_alias, by_op) and torch.equal(by_alias, expected)
    assert not torch.equal(pg(ids).logits, expected)
    with pg.patch({"transformer.h.0.attn.attn_weights_2": ZeroPatch()}):  # nnsight spelling
        assert torch.equal(pg(ids).logits, expected)
    # graphpatch's GPT-2 softmax was attn_weights_3; in transformers 5.23 that is the .type() cast
    # of the softmax (same value): patching it has the same effect
    with pg.patch({f"{ATTN}.attn_weights_3": ZeroPatch()}):
        assert torch.equal(pg(ids).logits, expected)


def test_in_getitem_and_attribute_access(gpt2_pg):
    _, _, pg = gpt2_pg
    softmax = pg.graph[f"{ATTN}.softmax"]
    assert f"{ATTN}.attn_weights_2" in pg.graph
    assert pg.graph[f"{ATTN}.attn_weights_2"]._path == f"{ATTN}.softmax"
    assert pg.graph.transformer.h_0.attn.attn_weights_2._path == softmax._path
    assert pg.graph.transformer.h_0["attn.attn_weights_2"]._path == softmax._path
    assert pg.graph.transformer.h_0.attn.get("attn_weights_2")._path == softmax._path
    assert pg.graph.transformer.h_0.attn._shape.softmax == softmax._shape == torch.Size([1, 4, 8, 8])
    assert "attn_weights_2" in dir(pg.graph.transformer.h_0.attn)
    assert f"{ATTN}.attn_weights_99" not in pg.graph
    # aliases are second names, not extra nodes
    assert not any("attn_weights" in path for path in pg.node_paths())
    assert not any("attn_weights" in key for key in pg.graph.transformer.h_0.attn.keys())
    assert pg.op_point(f"{ATTN}.attn_weights_2") is pg.op_point(f"{ATTN}.softmax")


def test_display_shows_both_names(gpt2_pg):
    _, _, pg = gpt2_pg
    shown = repr(pg.graph.transformer.h_0.attn)
    assert "├─softmax (attn_weights_2): Tensor(1, 4, 8, 8)" in shown
    assert "├─getitem (query_states): Tensor(1, 8, 64)" in shown
    assert "├─scaled_dot_product_attention" not in shown
    assert "├─c_attn: CompiledGraphModule" in shown, "children keep their names"
    plain = format_tree(pg.graph.transformer.h_0.attn)
    assert "├─softmax: Tensor(1, 4, 8, 8)" in plain and "attn_weights" not in plain
    assert format_tree(pg.graph.transformer.h_0.attn, aliases=True) == shown


# -- errors ---------------------------------------------------------------------------------------
def test_unknown_path_suggests_the_alias_target(gpt2_pg):
    _, ids, pg = gpt2_pg
    hint = f"Did you mean '{ATTN}.softmax' (alias attn_weights_2)"
    with pytest.raises(NodePathError, match=re.escape(hint)) as info:
        with pg.patch({f"{ATTN}.attn_weigths_2": ZeroPatch(), "transformer.h.0.attn.query_state": ZeroPatch()}):
            pass
    assert f"Did you mean '{ATTN}.getitem' (alias query_states)" in str(info.value), "nnsight spelling too"
    with pytest.raises(KeyError, match=re.escape(hint)):
        pg.graph[f"{ATTN}.attn_weigths_2"]
    with pytest.raises(KeyError, match=re.escape(hint)):
        pg.graph.transformer["h_0.attn.attn_weigths_2"]
    with pytest.raises(AttributeError, match=re.escape(hint)):
        pg.graph.transformer.h_0.attn.attn_weigths_2


@pytest.mark.parametrize("path", [f"{ATTN}.zzz", f"{ATTN}.2x", f"{ATTN}.softmax.attn_weights_2",
                                  "transformer.h_0.attn_weights_2"])
def test_no_suggestion_without_a_close_alias(gpt2_pg, path):
    """Far from every alias, not an identifier, under a node, or in a graph whose aliases are
    elsewhere (h_0 has none like it): the error has no alias hint."""
    _, _, pg = gpt2_pg
    with pytest.raises(NodePathError) as info:
        with pg.patch({path: ZeroPatch()}):
            pass
    assert "Did you mean" not in str(info.value) and "not a node" in str(info.value)
    with pytest.raises(KeyError) as lookup:
        pg.graph[path]
    assert "Did you mean" not in str(lookup.value)


# -- bridged models, saving, the CLI ------------------------------------------------------------
def test_bridged_model_shares_aliases():
    model = gpt2()
    ids = torch.randint(0, 100, (1, 8))
    nnbridge.bridge(model, ids)
    try:
        pg = PatchableGraph(model, ids)
        with pg.patch({f"{ATTN}.attn_weights_2": ZeroPatch()}):
            by_alias = model(ids).logits
        with pg.patch({f"{ATTN}.softmax": ZeroPatch()}):
            by_op = model(ids).logits
        assert torch.equal(by_alias, by_op) and not torch.equal(model(ids).logits, by_op)
    finally:
        nnbridge.unbridge(model)


def test_aliases_survive_save_and_load(gpt2_pg, tmp_path):
    model, ids, pg = gpt2_pg
    pg.save(tmp_path / "pg.nnbridge")
    loaded = PatchableGraph.load(tmp_path / "pg.nnbridge", model)
    assert aliases_of(_attention(loaded)) == aliases_of(_attention(pg))
    with loaded.patch({f"{ATTN}.attn_weights_2": ZeroPatch()}):
        by_alias = loaded(ids).logits
    with pg.patch({f"{ATTN}.softmax": ZeroPatch()}):
        by_op = pg(ids).logits
    assert torch.equal(by_alias, by_op)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A local GPT-2 directory as ``nnbridge tree`` loads it (AutoModel: sdpa attention)."""
    directory = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)  # the real GPT-2 tokenizer: the full vocabulary
    GPT2Model(GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=50257,
                         bos_token_id=0, eos_token_id=0)).save_pretrained(directory)
    for name in ("vocab.json", "merges.txt", "tokenizer.json"):
        (directory / name).write_bytes((gpt2_tokenizer_dir() / name).read_bytes())
    return directory


def test_cli_tree_aliases(model_dir, capsys):
    assert main(["tree", str(model_dir), "--path", "h_0.attn", "--depth", "1", "--aliases"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "attn: CompiledGraphModule"
    assert "├─scaled_dot_product_attention (attn_output): Tensor(1, 4, 9, 16)" in out
    assert "├─getitem (query_states): Tensor(1, 9, 64)" in out
    assert "├─c_proj: CompiledGraphModule" in out
    assert main(["tree", str(model_dir), "--path", "h_0.attn", "--depth", "1"]) == 0
    plain = capsys.readouterr().out
    assert "├─scaled_dot_product_attention: Tensor(1, 4, 9, 16)" in plain and "attn_output" not in plain
    # --path accepts an alias; a typo gets the hint, on one line, exit 1
    assert main(["tree", str(model_dir), "--path", "h_0.attn.query_states", "--aliases"]) == 0
    assert capsys.readouterr().out.strip() == "getitem (query_states): Tensor(1, 9, 64)"
    assert main(["tree", str(model_dir), "--path", "h_0.attn.query_sates"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading progress
    assert err.startswith("nnbridge: error: h_0.attn has no child 'query_sates'")
    assert "Did you mean 'h_0.attn.getitem' (alias query_states)" in err


def test_opaque_graphs_have_no_aliases():
    """An opaque module runs its own code: no graph, no per-op nodes, so no aliases and no hints."""
    torch.manual_seed(0)
    model = Reassigning().eval()
    x = torch.randn(3, 4)
    pg = PatchableGraph(model, ExtractionOptions(skip_compilation=True), x)
    assert "h_2" not in pg.graph and "x" in pg.graph
    with pytest.raises(NodePathError) as info:
        with pg.patch({"h_2": ZeroPatch()}):
            pass
    assert "'h_2' is not a node" in str(info.value) and "Did you mean" not in str(info.value)


def test_helper_frames_are_recorded_only_while_asked():
    from torch.fx.proxy import TracerBase

    from nnbridge.compat.torch.stack_traces import helper_frames_recorded

    original = TracerBase.__dict__["_filter_traceback_frames"]

    def traces():
        exported = torch.export.export(Reassigning().eval(), (torch.randn(3, 4),), strict=False)
        return {node.name: node.meta.get("stack_trace") or "" for node in exported.graph.nodes}

    with helper_frames_recorded():
        with helper_frames_recorded():  # nests
            assert TracerBase.__dict__["_filter_traceback_frames"] is not original
        assert TracerBase.__dict__["_filter_traceback_frames"] is not original
        inside = traces()
    assert TracerBase.__dict__["_filter_traceback_frames"] is original
    outside = traces()
    assert inside["mul_1"].splitlines()[-1].strip() == "r = t * 3", "the helper's own line"
    assert inside["mul_1"].startswith(outside["mul_1"]), "torch's frames first, unchanged"
    assert outside["mul_1"].splitlines()[-1].strip() == "c = _helper(a)", "torch alone: the call site"
    assert inside["split"].splitlines()[-1].strip() == "a, b = h.split(2, dim=-1)", "Tensor.split (torch/_tensor.py) left out"


def test_source_lines_read_lazily_give_the_same_stack_traces(monkeypatch):
    """While exporting, frames' source lines are read only for the frames a node keeps
    (compat.torch.stack_traces._lazy_lines): every node's stack_trace equals torch's own reading, and
    torch's function is back afterwards."""
    import torch.utils._traceback as torch_traceback

    from nnbridge.compat.torch import stack_traces
    from utils import gpt2

    original = torch_traceback._extract_symbolized_tb

    def traces():
        with stack_traces.helper_frames_recorded():
            assert torch_traceback._extract_symbolized_tb is not original or stack_traces._lazy_lines is original
            exported = torch.export.export(gpt2(), (torch.randint(0, 100, (1, 8)),), strict=False)
        return [node.meta.get("stack_trace") for node in exported.graph.nodes]

    lazy = traces()
    assert torch_traceback._extract_symbolized_tb is original
    monkeypatch.setattr(stack_traces, "_lazy_lines", original)  # torch's own, eager line reading
    eager = traces()
    assert lazy == eager and sum(1 for t in lazy if t) > 20
