"""nnsight 0.8.1 parity (issue 12): trace bodies from nnsight's own tests (tests/test_lm.py,
test_tiny.py, test_envoys.py, re-written here) give equal values under nnsight and nnbridge."""

import copy

import nnsight
import pytest
import torch

import nnbridge
from utils import assert_same, cache_with_ops, head, layer, PROMPTS, ToyCacheStack, wrap


# -- .skip() with transformers' default cache (use_cache=True, DynamicCache) ---------------------
def basic_skip(model):
    with model.trace(PROMPTS[0]):
        layer(model, 0).skip(layer(model, 0).input)
        logits = head(model).output.save()
    return logits


def multiple_skips(model):
    with model.trace(PROMPTS[0]):
        layer(model, 0).skip(layer(model, 0).input)
        layer(model, 1).skip(layer(model, 1).input)
        logits = head(model).output.save()
    return logits


def second_layer_skip(model):
    with model.trace(PROMPTS[0]):
        layer(model, 1).skip(layer(model, 1).input)
        logits = head(model).output.save()
    return logits


def batched_skips(model):
    with model.trace() as tracer:
        with tracer.invoke(PROMPTS[0]):
            layer(model, 0).skip(layer(model, 0).input)
            first = head(model).output.save()
        with tracer.invoke(PROMPTS[1]):
            layer(model, 0).skip(layer(model, 0).input)
            second = head(model).output.save()
    return first, second


def skip_after_input_edit(model):
    with model.trace(PROMPTS[0]):
        hidden = layer(model, 0).input
        layer(model, 0).input = hidden * 2
        layer(model, 0).skip(layer(model, 0).input)
        logits = head(model).output.save()
    return logits


SKIPS = [basic_skip, multiple_skips, second_layer_skip, batched_skips, skip_after_input_edit]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("body", SKIPS, ids=lambda b: b.__name__)
def test_skip_with_default_cache_equals_nnsight(kind, body):
    assert_same(body(wrap(nnbridge, kind)), body(wrap(nnsight, kind)))


# -- .skip() in a trace that runs the graphs (every op cached) ----------------------------------
def _extractions(model):
    from nnbridge.inplace.bridging import bridge_of
    state = bridge_of(model._module)
    return 0 if state is None else sum(len(d.all_extractions()) for d in state.dispatchers.values())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_skip_in_a_graph_run_equals_nnsight_and_keeps_the_graphs(kind):
    """A skipped layer leaves its cache layer unwritten, as in eager; the later layers' graphs
    never touched that layer while exported, so they still serve the call (no extraction)."""
    def run(model, skipped):
        with model.trace(PROMPTS[0]) as tracer:
            cache_with_ops(tracer, model)  # every module's and op's value: the graphs run
            if skipped is not None:
                layer(model, skipped).skip(layer(model, skipped).input)
            after = layer(model, 1).output.save()
            output = model.output.save()
        return after, output

    bridged, reference = wrap(nnbridge, kind), wrap(nnsight, kind)
    assert_same(run(bridged, None), run(reference, None))
    extractions = _extractions(bridged)
    assert extractions >= 1
    after, output = run(bridged, 0)
    assert not output.past_key_values.layers[0].is_initialized  # as in eager: the skip wrote nothing
    assert_same((after, output), run(reference, 0))
    assert _extractions(bridged) == extractions


@pytest.mark.parametrize("skipped", [[0], [1], [0, 2]], ids=lambda s: "skip " + "+".join(map(str, s)))
def test_skips_in_a_graph_run_of_alternating_sliding_and_full_layers_equal_nnsight(skipped):
    """Gemma 3 with sliding-window and full-attention layers alternating (cache layers of two
    kinds, layers reused per kind): skipped layers leave their cache layers empty, as in eager."""
    from utils import gemma3

    ids = torch.randint(0, 100, (1, 7))

    def run(model, skips):
        with model.trace(ids) as tracer:
            cache_with_ops(tracer, model)
            for i in skips:
                model.model.layers[i].skip(model.model.layers[i].input)
            last = model.model.layers[3].output.save()
            output = model.output.save()
        return last, output

    module = gemma3(("sliding_attention", "full_attention") * 2)
    bridged, reference = nnbridge.NNsight(module), nnsight.NNsight(copy.deepcopy(module))
    assert_same(run(bridged, []), run(reference, []))
    extractions = _extractions(bridged)
    assert_same(run(bridged, skipped), run(reference, skipped))
    assert _extractions(bridged) == extractions  # the graphs of the later layers served the call


def test_batched_skips_in_a_graph_run_equal_nnsight():
    def run(model):
        with model.trace() as tracer:
            with tracer.invoke(PROMPTS[0]):
                cache_with_ops(tracer, model)
                layer(model, 0).skip(layer(model, 0).input)
                first = head(model).output.save()
            with tracer.invoke(PROMPTS[1]):
                layer(model, 0).skip(layer(model, 0).input)  # a batched skip covers every row
                second = layer(model, 1).output.save()
        return first, second

    assert_same(run(wrap(nnbridge, "gpt2")), run(wrap(nnsight, "gpt2")))


def test_a_skip_of_a_cache_layer_a_graph_read_extracts_again_and_equals_nnsight():
    """Layer 2's graph read layer 0's ``is_initialized`` while exported (a branch baked in): with
    layer 0 skipped, its check compares layer 0 and fails, so it is extracted again, not run stale."""
    def run(model):
        with model.trace(torch.ones(2, 3, 4)) as tracer:
            cache_with_ops(tracer, model)
            model.layers[0].skip(model.layers[0].input)
            out = model.output.save()
        return out

    torch.manual_seed(0)
    module = ToyCacheStack(reads_first=True)
    bridged, reference = nnbridge.NNsight(module), nnsight.NNsight(copy.deepcopy(module))
    with bridged.trace(torch.ones(2, 3, 4)) as tracer:
        tracer.cache(ops=True)
    extractions = _extractions(bridged)
    assert_same(run(bridged), run(reference))
    assert _extractions(bridged) > extractions


