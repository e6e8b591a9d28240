"""Sibling roots (issue 13): the layers an opaque module calls are exported once per group of siblings.

transformers' output capturing (``output_attentions=True``) makes the decoder stack opaque, so each
decoder layer is extracted as the root of its own export, through its own dispatcher: SmolLM2 took
30 exports (18 s). Now the first layer is exported with the attributes that differ between the
layers watched, and the others build their graphs from its program over their own parameters and
cache layer (see ``nnbridge.extract.sibling_roots``). Every model runs three ways: eager (an
untouched copy), bridged with reuse, bridged without (``reuse_layers=False``, a full extraction);
outputs, attentions, caches, gradients, graph code, NodePaths and per-layer patches must be equal
(``torch.equal``). A layer whose graph would depend on what differs between the siblings (its
index in arithmetic, another cache layer) is exported itself.
"""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
import torch

import nnbridge
from nnbridge import CompiledGraphModule, ExtractionOptions
from nnbridge.dispatch import extraction as extraction_module
from nnbridge.extract.building import GraphBuilder
from nnbridge.graph.hierarchy import walk
from nnbridge.inplace.bridging import bridge_of
from nnbridge.extract.reuse_plan import ReuseFallback
from nnbridge.errors import ExtractionError
from utils import ToyIndexedLayer, assert_same_records, gemma3, gpt2, llama, toy_layer_cache

pytestmark = [pytest.mark.no_extraction_cache,  # exports are counted: each test extracts anew
              pytest.mark.integration]  # end to end: whole models' layers extracted as roots, decoded step by step

REUSE = ExtractionOptions(reuse_layers=True)
FULL = ExtractionOptions(reuse_layers=False)


def _three(factory):
    def make():
        config = factory().config
        config.num_hidden_layers = 3
        if hasattr(config, "n_layer"):
            config.n_layer = 3
        torch.manual_seed(0)
        return type(factory())(config).eval()
    return make


MODELS = {  # (factory, {sibling: representative} expected, the layers' path, the class of a layer)
    "gpt2": (_three(gpt2), {"transformer.h.1": "transformer.h.0", "transformer.h.2": "transformer.h.0"},
             "transformer.h", "GPT2Block"),
    "llama": (_three(llama), {"model.layers.1": "model.layers.0", "model.layers.2": "model.layers.0"},
              "model.layers", "LlamaDecoderLayer"),
    # alternating layer kinds (sliding window, full attention): reused within each kind
    "gemma3": (lambda: gemma3(("sliding_attention", "sliding_attention", "full_attention", "full_attention")),
               {"model.layers.1": "model.layers.0", "model.layers.3": "model.layers.2"}, "model.layers",
               "Gemma3DecoderLayer"),
}


@pytest.fixture
def exported(monkeypatch):
    """The class names of the modules torch.export runs on, in order."""
    names: list[str] = []
    real = extraction_module.export_module

    def counted(module, *args, **kwargs):
        names.append(type(module).__name__)
        return real(module, *args, **kwargs)
    monkeypatch.setattr(extraction_module, "export_module", counted)
    return names


def _dispatchers(root):
    """Every child dispatcher of an opaque module in ``root``'s hierarchy: ``{path: dispatcher}``."""
    found = {}
    for module in [root, *(sub for _, _, _, sub in walk(root) if sub is not None)]:
        for dispatcher in (getattr(module.graph_meta, "child_dispatchers", None) or {}).values():
            found[dispatcher.path] = dispatcher
            for extraction in dispatcher.all_extractions():
                found.update(_dispatchers(extraction.root))
    return found


def _sibling_roots(model) -> dict[str, str]:
    """``{layer path: representative path}`` of the layers built from a representative's program."""
    reused = {}
    for extraction in bridge_of(model).dispatcher.all_extractions():
        for path, dispatcher in _dispatchers(extraction.root).items():
            for child in dispatcher.all_extractions():
                if child.root.graph_meta.reused_from:
                    reused[path] = child.root.graph_meta.reused_from
    return reused


