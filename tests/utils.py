"""Helpers shared by the tests."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree
import transformers
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from fixtures import FIXTURES  # noqa: F401 (tests import it from here)
from fixtures.data_dependent_module import DataDependentModule
import nnbridge
from nnbridge import CompiledGraphModule, ExtractionOptions, FallbackWarning, NNBridgeWarning, PatchableGraph
from nnbridge.graph.metadata import node_meta

REPO = Path(__file__).resolve().parents[1]


# -- transformers versions: 5.24 renamed ``past_key_values`` to ``cache`` and dropped ``@torch.no_grad``
# from the rotary embeddings' forward (the suite runs on 5.23 and 5.24) ------------------------------
_TRANSFORMERS = tuple(int(part) for part in transformers.__version__.split(".")[:2])
CACHE_KWARG = "cache" if _TRANSFORMERS >= (5, 24) else "past_key_values"
"""The keyword transformers' models pass a ``Cache`` to their decoder layers and attentions by."""
ROTARY_UNDER_NO_GRAD = _TRANSFORMERS < (5, 24)
"""Whether transformers' rotary embeddings run their ``forward`` under ``@torch.no_grad()``."""


class Outer(torch.nn.Module):
    """``out(inner(x))``: a module under test called from a root whose ``Linear`` stays a graph."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.out = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


@functools.cache
def _no_grad_class(cls: type) -> type:
    return type(cls.__name__, (cls,), {"forward": torch.no_grad()(cls.forward), "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def no_grad_rotary(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every ``rotary_emb`` module's ``forward`` under ``@torch.no_grad()``, as in
    transformers 5.23 and older: a real module that changes grad mode, on every supported version."""
    for name, module in model.named_modules():
        if name.rpartition(".")[2] == "rotary_emb":
            module.__class__ = _no_grad_class(type(module))
    return model


# -- model factories: every test file builds its models here ------------------------------------
def gpt2(attn="eager"):
    """Tiny random GPT-2 (2 layers, width 64, vocab 100), seeded, in eval mode."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, attn_implementation=attn,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


def llama(attn="eager"):
    """Tiny random Llama (2 layers, width 64, GQA 4/2, vocab 100), seeded, in eval mode."""
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, attn_implementation=attn,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def gemma3(layer_types=("sliding_attention", "full_attention")):
    """Tiny random Gemma 3 text model (one layer per layer type, default 2; width 64, GQA 4/2, head_dim 16, sliding window 4,
    vocab 100), eager attention, seeded, in eval mode. One sliding and one full-attention layer by
    default, so ``rotary_emb`` is called twice, once per layer type (a string argument)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    config = Gemma3TextConfig(num_hidden_layers=len(layer_types), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=100, sliding_window=4,
                              layer_types=list(layer_types), attn_implementation="eager",
                              bos_token_id=0, eos_token_id=1, pad_token_id=0)
    return Gemma3ForCausalLM(config).eval()


def text_model(kind):
    """Tiny random GPT-2 or Llama with GPT-2's vocabulary (50257), for the real tokenizer."""
    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, attn_implementation="eager")).eval()
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=50257,
                                        attn_implementation="eager", bos_token_id=0, eos_token_id=0,
                                        pad_token_id=0)).eval()


