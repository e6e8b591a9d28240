"""graphpatch's patch classes on op nodes, placeholders, parameters, buffers and outputs."""

import pytest
import torch

from fixtures.buffer_module import BufferModule
from fixtures.container_module import ContainerModule
from fixtures.minimal_module import MinimalModule
from nnbridge import (AddPatch, CustomPatch, PatchableGraph, ProbePatch, RecordPatch, ReplacePatch,
                      ZeroPatch)
from utils import compiled_only, opaque_and_compiled


@pytest.fixture
def minimal(options):
    """MinimalModule, a PatchableGraph over it in the test's extraction mode, an input."""
    model = MinimalModule().eval()
    x = torch.randn(4, 3)
    return model, PatchableGraph(model, x, options=options), x


@opaque_and_compiled
def test_zero_patch_whole_and_slice(minimal):
    model, pg, x = minimal
    with pg.patch({"linear.output": ZeroPatch()}):
        assert torch.equal(pg(x), torch.zeros(4, 2))
    want = model(x).clone()
    want[:, 1] = 0
    with pg.patch({"linear.output": ZeroPatch(slice=(slice(None), 1))}):
        assert torch.equal(pg(x), want)


@compiled_only
def test_add_and_replace_patches(minimal):
    model, pg, x = minimal
    with pg.patch({"linear.linear": AddPatch(value=2.0)}):
        assert torch.equal(pg(x), model(x) + 2.0)
    want = model(x).clone()
    want[0] += torch.tensor([1.0, -1.0])
    with pg.patch({"linear.output": AddPatch(value=torch.tensor([1.0, -1.0]), slice=0)}):
        assert torch.equal(pg(x), want)
    replacement = torch.full((4, 2), 7.0)
    with pg.patch({"linear.output": ReplacePatch(value=replacement)}):
        assert torch.equal(pg(x), replacement)
    want = model(x).clone()
    want[1:3] = 5.0
    with pg.patch({"linear.output": ReplacePatch(value=5.0, slice=slice(1, 3))}):
        assert torch.equal(pg(x), want)


@opaque_and_compiled
def test_probe_record_custom(minimal):
    model, pg, x = minimal
    probe, record = ProbePatch(), RecordPatch()
    with pg.patch({"linear.input": probe, "linear.output": [record, CustomPatch(custom_op=torch.relu)]}):
        out1 = pg(x)
        out2 = pg(2 * x)
    assert torch.equal(probe.activation, 2 * x)
    assert len(record.activations) == 2 and torch.equal(record.activations[0], model(x))
    assert torch.equal(out1, torch.relu(model(x))) and torch.equal(out2, torch.relu(model(2 * x)))


@opaque_and_compiled
def test_patches_apply_in_list_order_and_nested_contexts_append(minimal):
    model, pg, x = minimal
    with pg.patch({"linear.output": [AddPatch(value=1.0), CustomPatch(custom_op=lambda v: v * 3)]}):
        assert torch.equal(pg(x), (model(x) + 1.0) * 3)
        with pg.patch({"linear.output": AddPatch(value=10.0)}):
            assert torch.equal(pg(x), (model(x) + 1.0) * 3 + 10.0)
        assert torch.equal(pg(x), (model(x) + 1.0) * 3)
    assert torch.equal(pg(x), model(x))


@opaque_and_compiled
def test_exit_restores_after_exception(minimal):
    model, pg, x = minimal
    with pytest.raises(RuntimeError, match="boom"):
        with pg.patch({"linear.output": ZeroPatch()}):
            raise RuntimeError("boom")
    assert torch.equal(pg(x), model(x))
    assert all(not p.listened for m in pg.modules() if hasattr(m, "op_points") for p in m.op_points.values())


@opaque_and_compiled
def test_parameter_and_placeholder_patches(minimal):
    model, pg, x = minimal
    with pg.patch({"linear.weight": ZeroPatch()}):
        assert torch.equal(pg(x), model.linear.bias.expand(4, 2))
    with pg.patch({"x": ZeroPatch()}):
        assert torch.equal(pg(x), model(torch.zeros(4, 3)))
    assert not torch.equal(model.linear.weight, torch.zeros_like(model.linear.weight))


def test_buffer_patch():
    model = BufferModule().eval()
    x = torch.randn(2, 4)
    pg = PatchableGraph(model, x)
    with pg.patch({"offset": AddPatch(value=1.0)}):
        assert torch.equal(pg(x), x + (model.offset + 1.0) * model.scratch)
    assert torch.equal(model.offset, torch.arange(4, dtype=torch.float32))