def _layer_roots(model) -> dict[str, CompiledGraphModule]:
    """The most recent extraction's root graph of every layer extracted through a dispatcher."""
    roots = {}
    for extraction in bridge_of(model).dispatcher.all_extractions():
        for path, dispatcher in _dispatchers(extraction.root).items():
            if dispatcher.all_extractions():
                roots[path] = dispatcher.all_extractions()[-1].root
    return roots


def _bridged(factory, options, ids):
    model = factory()
    nnbridge.bridge(model, ids, options=options)
    return model


def _assert_outputs_equal(out, ref):
    assert torch.equal(out.logits, ref.logits)
    for name in ("attentions", "hidden_states"):
        mine, theirs = getattr(out, name), getattr(ref, name)
        assert (mine is None) == (theirs is None), name
        if mine is not None:
            assert len(mine) == len(theirs) and all(torch.equal(a, b) for a, b in zip(mine, theirs)), name
    if ref.past_key_values is not None:
        for a, b in zip(out.past_key_values.layers, ref.past_key_values.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.fixture(scope="module", params=list(MODELS))
def case(request):
    """One model bridged with reuse and without (each called once with ``output_attentions=True``,
    ``output_hidden_states=True`` and the default cache, the class names torch.export ran on
    recorded), and an untouched copy with its output for that call."""
    name = request.param
    factory, expected, layers, layer_class = MODELS[name]
    torch.manual_seed(1)
    ids = torch.randint(1, 100, (2, 7))
    kwargs = dict(output_attentions=True, output_hidden_states=True)
    names: list[str] = []
    real = extraction_module.export_module

    def counted(module, *args, **kw):
        names.append(type(module).__name__)
        return real(module, *args, **kw)
    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(extraction_module, "export_module", counted)
        for label, options in (("reuse", REUSE), ("full", FULL)):
            model = _bridged(factory, options, ids)
            names.clear()
            out = model(ids, **kwargs)
            runs[label] = (model, out, list(names))
    eager = factory()
    return SimpleNamespace(name=name, ids=ids, kwargs=kwargs, expected=expected, layers=layers,
                           layer_class=layer_class, eager=eager, ref=eager(ids, **kwargs), reuse=runs["reuse"],
                           full=runs["full"])


def test_layers_are_built_from_their_representative(case):
    """One export per group of sibling layers (the root is exported once: its decoder stack is
    found collecting outputs before exporting); the full extraction exports every layer."""
    (model, _, exported), (full, _, full_exported) = case.reuse, case.full
    assert _sibling_roots(model) == case.expected and _sibling_roots(full) == {}
    layers = len(model.get_submodule(case.layers))
    assert exported.count(case.layer_class) == layers - len(case.expected)
    assert exported.count(type(model).__name__) == 1
    assert full_exported.count(case.layer_class) == layers


def test_outputs_attentions_hidden_states_and_cache_equal_eager_and_full(case):
    for _, out, _ in (case.reuse, case.full):
        _assert_outputs_equal(out, case.ref)
    no_cache = dict(case.kwargs, use_cache=False)
    ref = case.eager(case.ids, **no_cache)
    for model, _, _ in (case.reuse, case.full):
        _assert_outputs_equal(model(case.ids, **no_cache), ref)


def test_graph_code_and_node_paths_equal_a_full_extraction(case):
    """The same modules, NodePaths and node names; the same code, but for Gemma 3's state reads: a
    sliding layer reads its own window tensor where the full extraction also read layer 0's (unused)."""
    mine, theirs = _layer_roots(case.reuse[0]), _layer_roots(case.full[0])
    assert mine.keys() == theirs.keys() and set(case.expected) <= mine.keys()
    for path in mine:
        a, b = dict(mine[path].named_modules()), dict(theirs[path].named_modules())
        assert list(a) == list(b), path
        for sub in a:
            if isinstance(a[sub], CompiledGraphModule):
                assert [n.name for n in a[sub].graph.nodes] == [n.name for n in b[sub].graph.nodes], (path, sub)
                assert a[sub].graph_meta.node_path == b[sub].graph_meta.node_path, (path, sub)
                assert a[sub].code == b[sub].code or (case.name == "gemma3" and "read_state" in a[sub].code), \
                    (path, sub)


def test_gradients_equal_eager(case):
    model, eager = case.reuse[0], case.eager
    grads = []
    for m in (eager, model):
        m.zero_grad(set_to_none=True)
        out = m(case.ids, output_attentions=True, use_cache=False)
        (out.logits.square().sum() + sum(a.square().sum() for a in out.attentions)).backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
        m.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert (grads[0][n] is None) == (grads[1][n] is None), n
        assert grads[0][n] is None or torch.equal(grads[0][n], grads[1][n]), n


def test_per_layer_op_hooks_equal_a_full_extraction(case):
    """A torch hook on layer k's softmax op point changes the output exactly as on a full
    extraction; each layer's op point is its own."""
    softmax = "attn.softmax" if case.name == "gpt2" else "self_attn.softmax"
    results = {}
    for label, (model, _, _) in (("full", case.full), ("reuse", case.reuse)):
        plain = model(case.ids, output_attentions=True).logits
        per_layer = []
        for i in range(len(model.get_submodule(case.layers))):
            point = model.get_submodule(f"{case.layers}.{i}.{softmax}")
            handle = point.register_forward_hook(lambda module, args, output: output * 0.5)
            try:
                patched = model(case.ids, output_attentions=True)
            finally:
                handle.remove()
            assert not torch.equal(patched.logits, plain)
            per_layer.append((patched.logits, patched.attentions))
        results[label] = per_layer
    for (a, att_a), (b, att_b) in zip(results["full"], results["reuse"]):
        assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(att_a, att_b))
    assert not torch.equal(results["reuse"][1][0], results["reuse"][2][0])