def padded_batch(seq):
    """Token ids ``(2, seq)`` and an attention mask with the first half of row 0 padded."""
    ids = torch.randint(1, 100, (2, seq))
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[0, : seq // 2] = 0
    return ids, mask


@contextlib.contextmanager
def falls_back(*paths: str) -> Iterator[None]:
    """Expect the one FallbackWarning an extraction with opaque fallbacks gives, naming ``paths``
    (module paths, ``<root>`` for the root) and no other module."""
    with pytest.warns(FallbackWarning, match="run(s)? eagerly") as caught:
        yield
    tables = [str(w.message) for w in caught if "eagerly (opaque" in str(w.message)]
    assert len(tables) == 1, tables
    named = [line.split(" | ")[0].strip() for line in tables[0].splitlines()[2:] if " | " in line]
    assert named == list(paths), (named, paths)


def data_dependent():
    """``DataDependentModule`` (its ``branchy`` child branches on a tensor value) and an input."""
    return DataDependentModule().eval(), torch.randn(2, 3)


# -- extraction modes, as graphpatch's ``@opaque_and_compiled`` -----------------------------------
EXTRACTION_MODES = {
    # every module compiled, or the extraction raises: a silent opaque fallback cannot pass
    # (modules the example never calls, e.g. an unused dropout, stay allowed: strict mode would refuse them)
    "compiled": lambda: ExtractionOptions(error_on_compilation_failure=True, allow_unused_submodules=True),
    # every module opaque
    "opaque": lambda: ExtractionOptions(skip_compilation=True),
}

#: Runs a test once per extraction mode; the test (or its fixture) takes ``options``.
opaque_and_compiled = pytest.mark.parametrize(
    "options", [pytest.param(make, id=mode) for mode, make in EXTRACTION_MODES.items()], indirect=True)
#: Runs a test in compiled mode only: it reaches op nodes or generated code, which opaque mode has not.
compiled_only = pytest.mark.parametrize(
    "options", [pytest.param(EXTRACTION_MODES["compiled"], id="compiled")], indirect=True)


def shared_dir() -> Path:
    """The project's ``shared/`` folder: ``$NNBRIDGE_SHARED``, else beside the checkout, else beside
    the checkout this one was cloned from (a clone made elsewhere, e.g. in a temp dir)."""
    candidates = [os.environ.get("NNBRIDGE_SHARED"), REPO.parent / "shared"]
    origin = subprocess.run(["git", "-C", str(REPO), "config", "remote.origin.url"], capture_output=True, text=True)
    if origin.returncode == 0 and origin.stdout.strip():
        candidates.append(Path(origin.stdout.strip()).parent / "shared")
    for candidate in candidates:
        if candidate and (Path(candidate) / "data" / "gpt2_tokenizer").is_dir():
            return Path(candidate)
    raise FileNotFoundError("shared/data/gpt2_tokenizer not found beside the checkout; set NNBRIDGE_SHARED")


def gpt2_tokenizer_dir() -> Path:
    """The real GPT-2 BPE tokenizer files (``shared/data/gpt2_tokenizer``)."""
    return shared_dir() / "data" / "gpt2_tokenizer"


def load_fixture(name: str) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    """A seeded instance of a fixture module (``file.Class``) and its example inputs."""
    file, cls = name.split(".")
    module = importlib.import_module(f"fixtures.{file}")
    torch.manual_seed(0)
    model = getattr(module, cls)().eval()
    args, kwargs = module.inputs()
    return model, args, kwargs


def leaves(value: Any) -> list[Any]:
    """Pytree leaves, looking into ModelOutput (a dict) too, and into transformers' caches (each
    layer's keys and values), whether or not cache pytrees are registered in this process."""
    from transformers.cache_utils import Cache

    def expand(item: Any) -> Any:
        if isinstance(item, Cache):
            return [(getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in item.layers]
        return item
    value = value.to_tuple() if hasattr(value, "to_tuple") else value
    return pytree.tree_leaves(pytree.tree_map(expand, value, is_leaf=lambda item: isinstance(item, Cache)))


def assert_same(actual: Any, expected: Any) -> None:
    """Exact equality of two (nested) outputs: same structure, ``torch.equal`` tensors."""
    got, want = leaves(actual), leaves(expected)
    assert len(got) == len(want), f"{len(got)} leaves vs {len(want)}"
    for a, b in zip(got, want):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and torch.equal(a, b), f"tensors differ: {a} vs {b}"
        else:
            assert a == b


def assert_same_grads(model: torch.nn.Module, eager: torch.nn.Module) -> None:
    """Every parameter of ``model`` holds the gradient (``torch.equal``) its counterpart in ``eager``
    holds, pairing them in ``parameters()`` order; a mismatch names the parameter."""
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def assert_follows_edit(model: torch.nn.Module, x: torch.Tensor, edit: Any, front: str) -> None:
    """Extract ``model`` (whose submodule ``inner`` must get a graph) through ``front`` (``"bridge"``:
    the in-place bridge; ``"patchable_graph"``) and check it against a deep copy taken first, by
    ``torch.equal``; then ``edit(model, reference)``, which changes what eager computes (a global, an
    attribute of each) and returns the text ``nnbridge.explain`` gives for the change; then the same
    check again and, for the bridge, that the report names the change. The model is unbridged
    whatever happens."""
    reference = copy.deepcopy(model)
    run = nnbridge.bridge(model, x) if front == "bridge" else PatchableGraph(model, x)
    try:
        assert torch.equal(run(x), reference(x))
        assert "inner" not in nnbridge.explain(run).opaque
        change = edit(model, reference)
        assert torch.equal(run(x), reference(x)), "the graph kept what it read before"
        if front == "bridge":
            assert change in str(nnbridge.explain(run))
    finally:
        if front == "bridge":
            nnbridge.unbridge(model)


def graph_modules(root: torch.nn.Module) -> list[CompiledGraphModule]:
    return [m for m in root.modules() if isinstance(m, CompiledGraphModule)]


def named_graph_modules(root: torch.nn.Module) -> dict[str, CompiledGraphModule]:
    """``{path: graph module}`` of every compiled graph in ``root``'s hierarchy (``root`` included)."""
    return {name: m for name, m in root.named_modules() if isinstance(m, CompiledGraphModule)}


def assert_same_records(full_root: torch.nn.Module, reused_root: torch.nn.Module) -> None:
    """Every graph under ``reused_root`` carries what the full extraction's graph at the same path carries:
    per node the op, the NodeMeta record (name, module path, extra arguments, example summary) and
    fx's stack trace; per graph the signature flag, the untouched cache layers and the tensors it
    reads (the module's own parameters and buffers, or equal lifted constants, which export numbers
    per program)."""
    def unnumbered(name: object) -> str:
        return re.sub(r"lifted_tensor_\d+", "lifted_tensor", str(name))
    full, reused = named_graph_modules(full_root), named_graph_modules(reused_root)
    assert list(full) == list(reused)
    for name in full:
        a, b = full[name], reused[name]
        nodes_a, nodes_b = list(a.graph.nodes), list(b.graph.nodes)
        assert [(n.op, unnumbered(n.target)) for n in nodes_a] == [(n.op, unnumbered(n.target)) for n in nodes_b], name
        for x, y in zip(nodes_a, nodes_b):
            assert node_meta(x) == node_meta(y), (name, x.name)
            assert x.meta.get("stack_trace") == y.meta.get("stack_trace"), (name, x.name)
        meta_a, meta_b = a.graph_meta, b.graph_meta
        assert (meta_a.exact_signature, meta_a.untouched) == (meta_b.exact_signature, meta_b.untouched), name
        assert [(k, v.data_ptr()) for k, v in a.named_parameters()] == \
            [(k, v.data_ptr()) for k, v in b.named_parameters()], name
        buffers_a, buffers_b = dict(a.named_buffers()), dict(b.named_buffers())
        assert [unnumbered(k) for k in buffers_a] == [unnumbered(k) for k in buffers_b], name
        for (k, x), y in zip(buffers_a.items(), buffers_b.values()):
            assert torch.equal(x, y) and ("lifted_tensor" in k or x.data_ptr() == y.data_ptr()), (name, k)


@contextlib.contextmanager
def forward_spy(*modules: torch.nn.Module) -> Iterator[list[str]]:
    """Record every call of the given modules (and of every submodule of them)."""
    calls: list[str] = []
    handles = [sub.register_forward_pre_hook(lambda m, a: calls.append(type(m).__name__))
               for module in modules for sub in module.modules()]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


# -- nnsight-style wrappers over the text models (test_envoys, test_nnsight_parity) ---------------
PROMPTS = ["When Mary and John went to the store", "The capital of France is"]


def tokenizer():
    tok = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir())
    tok.pad_token = "<|endoftext|>"
    return tok


def wrap(library, kind):
    return library.TransformersModel(text_model(kind), tokenizer=tokenizer(), task="text-generation")


def layer(model, i):
    return model.transformer.h[i] if hasattr(model, "transformer") else model.model.layers[i]


def head(model):
    return model.lm_head


def cache_with_ops(tracer, model):
    """``tracer.cache()`` with every op's value too (``ops=True``) on an nnbridge model; nnsight's
    ``tracer.cache()`` on an nnsight one."""
    from nnbridge.envoys.models import _Bridged
    return tracer.cache(ops=True) if isinstance(model, _Bridged) else tracer.cache()


def cached(cache):
    """The tensors a DynamicCache holds: each initialized layer's keys and values."""
    return [t for layer in cache.layers if layer.is_initialized for t in (layer.keys, layer.values)]


# -- a toy decoder that makes its own transformers cache (test_cache_threading, test_nnsight_parity) --
class ToyCacheLayer(torch.nn.Module):
    """Writes keys and values into its cache layer (``Cache.update``, as an attention does).
    ``use_values``: whether it reads the values back (else nothing reads them); ``reads_first``:
    whether a later layer's code branches on cache layer 0's ``is_initialized``."""

    def __init__(self, index, use_values=True, reads_first=False):
        super().__init__()
        self.layer_idx, self.use_values, self.reads_first = index, use_values, reads_first
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, past_key_values):
        keys, values = past_key_values.update(self.proj(x)[:, None], x[:, None], self.layer_idx)
        out = x + keys[:, 0, -x.shape[1]:] * (values[:, 0, -x.shape[1]:] if self.use_values else 1)
        if self.reads_first and self.layer_idx > 0 and past_key_values.layers[0].is_initialized:
            out = out * 2
        return out


