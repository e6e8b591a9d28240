"""The children of an opaque module extract on their own (one dispatcher each) and may extract
again on a later call (here: a call in another grad mode than the one their first graphs were
extracted in). Patches open during such a call, and the example recording,
must reach those new graphs. Both failed before: the first patched call returned the unpatched
output, and nested opaque children (GPT-2's ``transformer.h_1.mlp``) had no example summaries,
so ``pg.graph`` showed their values as ``None`` and refused digs (``inner.foos|sub_0``)."""

import pytest
import torch

from nnbridge import ExtractionOptions, PatchableGraph, ZeroPatch
import nnbridge
from utils import falls_back, gpt2, llama

OPAQUE = ExtractionOptions(skip_compilation=True)


def test_patch_applies_on_the_first_call_after_construction():
    model, reference = gpt2(), gpt2()
    ids = torch.randint(1, 100, (2, 6))
    pg = PatchableGraph(model, OPAQUE, ids, use_cache=False)
    handle = reference.transformer.h[1].mlp.register_forward_hook(lambda m, a, o: torch.zeros_like(o))
    expected = reference(ids, use_cache=False).logits
    handle.remove()
    with torch.no_grad():  # a grad-mode change re-extracts the children while the patch is open
        with pg.patch({"transformer.h_1.mlp.output": ZeroPatch()}):
            assert torch.equal(pg(ids, use_cache=False).logits, expected)
    with pg.patch({"transformer.h_1.mlp.output": ZeroPatch()}):
        assert torch.equal(pg(ids, use_cache=False).logits, expected)
    assert torch.equal(pg(ids, use_cache=False).logits, reference(ids, use_cache=False).logits)


def test_examples_of_nested_opaque_children_are_recorded():
    model = gpt2()
    ids = torch.randint(1, 100, (2, 6))
    pg = PatchableGraph(model, OPAQUE, ids, use_cache=False)
    assert pg.graph.transformer.h_1.mlp.output._shape == torch.Size([2, 6, 64])
    assert "transformer.h_1.attn.output|sub_0" in pg.graph.keys()


def test_children_of_an_opaque_module_extract_once_for_the_calls_they_get():
    """``output_attentions=True`` makes the decoder opaque (transformers collects outputs with
    hooks). Its children's first graphs come from an observed run in the caller's grad mode, so
    the real calls (inputs that require grad) reuse them: one extraction per child, not two."""
    model, reference = llama(), llama()
    ids = torch.randint(1, 100, (1, 7))
    nnbridge.bridge(model, ids)
    with falls_back("model"):  # the call with output_attentions is a new extraction, with a fallback
        out = model(ids, output_attentions=True)
    expected = reference(ids, output_attentions=True)
    assert torch.equal(out.logits, expected.logits)
    assert all(torch.equal(a, b) for a, b in zip(out.attentions, expected.attentions))
    history = nnbridge.explain(model, ids, output_attentions=True).history
    layers = [(path, reason) for path, reason in history if path.startswith("model.layers")]
    assert layers == [("model.layers.0", "first call"), ("model.layers.1", "first call")], history


# -- what an opaque module's code finds in its children's place --------------------------------------
class _Child(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.scale = 2.0
        # names a dispatcher has too: the child's own values must be read
        self.module, self.options, self.path = "child's module", "child's options", "child's path"

    def forward(self, x):
        return self.lin(x) * self.scale


class _ReadsChild(torch.nn.Module):
    """Reads a child's plain attributes and a grandchild's parameter, checks its class."""

    def __init__(self):
        super().__init__()
        self.child = _Child()

    def forward(self, x):
        y = self.child(x)
        assert isinstance(self.child, _Child)
        assert (self.child.module, self.child.options, self.child.path) == (
            "child's module", "child's options", "child's path")
        return y * self.child.scale + self.child.lin.weight.sum()


class _WritesChild(_ReadsChild):
    """Counts its calls on the child (a side effect: it runs opaque in every mode)."""

    def forward(self, x):
        self.child.scale = self.child.scale + 1.0
        return self.child(x)


def _pair(cls):
    torch.manual_seed(0)
    model = cls().eval()
    torch.manual_seed(0)
    return model, cls().eval()


@pytest.mark.parametrize("options", [OPAQUE, ExtractionOptions()], ids=["skipped", "compiled"])
def test_an_opaque_module_reads_its_childrens_attributes(options):
    """Before, the code found the child's dispatcher in its place: AttributeError on ``scale``."""
    model, reference = _pair(_ReadsChild)
    x = torch.randn(2, 3)
    pg = PatchableGraph(model, x, options=options)
    assert torch.equal(pg(x), reference(x))
    with pg.patch({"child.lin.output": ZeroPatch()}):
        patched = pg(x)
    handle = reference.child.lin.register_forward_hook(lambda module, args, output: torch.zeros_like(output))
    assert torch.equal(patched, reference(x))
    handle.remove()


def test_an_opaque_module_writes_its_childs_attribute_as_eager():
    model, reference = _pair(_WritesChild)
    x = torch.randn(2, 3)
    pg = PatchableGraph(model, x, options=OPAQUE)
    assert model.child.scale == 2.0  # extraction's runs put the attribute back
    for _ in range(3):
        assert torch.equal(pg(x), reference(x))
        assert model.child.scale == reference.child.scale
    assert model.child.scale == 5.0