def test_a_decode_step_and_another_length_of_each_case_equal_eager(case):
    """A decode step with the prefill's cache, and another prompt length, batch of 2: equal to eager."""
    ids, step, other = case.ids, torch.randint(1, 100, (2, 1)), torch.randint(1, 100, (2, 10))
    results = []
    with torch.no_grad():
        for m in (case.eager, case.reuse[0]):
            first = m(ids, output_attentions=True)
            results.append((first, m(step, past_key_values=first.past_key_values, output_attentions=True),
                            m(other, output_attentions=True)))
    for mine, theirs in zip(results[1], results[0]):
        _assert_outputs_equal(mine, theirs)
    assert _sibling_roots(case.reuse[0]) == case.expected


def test_nnsight_envoys_per_layer_equal_a_full_extraction():
    ids = torch.randint(1, 100, (1, 6))
    results = {}
    for label, options in (("full", FULL), ("reuse", REUSE)):
        model = _bridged(MODELS["llama"][0], options, ids)
        wrapped = nnbridge.NNsight(model)
        with wrapped.trace(ids, output_attentions=True):
            seen_0 = wrapped.model.layers[0].self_attn.softmax.output.save()
            seen_1 = wrapped.model.layers[1].self_attn.softmax.output.save()
            seen_2 = wrapped.model.layers[2].self_attn.softmax.output.save()
            wrapped.model.layers[2].self_attn.softmax.output[:] = 0
            logits = wrapped.lm_head.output.save()
        results[label] = ([seen_0, seen_1, seen_2], logits, _sibling_roots(model))
    (seen_full, logits_full, reused_full), (seen, logits, reused) = results["full"], results["reuse"]
    assert reused_full == {} and reused == MODELS["llama"][1]
    assert all(torch.equal(a, b) for a, b in zip(seen_full, seen))
    assert not torch.equal(seen[0], seen[1])
    assert torch.equal(logits_full, logits)
    eager = MODELS["llama"][0]()
    assert not torch.equal(logits, eager(ids).logits)  # the patch took effect