class ToyCacheStack(torch.nn.Module):
    """``layers`` :class:`ToyCacheLayer` s sharing a ``DynamicCache`` the forward makes; returns
    only the hidden states. Input: ``(batch, seq, 4)``."""

    def __init__(self, layers=3, **options):
        super().__init__()
        from transformers import PretrainedConfig
        self.config = PretrainedConfig(num_hidden_layers=layers)
        self.layers = torch.nn.ModuleList(ToyCacheLayer(i, **options) for i in range(layers))

    def forward(self, x):
        from transformers.cache_utils import DynamicCache
        cache = DynamicCache(config=self.config)
        for block in self.layers:
            x = block(x, past_key_values=cache)
        return x


# -- GPT-2 code replaced at run time (the code digest, the guard on code, the caches' keys) -----------
def halved_mlp(self, hidden_states):
    """A GPT2MLP forward whose output is half the real one's."""
    return self.dropout(self.c_proj(self.act(self.c_fc(hidden_states)))) * 0.5


def doubled_queries(module, query, key, value, attention_mask, **kwargs):
    """GPT-2's eager attention with doubled queries."""
    return _GPT2_EAGER_ATTENTION(module, query * 2.0, key, value, attention_mask, **kwargs)


def doubled_queries_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention with doubled queries."""
    return _SDPA_ATTENTION(module, query * 2.0, key, value, attention_mask, **kwargs)


def replace_gpt2_code(monkeypatch, kind):
    """Replace one piece of the code GPT-2 runs, through ``monkeypatch`` (undone after the test):
    ``class_method`` (GPT2MLP.forward), ``module_helper`` (modeling_gpt2.eager_attention_forward)
    or ``attention_registry`` (ALL_ATTENTION_FUNCTIONS["sdpa"]; call the model with sdpa)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.gpt2 import modeling_gpt2
    if kind == "class_method":
        monkeypatch.setattr(modeling_gpt2.GPT2MLP, "forward", halved_mlp)
    elif kind == "module_helper":
        monkeypatch.setattr(modeling_gpt2, "eager_attention_forward", doubled_queries)
    elif kind == "attention_registry":
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", doubled_queries_sdpa)
    else:
        raise ValueError(kind)