def test_dig_patches_into_nested_containers():
    model = ContainerModule().eval()
    x = torch.randn(3, 2)
    pg = PatchableGraph(model, x)
    assert "output|a.sub_1.sub_1.sub_0" in pg.node_paths()
    zero, add, plain = ZeroPatch(), AddPatch(value=1.0), ProbePatch()
    with pg.patch({"output|a.sub_1.sub_1.sub_0": zero, "output|b.sub_1.c": add, "linear.output": plain}):
        out = pg(x)
    # graphpatch's Patch.path: the dig part, set by pg.patch; not a constructor argument
    assert (zero.path, add.path, plain.path) == ("a.sub_1.sub_1.sub_0", "b.sub_1.c", None)
    with pytest.raises(TypeError):
        ZeroPatch(path="a")
    want = model(x)
    assert torch.equal(out["a"][1][1][0], torch.zeros(3, 2))
    assert torch.equal(out["a"][1][1][1], want["a"][1][1][1]) and torch.equal(out["a"][0], want["a"][0])
    assert torch.equal(out["b"][1]["c"], want["b"][1]["c"] + 1.0)


@opaque_and_compiled
def test_add_patch_value_can_be_optimised(minimal):
    model, pg, x = minimal
    target = torch.randn(4, 2)
    delta = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.SGD([delta], lr=0.5)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        with pg.patch({"linear.output": AddPatch(value=delta)}):
            loss = (pg(x) - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert delta.grad is not None and losses[-1] < losses[0]
    best = (target - model(x)).mean(0).detach()
    assert torch.allclose(delta.detach(), best, atol=1e-2)


@compiled_only
def test_unpatched_graph_routes_nothing(minimal):
    _, pg, x = minimal
    root = pg._graph_module
    assert "_nnbridge_ops" not in root.linear.code
    with pg.patch({"linear.linear": ZeroPatch()}):
        assert root.linear._routed == frozenset({"linear"})
    assert root.linear._routed == frozenset()


@opaque_and_compiled
def test_graphpatch_style_patch_subclass(minimal):
    """As graphpatch documents: ``class P(Patch[torch.Tensor])``, a kw-only dataclass overriding
    ``op``; it gets a clone (``requires_clone`` defaults to True), so writing into it is safe."""
    from dataclasses import dataclass

    from nnbridge import Patch

    @dataclass(kw_only=True)
    class ScaleInPlace(Patch[torch.Tensor]):
        factor: float

        def op(self, original_output: torch.Tensor) -> torch.Tensor:
            return original_output.mul_(self.factor)

    model, pg, x = minimal
    weight = model.linear.weight.clone()
    patch = ScaleInPlace(factor=3.0)
    assert patch.requires_clone
    with pytest.raises(TypeError):
        ScaleInPlace(factor=1.0, requires_clone=False)  # hidden from the constructor, as in graphpatch
    with torch.no_grad(), pg.patch({"linear.weight": patch}):
        assert torch.equal(pg(x), torch.nn.functional.linear(x, weight * 3.0, model.linear.bias))
    assert torch.equal(model.linear.weight, weight), "the patch wrote into a clone, not the weight"
    assert Patch().op(x) is x  # the base op is the identity


@opaque_and_compiled
def test_custom_patch_exposes_requires_clone(minimal):
    model, pg, x = minimal
    seen = []
    read_only = CustomPatch(custom_op=lambda t: seen.append(t) or t, requires_clone=False)
    assert not read_only.requires_clone and CustomPatch(custom_op=lambda t: t).requires_clone
    with torch.no_grad(), pg.patch({"linear.weight": read_only}):
        pg(x)
    assert seen[0] is model.linear.weight, "no clone for a read-only op"


@opaque_and_compiled
def test_builtin_patch_subclass_overrides_op(minimal):
    """Built-in patches implement ``op`` too, so a subclass can extend it."""
    from dataclasses import dataclass

    @dataclass(kw_only=True)
    class DoubleZero(ZeroPatch):
        def op(self, original: torch.Tensor) -> torch.Tensor:
            return super().op(original) + 2

    model, pg, x = minimal
    with pg.patch({"linear.output": DoubleZero()}):
        assert torch.equal(pg(x), torch.full((4, 2), 2.0))


def _fills_scale(forward):
    """A forward decorator like transformers 5's (which fill ``use_cache`` into ``kwargs``)."""
    import functools

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        kwargs.setdefault("scale", 1.0)  # so ``scale`` must be passed by keyword
        return forward(self, *args, **kwargs)
    return wrapper


class _Decorated(torch.nn.Module):
    @_fills_scale
    def forward(self, x, scale=None):
        return x * scale


class _CallsDecorated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Decorated()

    def forward(self, x):
        return self.inner(x, scale=3.0)


def test_patching_an_opaque_modules_arguments_keeps_how_they_were_passed():
    """Patching an opaque module's inputs passes each argument as the caller did (before: keywords
    were re-bound positionally and a decorated forward saw ``scale`` twice: TypeError)."""
    from nnbridge import ExtractionOptions

    model = _CallsDecorated()
    x = torch.randn(2, 3)
    pg = PatchableGraph(model, x, options=ExtractionOptions(classes_to_skip_compiling={_Decorated}))
    assert pg.extractions[0].opaque.keys() == {"inner"}
    with pg.patch({"inner.x": AddPatch(value=1.0), "inner.scale": ReplacePatch(value=2.0)}):
        got = pg(x)
    assert torch.equal(got, (x + 1) * 2.0)
    assert torch.equal(pg(x), model(x))