@pytest.mark.parametrize("name", list(MODELS))
def test_decode_steps_and_another_length_equal_eager(name):
    """A decode step with the prefill's cache, and another prompt length: equal to eager."""
    factory, expected, *_ = MODELS[name]
    ids, step, other = torch.randint(1, 100, (1, 6)), torch.randint(1, 100, (1, 1)), torch.randint(1, 100, (1, 9))
    eager = factory()
    model = _bridged(factory, REUSE, ids)
    with torch.no_grad():
        for m in (eager, model):
            first = m(ids, output_attentions=True)
            m.__dict__["_results"] = (first, m(step, past_key_values=first.past_key_values, output_attentions=True),
                                      m(other, output_attentions=True))
    for mine, theirs in zip(model.__dict__.pop("_results"), eager.__dict__.pop("_results")):
        _assert_outputs_equal(mine, theirs)
    assert _sibling_roots(model) == expected


@pytest.mark.parametrize("name", list(MODELS))
def test_decode_steps_after_the_first_export_nothing_and_equal_eager(name, exported):
    """Decoding with ``output_attentions=True``: the first decode step exports each group's
    representative once (a new call structure: a filled cache); the later steps, with a longer cache
    and attention mask each (a size export derives from the cache's: ``past + 1``), are served by
    those extractions, the siblings' included (their guards address their own cache layer), with
    no export; every step equals eager. Gemma 3's sliding-window cache layers hold an int that
    grows each step (``cumulative_length``), part of every call's structure, so each of its steps
    exports the representatives again (one export per group, not per layer), and its layers'
    prefill graphs are specialised to the prompt's length (a new prompt exports them again)."""
    factory, expected, path, layer_class = MODELS[name]
    ids = torch.randint(1, 100, (1, 6))
    eager = factory()
    model = _bridged(factory, REUSE, ids)
    caches = {}
    per_step = []
    with torch.no_grad():
        for step in range(4):
            tokens = ids if step == 0 else torch.randint(1, 100, (1, 1))
            before = len(exported)
            mine = model(tokens, past_key_values=caches.get("mine"), output_attentions=True)
            theirs = eager(tokens, past_key_values=caches.get("theirs"), output_attentions=True)
            per_step.append(exported[before:].count(layer_class))
            caches = {"mine": mine.past_key_values, "theirs": theirs.past_key_values}
            _assert_outputs_equal(mine, theirs)
        # a new prompt, called as the first: the prefill's extractions serve it, though the decode
        # steps extracted the stack again on its own (its layers keep one dispatcher each)
        before = len(exported)
        other = torch.randint(1, 100, (1, 9))
        _assert_outputs_equal(model(other, past_key_values=None, output_attentions=True),
                              eager(other, past_key_values=None, output_attentions=True))
        new_prompt = exported[before:]
    representatives = len(set(expected.values()))
    later = [representatives] * 2 if name == "gemma3" else [0, 0]
    assert per_step[1:] == [representatives, *later], per_step
    assert new_prompt == ([layer_class] * representatives if name == "gemma3" else []), new_prompt
    assert _sibling_roots(model) == expected


def test_output_capturing_found_before_exporting_names_the_module_under_the_error_option():
    """The decoder stack collecting outputs is found by extraction's eager run: the same opaque
    reason as export gave, and, with ``error_on_compilation_failure``, an error naming it (nothing
    left bridged)."""
    ids = torch.randint(1, 100, (1, 6))
    model = _bridged(MODELS["gpt2"][0], REUSE, ids)
    model(ids, output_attentions=True)
    reasons = {}
    for extraction in bridge_of(model).dispatcher.all_extractions():
        reasons.update(extraction.opaque)
    assert reasons == {"transformer": "CapturingOutputs: transformers collects outputs of its submodules with hooks"
                                      " here (output_attentions or output_hidden_states); the module runs its own code"
                                      " and its children are graphs"}
    strict = MODELS["gpt2"][0]()
    with pytest.raises(ExtractionError, match="'transformer'.*collects outputs"):
        nnbridge.bridge(strict, ids, output_attentions=True, options=ExtractionOptions(error_on_compilation_failure=True))
    assert bridge_of(strict) is None


