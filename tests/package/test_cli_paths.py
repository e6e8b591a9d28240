"""``nnbridge tree --path``: NodePaths and nnsight's spellings alike, checked against the module tree
before anything is extracted, errors that name the closest names and never send a shell user to
``dir()`` (issue 51, "a new user's first hour")."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import nnbridge.patching.patchable_graph
from nnbridge.cli import main, module_path
from nnbridge.errors import NNBridgeError
from utils import gpt2, gpt2_tokenizer_dir, llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A local GPT-2 directory as ``nnbridge tree`` loads it (AutoModel: the base GPT2Model)."""
    directory = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50257, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(directory)
    for name in ("vocab.json", "merges.txt", "tokenizer.json"):
        (directory / name).write_bytes((gpt2_tokenizer_dir() / name).read_bytes())
    return directory


@pytest.mark.parametrize("text", ["transformer.h_0.attn", "transformer.h.0.attn", "model.transformer.h[0].attn",
                                  "h.0.attn", "h_0.attn", "model.h[0].attn", "transformer.h[-2].attn",
                                  "h['0'].attn"])
def test_spellings_name_one_module(text):
    """NodePath, nnsight's path (with or without its root ``model.``, with ``[i]``) and a path from
    the base model of a transformers head model all name ``transformer.h.0.attn``."""
    assert module_path(gpt2(), text) == (["transformer", "h", "0", "attn"], [])


def test_op_segments_are_left_to_the_extraction():
    model = llama()
    assert module_path(model, "model.layers[0].self_attn.softmax") == (["model", "layers", "0", "self_attn"], ["softmax"])
    assert module_path(model, "layers.1.mlp.output|sub_0") == (["model", "layers", "1", "mlp"], ["output", "sub_0"])
    assert module_path(model, "model.layers")[0] == ["model", "layers"]


class _Near(torch.nn.Module):
    """Submodules whose names are near those of possible ops."""

    def __init__(self):
        super().__init__()
        self.linear1 = torch.nn.Linear(2, 2)
        self.hidden = torch.nn.Linear(2, 2)
        self.scales = torch.nn.Parameter(torch.ones(2))

    def forward(self, hiddens):
        return torch.nn.functional.linear(self.linear1(hiddens), self.hidden.weight) * self.scales


@pytest.mark.parametrize("name", ["linear", "linear_2", "hiddens", "scale", "output"])
def test_names_near_a_submodule_may_still_be_ops(name):
    """A torch function, an argument of the forward, a parameter: possible ops, left to the extraction."""
    assert module_path(_Near(), name) == ([], [name])


def test_a_near_miss_of_a_submodule_fails():
    with pytest.raises(NNBridgeError, match=r"<root> \(_Near\) has no submodule 'linear1x'; closest: \['linear1'\]"):
        module_path(_Near(), "linear1x")


@pytest.mark.parametrize("text, message", [
    ("h_0.atn", r"--path 'h_0.atn': transformer.h_0 \(GPT2Block\) has no submodule 'atn'; closest: \['attn'\]"
                r" \(its submodules: ln_1, attn, ln_2, mlp\)"),
    ("h.7.attn", r"transformer.h \(ModuleList\) has no entry '7'; it holds 2: 0, 1"),
    ("h_7.attn", r"transformer.h \(ModuleList\) has no entry '7'; it holds 2: 0, 1"),
    ("h_0.attn.c_atn", r"transformer.h_0.attn \(GPT2Attention\) has no submodule 'c_atn'; closest: \['c_attn'"),
    ("transformer.h_0.2", r"transformer.h_0 \(GPT2Block\) is no module container, so '2' indexes nothing"),
    ("h_0..attn", r"an empty name is no module or op name"),
    ("h_0.attn(1)", r"'attn\(1\)' is no module or op name"),
])
def test_bad_paths_fail_before_extraction(text, message):
    with pytest.raises(NNBridgeError, match=message) as error:
        module_path(gpt2(), text)
    assert "dir()" not in str(error.value)


