"""torch.compile of a bridged model, or of a PatchableGraph over a plain model, with patches open
(``pg.patch``): no graph break under ``fullgraph=True``; equal to the uncompiled patched model
(``aot_eager`` exactly, inductor within fp32 tolerance); a new patch value (a new ``AddPatch``
tensor, another clean activation for a ``ReplacePatch``) runs the compiled code again, while
patching other nodes may compile anew (Dynamo's compiles counted); a patch context open in another
thread is no patch here; a call structure never extracted is extracted outside the trace (a graph
break, refused under ``fullgraph=True`` with the reason)."""

import io
import threading

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import nnbridge
from nnbridge import AddPatch, PatchableGraph, ProbePatch, ReplacePatch
from utils import gpt2

pytestmark = pytest.mark.integration  # end to end: torch.compile of patched models, inductor included

NODE, OTHER = "transformer.h_0.add", "transformer.h_1.add"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def bridged_gpt2():
    """A bridged tiny GPT-2, its PatchableGraph, and two inputs (``(2, 7)`` token ids)."""
    torch.manual_seed(1)
    clean, corrupt = torch.randint(0, 100, (2, 7)), torch.randint(0, 100, (2, 7))
    model = nnbridge.bridge(gpt2(), clean, use_cache=False)
    return model, PatchableGraph(model, clean, use_cache=False), clean, corrupt


def plain_gpt2():
    """A tiny GPT-2 left unbridged, a PatchableGraph over it, and two inputs (``(2, 7)`` token ids)."""
    torch.manual_seed(1)
    clean, corrupt = torch.randint(0, 100, (2, 7)), torch.randint(0, 100, (2, 7))
    model = gpt2()
    return model, PatchableGraph(model, clean, use_cache=False), clean, corrupt


def activation(pg, node, ids):
    """The value of ``node`` on a run of ``ids`` (a ``(2, 7, 64)`` residual stream)."""
    probe = ProbePatch()
    with pg.patch({node: probe}):
        pg(ids, use_cache=False)
    return probe.activation


def test_new_patch_values_reuse_the_compiled_code():
    model, pg, clean, corrupt = bridged_gpt2()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        plain = model(corrupt, use_cache=False).logits
        compiles = []
        for value in (torch.randn(64), torch.randn(64)):
            with pg.patch({NODE: AddPatch(value=value)}):
                expected = model(corrupt, use_cache=False).logits
                assert torch.equal(compiled(corrupt, use_cache=False).logits, expected)
            assert not torch.equal(expected, plain), "the patch changes the output"
            compiles.append(counter.frame_count)
        for source in (clean, torch.randint(0, 100, (2, 7))):  # clean activations patched in
            with pg.patch({NODE: ReplacePatch(value=activation(pg, NODE, source))}):
                expected = model(corrupt, use_cache=False).logits
                assert torch.equal(compiled(corrupt, use_cache=False).logits, expected)
            compiles.append(counter.frame_count)
        assert compiles[0] == compiles[1] and compiles[2] == compiles[3], f"compiles after each run: {compiles}"
        with pg.patch({OTHER: ReplacePatch(value=activation(pg, OTHER, clean))}):  # another node: may compile
            assert torch.equal(compiled(corrupt, use_cache=False).logits, model(corrupt, use_cache=False).logits)
        assert torch.equal(compiled(corrupt, use_cache=False).logits, plain), "no patch after the contexts"


def test_a_patch_and_an_op_hook_under_fullgraph_equal_the_uncompiled_model():
    model, pg, clean, corrupt = bridged_gpt2()
    handle = model.get_submodule("transformer.h.1.attn.softmax").register_forward_hook(lambda m, a, out: out * 0.5)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad(), pg.patch({NODE: AddPatch(value=torch.randn(7, 64))}):
        expected = model(corrupt, use_cache=False).logits
        assert torch.equal(compiled(corrupt, use_cache=False).logits, expected)
    handle.remove()


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        return torch.softmax(self.down(torch.nn.functional.gelu(self.up(x))), dim=-1) + x


