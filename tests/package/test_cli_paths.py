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