def test_cli_fails_fast_on_a_bad_path(model_dir, capsys, monkeypatch):
    def no_extraction(*args, **kwargs):
        raise AssertionError("the path is checked before extracting")

    monkeypatch.setattr(nnbridge.patching.patchable_graph, "PatchableGraph", no_extraction)
    assert main(["tree", str(model_dir), "--path", "model.h[0].atn"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading progress
    assert err == ("nnbridge: error: --path 'model.h[0].atn': h_0 (GPT2Block) has no submodule 'atn'; closest:"
                   " ['attn'] (its submodules: ln_1, attn, ln_2, mlp).")


def test_cli_tree_in_every_spelling(model_dir, capsys):
    outputs = []
    for text in ("h_0.attn", "h.0.attn", "model.h[0].attn"):
        assert main(["tree", str(model_dir), "--path", text, "--depth", "1"]) == 0
        # (an op's tensor list prints as tuple(n) or list(n) by where its summary came from: utils.same_tree)
        outputs.append(re.sub(r"\b(tuple|list)\((\d+)\)", r"sequence(\2)", capsys.readouterr().out))
    assert outputs[0].splitlines()[0] == "attn: CompiledGraphModule"
    assert outputs[0] == outputs[1] == outputs[2]
    assert main(["tree", str(model_dir), "--path", "h[1].attn.c_attn.output"]) == 0
    assert capsys.readouterr().out.strip() == "output: Tensor(1, 9, 96)"


def test_cli_op_typo_after_extraction_lists_without_dir(model_dir, capsys):
    """A name that may be an op is known only once extracted: the error then names the closest
    children and the command that lists them, not ``dir()``."""
    assert main(["tree", str(model_dir), "--path", "h.0.attn.getitm"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("nnbridge: error: h_0.attn has no child 'getitm'; closest: ['getitem'")
    assert f"'nnbridge tree {model_dir} --path h_0.attn --depth 1' lists them" in err and "dir()" not in err


def test_cli_op_of_fused_attention_names_the_implementation(model_dir, capsys):
    """``AutoModel`` loads sdpa attention: its attention module has no softmax, and the error says
    why (issue 51: the same explanation as ``pg.patch``, envoys and ``get_submodule``)."""
    assert main(["tree", str(model_dir), "--path", "h.0.attn.softmax"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("nnbridge: error: h_0.attn has no child 'softmax': h_0.attn (GPT2Attention) computes"
                          " attention with attn_implementation='sdpa', one fused call ('scaled_dot_product_attention')")
    assert 'attn_implementation="eager"' in err and "dir()" not in err


def _full_subtree(model_dir, node_path):
    """The subtree at ``node_path`` of the whole model's extraction on the first prompt of ``nnbridge tree``."""
    from transformers import AutoModel, AutoTokenizer

    from nnbridge import PatchableGraph
    from nnbridge.cli import PROMPTS
    from nnbridge.patching.inspection import format_tree

    model = AutoModel.from_pretrained(model_dir).eval()
    view = PatchableGraph(model, **AutoTokenizer.from_pretrained(model_dir)(PROMPTS[0], return_tensors="pt")).graph
    for name in node_path.split("."):
        view = view._child(name)
    return format_tree(view)


def _sequences(text):
    return re.sub(r"\b(tuple|list)\((\d+)\)", r"sequence(\2)", text)  # see utils.same_tree


@pytest.mark.parametrize(("text", "node_path", "alone"), [
    ("h.0.ln_1", "h_0.ln_1", "LayerNorm"), ("h.0.mlp", "h_0.mlp", "GPT2MLP"), ("h.1.mlp.c_fc", "h_1.mlp.c_fc", "Conv1D"),
    ("h.0.attn", "h_0.attn", None), ("h.1", "h_1", None)])
def test_tree_of_a_module_extracts_it_alone_with_the_models_graphs(model_dir, capsys, monkeypatch, text, node_path,
                                                                    alone):
    """A module the model calls once with tensors only is extracted alone, with only the sequence
    length dynamic (as the model's tokens make it), and prints the subtree the whole model's
    extraction gives it; any other (``h.0.attn`` and ``h.1`` take keyword arguments) is printed
    from the whole model's extraction, which stderr says in one line."""
    expected = _full_subtree(model_dir, node_path)
    extracted = []
    real = nnbridge.patching.patchable_graph.PatchableGraph

    def spy(module, *args, **kwargs):
        extracted.append(type(module).__name__)
        return real(module, *args, **kwargs)

    monkeypatch.setattr(nnbridge.patching.patchable_graph, "PatchableGraph", spy)
    capsys.readouterr()
    assert main(["tree", str(model_dir), "--path", text]) == 0
    out, err = capsys.readouterr()
    assert _sequences(out.rstrip("\n")) == _sequences(expected)
    assert extracted == [alone or "GPT2Model"], "one extraction: of the module alone, else of the whole model"
    said = [line for line in err.splitlines() if "whole model" in line]
    if alone is None:
        assert len(said) == 1 and said[0].startswith(f"nnbridge: extracting the whole model, not {node_path} alone:"
                                                     f" {node_path} is called with keyword arguments ("), said
    else:
        assert not said


def test_tree_of_an_op_of_a_module_extracted_alone(model_dir, capsys):
    """Op segments after a module extracted alone are looked up in its graphs; a missing one names
    the module's full NodePath in the listing command."""
    assert main(["tree", str(model_dir), "--path", "h.1.mlp.c_fc.addmm"]) == 0
    assert capsys.readouterr().out.strip() == "addmm: Tensor(9, 128)"
    assert main(["tree", str(model_dir), "--path", "h.1.mlp.c_fc.adm"]) == 1
    assert f"'nnbridge tree {model_dir} --path h_1.mlp.c_fc --depth 1' lists them" in capsys.readouterr().err


class _Calls(torch.nn.Module):
    """``twice`` is called twice, ``scaled`` with a number, ``once`` once with a tensor."""

    def __init__(self):
        super().__init__()
        self.twice, self.once = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.scaled = _Scaled()
        self.layers = torch.nn.ModuleList([torch.nn.Identity()])

    def forward(self, x):
        return self.scaled(self.once(self.twice(self.twice(x))), 2.0)


class _Scaled(torch.nn.Module):
    def forward(self, x, factor):
        return x * factor


@pytest.mark.parametrize(("path", "reason"), [
    ([], "<root> names no submodule (the root, or a further call of one)"),
    (["twice_1"], "twice_1 names no submodule (the root, or a further call of one)"),
    (["layers"], "layers is a module container, never called itself"),
    (["twice"], "twice is called 2 and 2 times in runs of the model, not once"),
    (["layers", "0"], "layers_0 is called 0 and 0 times in runs of the model, not once"),
    (["scaled"], "scaled is called with a float as positional argument 1, not a tensor"),
])
def test_module_call_says_why_a_module_is_not_extracted_alone(path, reason):
    from nnbridge.cli import module_call

    runs = [{"x": torch.randn(1, 3, 4)}, {"x": torch.randn(1, 2, 4)}]
    assert module_call(_Calls(), path, runs) == reason


def test_module_call_gives_the_dimensions_that_follow_the_sequence():
    from nnbridge.cli import module_call

    model = _Calls()
    runs = [{"x": torch.randn(1, 3, 4)}, {"x": torch.randn(1, 2, 4)}]
    module, args, dims = module_call(model, ["once"], runs)
    assert module is model.once and dims == ((1,),)
    assert torch.equal(args[0], model.twice(model.twice(runs[0]["x"])))
