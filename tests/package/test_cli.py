"""The ``nnbridge`` command: tree on a local model directory, one-line errors, exit codes."""

import subprocess
import sys

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from nnbridge.cli import main
from utils import gpt2_tokenizer_dir


def test_tree_of_a_local_model(tmp_path, capsys):
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50257)).save_pretrained(tmp_path)
    tokenizer_dir = gpt2_tokenizer_dir()
    for name in ("vocab.json", "merges.txt", "tokenizer.json"):
        (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
    assert main(["tree", str(tmp_path), "--path", "h_0.attn", "--depth", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "attn: CompiledGraphModule"
    assert "├─scaled_dot_product_attention: Tensor(1, 2, 9, 16)" in out
    assert out[-1] == "└─output: tuple(2)", "the module's own output (attn_output, attn_weights), cache threaded outside"
    assert not any(line.startswith("│ ") for line in out), "depth 1 prints one level"
    assert main(["tree", str(tmp_path), "--explain"]) == 0
    explained = capsys.readouterr().out
    assert "1. <root>: first call" in explained and "h_0.attn (GPT2Attention): graph" in explained


def test_bad_arguments_one_line_and_exit_2(capsys):
    for args in ([], ["tree"], ["frobnicate"], ["tree", "smollm2", "--depth", "0"], ["tree", "x", "--depth", "a"]):
        with pytest.raises(SystemExit) as exited:
            main(args)
        assert exited.value.code == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("nnbridge: error:"), err


def test_unknown_model_one_line_and_exit_1(tmp_path, capsys):
    assert main(["tree", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("nnbridge: error: unknown model")
    assert "Traceback" not in err


@pytest.mark.integration  # end to end: a second process
def test_python_dash_m_entry_point():
    """One real process: ``python -m nnbridge`` runs the same ``main`` and exits with its code."""
    result = subprocess.run([sys.executable, "-m", "nnbridge", "frobnicate"], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("nnbridge: error:"), result.stderr


def test_doctor_prints_versions_patches_and_cache(tmp_path, capsys, monkeypatch):
    from nnbridge.compat import registry

    monkeypatch.setenv("NNBRIDGE_CACHE", str(tmp_path))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"torch         {torch.__version__}" in out and "tested 2.13-2.15: yes" in out
    assert "transformers" in out and "tested 5.23-5.24" in out and "nnsight" in out and "tested 0.8.x" in out
    for patch in registry.PATCHES:
        row = f"{patch.name:<{max(len(p.name) for p in registry.PATCHES)}}  {patch.kind:<11}  "
        assert f"{row}ready" in out or f"{row}in place" in out, patch.name  # (in place: installed for the process)
        assert f"target: {patch.target}" in out
    assert f"cache directory: {tmp_path} ($NNBRIDGE_CACHE), 0.0 MB" in out
    assert "extraction cache:" in out
    with registry.assumed("torch", "2.99", kinds=["speed"]):
        assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    verified = ", ".join(sorted(registry.BY_NAME["duck_sizing"].verified, key=registry.version_key))
    assert "duck_sizing" in out and f"skipped: torch 2.99 (assumed) is not among the verified {verified}" in out
    assert "tensor_data                   correctness  ready" in out


def test_doctor_says_where_the_cache_is_and_whether_it_is_off(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("NNBRIDGE_CACHE", raising=False)
    monkeypatch.delenv("NNBRIDGE_EXTRACTION_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    root = tmp_path / ".cache" / "nnbridge"
    assert f"cache directory: {root} ($NNBRIDGE_CACHE unset: the default), 0.0 MB" in out
    assert f"extraction cache: {root / 'extractions'}, 0 entries, 0.0 MB" in out
    monkeypatch.setenv("NNBRIDGE_EXTRACTION_CACHE", "memory")
    assert main(["doctor"]) == 0
    assert "extraction cache: off ($NNBRIDGE_EXTRACTION_CACHE=memory)" in capsys.readouterr().out