# -- tracer.cache() with a single invoker (0-d op values: the norm) ------------------------------
class Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = torch.nn.Linear(5, 10)
        self.layer2 = torch.nn.Linear(10, 2)

    def forward(self, x):
        hidden = self.layer1(x)
        return self.layer2(hidden / hidden.norm())


@pytest.mark.parametrize("shape", [(1, 5), (3, 5), (5,)])
def test_cache_with_a_single_invoker_equals_nnsight(shape):
    def run(library):
        torch.manual_seed(0)
        model = library.NNsight(Normed())
        with model.trace(torch.ones(*shape)) as tracer:
            cache = cache_with_ops(tracer, model)
        return cache["model.layer1"].output, cache["model.layer2"].output, cache["model"].output

    assert_same(run(nnbridge), run(nnsight))


def test_cache_with_a_single_invoker_on_a_language_model_equals_nnsight():
    def run(library):
        model = wrap(library, "gpt2")
        with model.trace(PROMPTS) as tracer:
            cache = cache_with_ops(tracer, model)
        return cache["model.transformer.h.0"].output, cache["model.lm_head"].output

    assert_same(run(nnbridge), run(nnsight))


# -- tracer.iter with .skip() --------------------------------------------------------------------
def test_iter_with_skip_equals_nnsight():
    def run(library):
        model = wrap(library, "gpt2")
        with model.generate(PROMPTS[0], max_new_tokens=3, do_sample=False) as tracer:
            logits = nnsight.save([])
            for _ in tracer.iter[0:3]:
                layer(model, 0).skip(layer(model, 0).input)
                logits.append(head(model).output)
        return logits

    assert_same(run(nnbridge), run(nnsight))


def test_iter_with_skip_and_an_op_read_equals_nnsight():
    """Each generation step skips layer 0 (its cache layer stays empty, as in eager) and reads an
    op of layer 1, so layer 1's graph runs at every step."""
    def run(library):
        model = wrap(library, "gpt2")
        with model.generate(PROMPTS[0], max_new_tokens=3, do_sample=False) as tracer:
            logits, weights = nnsight.save([]), nnsight.save([])
            for _ in tracer.iter[0:3]:
                layer(model, 0).skip(layer(model, 0).input)
                attention = layer(model, 1).attn
                weights.append(attention.softmax.output if library is nnbridge
                               else attention.source.attention_interface_1.output[1])
                logits.append(head(model).output)
            result = tracer.result.save()
        return logits, weights, result

    assert_same(run(nnbridge), run(nnsight))


# -- a lazily built model (no dispatch=True: meta weights until the first trace) ----------------
def test_first_trace_of_a_lazily_built_model_equals_nnsight(tmp_path):
    from utils import tokenizer
    from utils import text_model as make

    make("gpt2").save_pretrained(tmp_path)
    results = {}
    for library in (nnsight, nnbridge):
        model = library.TransformersModel(str(tmp_path), tokenizer=tokenizer(), task="text-generation")
        assert not model.dispatched
        with model.trace(PROMPTS[0]):
            attn = model.transformer.h[0].attn.output[0].save()
            logits = head(model).output.save()
        results[library] = (attn, logits)
    assert_same(results[nnbridge], results[nnsight])
    model = nnbridge.TransformersModel(str(tmp_path), tokenizer=tokenizer(), task="text-generation")
    with model.trace(PROMPTS[0]):  # an op envoy in the very first trace
        attention = model.transformer.h[0].attn.scaled_dot_product_attention.output.save()  # sdpa
    assert attention.shape[-1] == 16  # head dim (64 / 4)


# -- envoy classes: nnsight's envoys= argument ---------------------------------------------------
class _LinearEnvoy(nnsight.Envoy):
    def marker(self):
        return f"linear:{self.path}"


class _AllEnvoy(nnsight.Envoy):
    pass


def test_envoys_argument_is_used_for_modules_and_ops():
    model = nnbridge.NNsight(Normed(), envoys={torch.nn.Linear: _LinearEnvoy})
    assert type(model.layer1) is _LinearEnvoy and model.layer1.marker() == "linear:model.layer1"
    with model.trace(torch.ones(1, 5)):
        norm = model.linalg_vector_norm.output.save()  # an op envoy, reached through a plain Envoy
        out = model.layer2.output.save()
    torch.manual_seed(0)
    reference = Normed()
    torch.manual_seed(0)
    model = nnbridge.NNsight(Normed(), envoys=_AllEnvoy)
    with model.trace(torch.ones(1, 5)):
        norm = model.linalg_vector_norm.output.save()
        out = model.layer2.output.save()
    assert type(model.layer1) is _AllEnvoy and type(model.linalg_vector_norm) is _AllEnvoy
    assert torch.equal(out, reference(torch.ones(1, 5)))
    assert torch.equal(norm, reference.layer1(torch.ones(1, 5)).norm())


def test_envoys_none_gives_plain_envoys():
    model = nnbridge.NNsight(Normed(), envoys=None)
    assert type(model.layer1) is nnsight.Envoy


# -- older nnsight spellings ----------------------------------------------------------------------
@pytest.mark.parametrize("name, hint", [("value", "tensor itself"), ("next", "tracer.iter")])
def test_old_spellings_name_the_nnsight_08_spelling(name, hint):
    model = nnbridge.NNsight(Normed(), envoys=nnbridge.envoys.BridgeEnvoy)
    with pytest.raises(AttributeError, match=hint.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        getattr(model.layer1, name)