# inductor itself (torch 2.13) touches torch.jit.script_method, which warns
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_inductor_patched_model_is_within_fp32_tolerance():
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    model = nnbridge.bridge(Mlp().eval(), x)
    pg = PatchableGraph(model, x)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    with torch.no_grad():
        for value in (torch.randn(16), torch.randn(16)):
            with pg.patch({"gelu": AddPatch(value=value)}):
                expected = model(x)
                actual = compiled(x)
            assert not torch.equal(expected, model(x)), "the patch changes the output"
            torch.testing.assert_close(actual, expected, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("over", ["bridged", "plain"])
def test_a_patch_context_of_another_thread_is_no_patch_here(over):
    model, pg, clean, corrupt = bridged_gpt2() if over == "bridged" else plain_gpt2()
    run = model if over == "bridged" else pg  # what is compiled: the bridged model, or the pg over a plain one
    opened, done = threading.Event(), threading.Event()
    seen = {}

    def patcher():
        with torch.no_grad(), pg.patch({NODE: AddPatch(value=torch.ones(64))}):
            seen["expected"] = run(corrupt, use_cache=False).logits
            opened.set()
            done.wait(60)
            seen["compiled"] = torch.compile(run, backend="aot_eager")(corrupt, use_cache=False).logits

    thread = threading.Thread(target=patcher)
    thread.start()
    try:
        assert opened.wait(60)
        with torch.no_grad():
            plain = run(corrupt, use_cache=False).logits  # uncompiled: the other thread's patch is not ours
            # (fullgraph first: Dynamo would reuse the code compiled with the graph break)
            with pytest.raises(Exception, match="open in another thread or asyncio task"):
                torch.compile(run, backend="aot_eager", fullgraph=True)(corrupt, use_cache=False)
            assert torch.equal(torch.compile(run, backend="aot_eager")(corrupt, use_cache=False).logits, plain)
    finally:
        done.set()
        thread.join(60)
    assert torch.equal(seen["compiled"], seen["expected"]), "the patch applies in its own thread"
    assert not torch.equal(seen["expected"], plain)


def test_a_patchable_graph_over_a_plain_model_compiles_whole_and_new_patch_values_reuse_the_code():
    model, pg, clean, corrupt = plain_gpt2()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(pg, backend=counter, fullgraph=True)
    with torch.no_grad():
        plain = model(corrupt, use_cache=False).logits  # the model's own code
        assert torch.equal(compiled(corrupt, use_cache=False).logits, plain)
        compiles = []
        for value in (torch.randn(64), torch.randn(64)):
            with pg.patch({NODE: AddPatch(value=value)}):
                expected = pg(corrupt, use_cache=False).logits
                assert torch.equal(compiled(corrupt, use_cache=False).logits, expected)
            assert not torch.equal(expected, plain), "the patch changes the output"
            compiles.append(counter.frame_count)
        assert compiles[0] == compiles[1], f"compiles after each run: {compiles}"
        assert torch.equal(compiled(corrupt, use_cache=False).logits, plain), "no patch after the contexts"


def test_a_loaded_patchable_graph_compiles_whole_and_equals_the_model():
    model, pg, clean, corrupt = plain_gpt2()
    buffer = io.BytesIO()
    pg.save(buffer)
    buffer.seek(0)
    loaded = PatchableGraph.load(buffer, gpt2())
    compiled = torch.compile(loaded, backend="aot_eager", fullgraph=True)
    with torch.no_grad(), loaded.patch({NODE: AddPatch(value=torch.ones(64))}):
        assert torch.equal(compiled(corrupt, use_cache=False).logits, loaded(corrupt, use_cache=False).logits)
    with torch.no_grad():
        assert torch.equal(compiled(corrupt, use_cache=False).logits, model(corrupt, use_cache=False).logits)


def test_a_new_call_structure_of_a_plain_model_is_extracted_outside_the_trace():
    model, pg, clean, corrupt = plain_gpt2()
    reference = gpt2()
    with torch.no_grad():
        with pytest.raises(Exception, match="nnbridge extracts this call structure of the module"):
            torch.compile(pg, backend="aot_eager", fullgraph=True)(corrupt)  # the cache: a new structure
        torch._dynamo.reset()
        extractions = len(pg.extractions)
        out = torch.compile(pg, backend="aot_eager")(corrupt, use_cache=False, output_attentions=True)
        expected = reference(corrupt, use_cache=False, output_attentions=True)
    assert len(pg.extractions) == extractions + 1
    assert torch.equal(out.logits, expected.logits)
    assert len(out.attentions) == len(expected.attentions) == 2
    assert all(torch.equal(a, b) for a, b in zip(out.attentions, expected.attentions))