_GPT2_EAGER_ATTENTION = importlib.import_module("transformers.models.gpt2.modeling_gpt2").eager_attention_forward
_SDPA_ATTENTION = importlib.import_module("transformers.integrations.sdpa_attention").sdpa_attention_forward


# -- a toy layer indexed by its cache layer (test_layer_reuse, test_sibling_roots) -------------------
class ToyIndexedLayer(torch.nn.Module):
    """A decoder-like layer: writes ``proj(x)`` to its cache layer ``layer_idx`` and adds the mean
    of its cached keys and values. ``scaled`` multiplies by ``layer_idx + 1`` (a use of the index
    in arithmetic); ``peek`` also reads cache layer 0's keys (a constant index); ``extra`` passes
    the update one more tensor, ``"input"`` (``x``, as transformers 5.24 passes ``position_ids``)
    or ``"computed"`` (the keys it computed)."""

    def __init__(self, layer_idx: int, scaled: bool = False, peek: bool = False, extra: str | None = None):
        super().__init__()
        self.layer_idx, self.scaled, self.peek, self.extra = layer_idx, scaled, peek, extra
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, past_key_values):
        k = self.proj(x).unsqueeze(1)  # (batch, 1, seq, 8)
        more = {} if self.extra is None else {"kwargs": {"seen": x if self.extra == "input" else k}}
        keys, values = past_key_values.update(k, 2 * k, self.layer_idx, **more)
        out = x + keys.mean(-2) + values.mean(-2)
        if self.peek:
            out = out + past_key_values.layers[0].keys.mean(-2)
        if self.scaled:
            out = out * (self.layer_idx + 1)
        return out