# -- toy layers: what must not be reused -----------------------------------------------------------
class _ToyStack(torch.nn.Module):
    """Three :class:`~utils.ToyIndexedLayer` s; skipped (opaque), so each layer is extracted as its own root."""

    def __init__(self, **layer_options):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 8)  # every layer's input requires grad alike (the call structure)
        self.layers = torch.nn.ModuleList(ToyIndexedLayer(i, **layer_options) for i in range(3))

    def forward(self, x, past_key_values):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x, past_key_values)
        return x


class _PlainLayer(torch.nn.Module):
    def __init__(self, index: int, scaled: bool):
        super().__init__()
        self.index, self.scaled = index, scaled
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.proj(x)) * (self.index + 1 if self.scaled else 1)


class _PlainStack(torch.nn.Module):
    def __init__(self, scaled: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 8)  # every layer's input requires grad alike (the call structure)
        self.layers = torch.nn.ModuleList(_PlainLayer(i, scaled) for i in range(3))

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _skipped(model) -> ExtractionOptions:
    return ExtractionOptions(reuse_layers=True, classes_to_skip_compiling={type(model)})


def _toy_run(model, x, cache_factory, caplog):
    """The layers reused for one call of the skipped stack (its output and cache equal eager's)."""
    eager_cache, bridged_cache = cache_factory(), cache_factory()
    eager = copy.deepcopy(model)(x, eager_cache)
    with caplog.at_level(logging.INFO, logger="nnbridge.dispatch.extraction"):
        nnbridge.bridge(model, x, cache_factory(), options=_skipped(model))
        out = model(x, bridged_cache)
    assert torch.equal(out, eager)
    for a, b in zip(bridged_cache.layers, eager_cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    return _sibling_roots(model), caplog.text


def test_toy_cache_layers_reused_in_prefill_and_decode(caplog):
    x = torch.randn(2, 5, 8)
    assert _toy_run(_ToyStack(), x, toy_layer_cache, caplog)[0] == {"layers.1": "layers.0", "layers.2": "layers.0"}
    reused, log = _toy_run(_ToyStack(), x, lambda: toy_layer_cache([3, 3, 3]), caplog)
    assert reused == {"layers.1": "layers.0", "layers.2": "layers.0"}, log


def test_cache_index_in_arithmetic_makes_every_layer_export_itself(caplog, exported):
    reused, log = _toy_run(_ToyStack(scaled=True), torch.randn(2, 5, 8), toy_layer_cache, caplog)
    assert reused == {} and exported.count("ToyIndexedLayer") == 3


def test_another_cache_layer_read_makes_every_layer_export_itself(caplog):
    reused, log = _toy_run(_ToyStack(peek=True), torch.randn(2, 5, 8), lambda: toy_layer_cache([3, 3, 3]), caplog)
    assert reused == {}


def test_cache_layers_of_other_lengths_are_reused(caplog):
    """Layer 1 holds more tokens than layer 0 did: the representative's dynamic guard, its code
    rewritten to address layer 1's own cache tensors, accepts them (outputs and cache equal eager)."""
    reused, log = _toy_run(_ToyStack(), torch.randn(2, 5, 8), lambda: toy_layer_cache([3, 4, 3]), caplog)
    assert reused == {"layers.1": "layers.0", "layers.2": "layers.0"}, log


@pytest.mark.parametrize("lengths", [[3, 0, 3], [1, 4, 1]], ids=["empty_layer", "static_length"])
def test_cache_layers_the_representatives_graph_does_not_serve_are_not_reused(lengths, caplog):
    """Layer 1 empty while layer 0 held tokens (another state: its graph would differ), or layer 0
    held one token (a size-1 dimension export specialises) and layer 1 holds 4: layer 1 exports
    itself, layer 2 (as layer 0) is reused; outputs and cache equal eager."""
    reused, log = _toy_run(_ToyStack(), torch.randn(2, 5, 8), lambda: toy_layer_cache(lengths), caplog)
    assert reused == {"layers.2": "layers.0"}, log


def test_lazily_appended_cache_is_not_reused(caplog):
    from transformers import DynamicCache
    assert _toy_run(_ToyStack(), torch.randn(2, 5, 8), DynamicCache, caplog)[0] == {}


@pytest.mark.parametrize("scaled", [False, True], ids=["same", "index_read"])
def test_layers_without_state(scaled, exported):
    """Without a cache: siblings reuse unless a layer reads its differing ``index``; exact either
    way, at the extracted length and another one."""
    model = _PlainStack(scaled)
    eager = copy.deepcopy(model)
    x, other = torch.randn(2, 5, 8), torch.randn(3, 7, 8)
    nnbridge.bridge(model, x, options=_skipped(model))
    assert torch.equal(model(x), eager(x)) and torch.equal(model(other), eager(other))
    assert _sibling_roots(model) == ({} if scaled else {"layers.1": "layers.0", "layers.2": "layers.0"})
    assert exported.count("_PlainLayer") == (3 if scaled else 1)


class _FlagLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, flip=False):
        return -self.proj(x) if flip else self.proj(x)