def toy_layer_cache(lengths=None):
    """A 3-layer ``DynamicCache`` for :class:`ToyIndexedLayer` s, layer ``i`` holding ``lengths[i]``
    random tokens (none: empty)."""
    from transformers import DynamicCache, GPT2Config
    cache = DynamicCache(config=GPT2Config(n_layer=3))
    torch.manual_seed(2)
    for i, n in enumerate(lengths or []):
        if n:
            cache.update(torch.randn(2, 1, n, 8), torch.randn(2, 1, n, 8), i)
    return cache


class PastPlusNew(torch.nn.Module):
    """A cache-like concatenation: the mask's length is the past's plus one (``past + 1``), a size
    export derives from another input's."""

    def forward(self, past, new, mask):
        return torch.cat([past, new], dim=1) * mask[..., None]


def past_plus_new(length, mask_length=None):
    """Inputs of :class:`PastPlusNew`: past ``(2, length, 4)``, new ``(2, 1, 4)``, mask ``(2, length + 1)``
    (or ``(2, mask_length)``)."""
    return (torch.randn(2, length, 4), torch.randn(2, 1, 4),
            torch.randn(2, length + 1 if mask_length is None else mask_length))


class ListedWeight(torch.nn.Module):
    """A list attribute holding the module's own parameter (as ``nn.LSTM._flat_weights``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.weights = [self.lin.weight]

    def forward(self, x):
        return x @ self.weights[0].t() + self.lin.bias


def front_ends(make, example, op=None):
    """``(name, run, target, reference)`` per front-end (PatchableGraph, in-place bridge, nnsight
    trace): ``run(x)`` calls it on ``target``, a fresh ``make()``; ``reference`` is another
    ``make()`` that stays plain eager. ``op``: an op envoy the trace also reads (then the graphs
    run; a trace that reads no op runs the model's own code)."""
    model = make()
    pg = PatchableGraph(model, example)
    bridged = nnbridge.bridge(make(), example)
    traced = nnbridge.NNsight(make())

    def through_nnsight(x):
        with traced.trace(x):
            if op is not None:
                getattr(traced, op).output.save()
            out = traced.output.save()
        return out
    return [("pg", pg, model, make()), ("bridge", bridged, bridged, make()),
            ("nnsight", through_nnsight, traced._module, make())]


def same_tree(a, b) -> bool:
    """Whether two ``pg.graph`` views print the same tree. An operator's tensor list (``split``)
    shows as ``tuple(n)`` after a recording run and as ``list(n)`` when summarized from export's
    metadata (a loaded or cached program); that known difference of the display is left out."""
    def text(view):
        return re.sub(r"\b(tuple|list)\((\d+)\)", r"sequence(\2)", repr(view))
    return text(a) == text(b)


def language_model(library, **kwargs):
    """Tiny GPT-2 under ``library.TransformersModel`` (nnsight's or nnbridge's), with the real tokenizer."""
    return library.TransformersModel(text_model("gpt2"), tokenizer=tokenizer(), task="text-generation", **kwargs)