class _FlagStack(torch.nn.Module):
    """Layer 1 is called with ``flip=True``, the others with the default: a graph specialises on it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 8)
        self.layers = torch.nn.ModuleList(_FlagLayer() for _ in range(3))

    def forward(self, x):
        x = self.inp(x)
        for i, layer in enumerate(self.layers):
            x = layer(x, flip=i == 1)
        return x


def test_a_sibling_called_with_another_value_exports_itself():
    model = _FlagStack()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 5, 8)
    nnbridge.bridge(model, x, options=_skipped(model))
    assert torch.equal(model(x), eager(x))
    assert _sibling_roots(model) == {"layers.2": "layers.0"}


def test_a_sibling_changed_after_bridging_exports_itself():
    """Layer 2 made to scale its output after bridging: its guard fails, and its new extraction is
    its own (it is no longer its representative's sibling), not one built from layer 0's program."""
    model = _PlainStack()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 5, 8)
    nnbridge.bridge(model, x, options=_skipped(model))
    assert torch.equal(model(x), eager(x))
    for m in (model, eager):
        m.layers[2].scaled = True
    assert torch.equal(model(x), eager(x))
    assert _sibling_roots(model).get("layers.2") is None or len(_dispatchers(
        bridge_of(model).dispatcher.all_extractions()[-1].root)["layers.2"].history) == 2
    # every layer changed: layer 1 must not be built from layer 0's extraction made before the change
    for m in (model, eager):
        for layer in m.layers:
            layer.scaled = True
    assert torch.equal(model(x), eager(x))


def test_a_new_length_reuses_the_siblings_extractions(exported):
    """A sibling's shape guard is its representative's: the opaque stack's dispatchers serve
    another length without extracting again."""
    model = _PlainStack()
    x = torch.randn(2, 5, 8)
    nnbridge.bridge(model, x, options=_skipped(model))
    exported.clear()
    model(torch.randn(3, 9, 8))
    assert exported == []
    for path, dispatcher in _dispatchers(bridge_of(model).dispatcher.all_extractions()[0].root).items():
        assert len(dispatcher.history) == 1, path


def test_disk_cache_second_bridge_builds_siblings_without_exporting(tmp_path, monkeypatch, exported):
    """The representative's program record keeps what its watched export read (nothing): a second
    bridge served by the disk cache builds the siblings from it, with no export."""
    monkeypatch.setenv("NNBRIDGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("NNBRIDGE_EXTRACTION_CACHE", raising=False)
    ids = torch.randint(1, 100, (1, 6))
    factory, expected, _, layer_class = MODELS["llama"]
    first = _bridged(factory, REUSE, ids)
    first(ids, output_attentions=True)
    assert exported.count(layer_class) == 1
    second = _bridged(factory, REUSE, ids)
    exported.clear()
    out = second(ids, output_attentions=True)
    # (the rotary embedding, opaque, is exported again: no program is kept for an opaque root)
    assert layer_class not in exported and "LlamaForCausalLM" not in exported
    assert _sibling_roots(second) == expected
    _assert_outputs_equal(out, factory()(ids, output_attentions=True))


def test_reuse_layers_off_exports_every_layer(exported):
    model = _PlainStack()
    x = torch.randn(2, 5, 8)
    nnbridge.bridge(model, x, options=ExtractionOptions(reuse_layers=False, classes_to_skip_compiling={_PlainStack}))
    assert _sibling_roots(model) == {} and exported.count("_PlainLayer") == 3


@pytest.mark.parametrize("output_attentions", [False, True], ids=["one_export", "sibling_roots"])
def test_a_layer_in_train_mode_among_layers_in_eval_mode_is_not_reused(output_attentions):
    """GPT-2 with dropout, layer 2 alone in train mode: layer reuse inside one export and across
    dispatchers both export it itself (its graph keeps its dropout); the same random numbers give
    the same logits as eager. Both reused layer 0's graph, without dropout, before."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=100, attn_implementation="eager",
                                       resid_pdrop=0.5, attn_pdrop=0.5, embd_pdrop=0.0)).eval()
    model.transformer.h[2].train()
    eager = copy.deepcopy(model)
    ids = torch.randint(0, 100, (1, 6))
    nnbridge.bridge(model, ids, use_cache=False, options=REUSE)
    results = []
    for m in (model, eager):
        torch.manual_seed(1)
        results.append(m(ids, use_cache=False, output_attentions=output_attentions).logits)
    assert torch.equal(results[0], results[1])
    reused = _sibling_roots(model) if output_attentions else {
        name: m.graph_meta.reused_from for e in bridge_of(model).dispatcher.all_extractions()
        for name, m in e.root.named_modules() if isinstance(m, CompiledGraphModule) and m.graph_meta.reused_from}
    assert reused == {"transformer.h.1": "transformer.h.0"}


def _sibling_builder():
    """A stack bridged under ``torch.no_grad()`` and a function building layer 1 from layer 0's
    extraction for the same call (None: refused)."""
    model = _PlainStack().requires_grad_(False)  # the same inputs in both modes: only the mode differs
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        nnbridge.bridge(model, x, options=_skipped(model))
    children = _dispatchers(bridge_of(model).dispatcher.all_extractions()[0].root)
    rep, sibling = children["layers.0"], children["layers.1"]
    shared = rep.all_extractions()[0].shared
    assert shared is not None
    call = ((model.inp(x),), {})
    return lambda: extraction_module.extract_sibling(
        sibling.module, *call, options=REUSE, source=shared, index=None, child_dispatcher=lambda child, path: None,
        path="layers.1")


def test_a_representative_extracted_in_another_grad_mode_serves_no_sibling():
    """Graphs bake in the grad mode they were exported under: a sibling is built from a
    representative's extraction only in the same grad mode (and autocast state)."""
    build = _sibling_builder()
    with torch.no_grad():
        assert build() is not None
    assert build() is None


def test_a_representative_extracted_under_another_default_dtype_serves_no_sibling():
    """The same for the default dtype (``torch.set_default_dtype``), which graphs bake in too."""
    build = _sibling_builder()
    with torch.no_grad():
        assert build() is not None
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            assert build() is None
        finally:
            torch.set_default_dtype(previous)


@pytest.fixture
def built_from(monkeypatch):
    """How many sibling roots were built from their representative's built graphs (``from_shared``)."""
    count = [0]
    from_shared = GraphBuilder.from_shared

    def spy(self, *args, **kwargs):
        count[0] += 1
        return from_shared(self, *args, **kwargs)
    monkeypatch.setattr(GraphBuilder, "from_shared", spy)
    return count


@pytest.mark.parametrize("name", list(MODELS))
def test_sibling_roots_copy_the_representatives_built_graphs_with_a_full_extractions_records(name, built_from):
    """Every sibling root's graphs are copies of its representative's built graphs: every record
    of every graph equals a full extraction's (Gemma 3 without its cache, whose sliding layers read
    their own window tensor where a full extraction reads layer 0's too, see
    test_graph_code_and_node_paths_equal_a_full_extraction), and outputs equal eager."""
    factory, expected, _, _ = MODELS[name]
    torch.manual_seed(1)
    ids = torch.randint(1, 100, (2, 7))
    eager, reused, full = factory(), _bridged(factory, REUSE, ids), _bridged(factory, FULL, ids)
    calls = [{"use_cache": False}] if name == "gemma3" else [{"use_cache": False}, {}]
    for kwargs in calls:
        before = built_from[0]
        _assert_outputs_equal(reused(ids, output_attentions=True, **kwargs), eager(ids, output_attentions=True, **kwargs))
        full(ids, output_attentions=True, **kwargs)
        assert built_from[0] - before == len(expected), kwargs
        mine, theirs = _layer_roots(reused), _layer_roots(full)
        for path in expected:
            assert mine[path].graph_meta.reused_from == expected[path]
            assert_same_records(theirs[path], mine[path])
    assert _sibling_roots(reused) == expected


def test_a_sibling_root_whose_graph_has_no_built_copy_is_exported_itself(monkeypatch, exported, built_from):
    """A graph of the representative without a kept built graph (here: its attention's) means the
    sibling is not built from it: the sibling is exported itself, and outputs equal eager."""
    factory, expected, _, layer_class = MODELS["llama"]
    shared_template = GraphBuilder.shared_template

    def without_attention(self, fqn, invocation):
        if fqn == "self_attn":
            raise ReuseFallback("no built graph (test)")
        return shared_template(self, fqn, invocation)
    monkeypatch.setattr(GraphBuilder, "shared_template", without_attention)
    ids = torch.randint(1, 100, (2, 7))
    model, eager = _bridged(factory, REUSE, ids), factory()
    exported.clear()
    _assert_outputs_equal(model(ids, output_attentions=True), eager(ids, output_attentions=True))
    assert exported.count(layer_class) == 3 and built_from[0] == 2
    assert _sibling_roots(model) == {}


class _Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.proj(x))


class _ExpertsLayer(torch.nn.Module):
    """A layer holding a ``ModuleList`` of identical experts: its own export reuses them (experts
    1 and 2 are stubbed and built from expert 0's graph)."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(_Expert() for _ in range(3))

    def forward(self, x):
        return x + sum(expert(x) for expert in self.experts)


class _ExpertsStack(_PlainStack):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_ExpertsLayer() for _ in range(3))


def test_layers_whose_experts_were_reused_inside_the_representative_export_themselves(exported, built_from):
    """The representative layer's export stubbed its experts 1 and 2 (built from expert 0's graph),
    and its built graphs keep no copy of theirs, so no sibling layer is built from it; each exports
    itself. Outputs at two lengths and gradients equal eager (before, a sibling layer's experts 1
    and 2 were built from the program's stubs, and returned zeros, silently)."""
    model = _ExpertsStack()
    eager = copy.deepcopy(model)
    x, other = torch.randn(2, 5, 8), torch.randn(3, 4, 8)
    nnbridge.bridge(model, x, options=_skipped(model))
    assert torch.equal(model(x), eager(x)) and torch.equal(model(other), eager(other))
    assert _sibling_roots(model) == {} and exported.count("_ExpertsLayer") == 3 and built_from[0] == 2
    for m in (model, eager):
        m(x).square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), eager.parameters()))
