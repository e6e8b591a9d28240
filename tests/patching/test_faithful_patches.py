"""Issue 9 items 1, 2, 12, 13, 14: patches apply once, in their own thread, never write into the
model, are checked, and never silently do nothing."""

from __future__ import annotations

import threading

import pytest
import torch

import nnbridge
from nnbridge import AddPatch, CustomPatch, PatchableGraph, RecordPatch, ReplacePatch, ZeroPatch
from nnbridge.errors import NNBridgeError, PatchError


class Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * 2


def _model() -> Two:
    torch.manual_seed(0)
    return Two().eval()


@pytest.mark.parametrize("bridge_first", [True, False])
def test_patches_apply_once_across_call_structures(bridge_first):
    model, reference = _model(), _model()
    x1, x3, x5 = torch.randn(1, 4), torch.randn(3, 4), torch.randn(5, 4)
    if bridge_first:
        nnbridge.bridge(model, x1)
        model(x3)  # a second call structure
    pg = PatchableGraph(model, x1)
    pg(x3)
    assert len(pg.extractions) >= 2
    record = RecordPatch()
    with pg.patch({"fc.output": [AddPatch(value=1.0), record]}):
        assert torch.equal(pg(x3), (reference.fc(x3) + 1.0) * 2)
        assert len(record.activations) == 1
        # a call structure extracted while the context is open
        assert torch.equal(pg(x5), (reference.fc(x5) + 1.0) * 2)
        assert len(record.activations) == 2
    assert torch.equal(pg(x5), reference(x5)), "the patches are gone after the context"
    # the same patch object listed twice applies twice, as listed
    with pg.patch({"fc.output": [AddPatch(value=1.0)] * 2}):
        assert torch.equal(pg(x3), (reference.fc(x3) + 1.0 + 1.0) * 2)
    if bridge_first:
        nnbridge.unbridge(model)


def test_patch_context_belongs_to_its_thread():
    model, reference = _model(), _model()
    x = torch.randn(3, 4)
    pg = PatchableGraph(model, x)
    opened, done = threading.Event(), threading.Event()
    seen: dict[str, torch.Tensor] = {}

    def patcher() -> None:
        with pg.patch({"fc.output": ZeroPatch()}):
            opened.set()
            done.wait(30)
            seen["a"] = pg(x)

    thread = threading.Thread(target=patcher)
    thread.start()
    assert opened.wait(30)
    seen["b"] = pg(x)  # another thread while A's context is open
    done.set()
    thread.join(30)
    assert torch.equal(seen["b"], reference(x)), "a patch opened in another thread applied here"
    assert torch.equal(seen["a"], torch.zeros(3, 4)), "the patch applies in its own thread"


def test_concurrent_calls_during_re_extraction_are_equal_to_eager():
    """Calls and extractions hold one lock, taken before any hook runs (every module of a bridged
    model) and before torch.export's tracer sees the call (fx's process-wide ``nn.Module``
    patches are confined to the tracing thread), so calls racing other threads' re-extractions,
    of the model or of one of its submodules, all return eager's numbers."""
    model, reference = _model(), _model()
    nnbridge.bridge(model, torch.randn(1, 4))
    # ranks 1-4: each a new call structure, so threads extract while others run
    inputs = [torch.randn(*([2] * (i % 4)), i + 1, 4) for i in range(8)]
    expected = [reference(x) for x in inputs]
    expected_fc = [reference.fc(x) for x in inputs]
    returned: list[bool] = []
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(3):
                returned.append(torch.equal(model(inputs[i]), expected[i]))
                returned.append(torch.equal(model.fc(inputs[i]), expected_fc[i]))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert len(returned) == 6 * len(inputs) and all(returned), "a call returned numbers that differ from eager"
    nnbridge.unbridge(model)


def test_plain_model_running_in_another_thread_while_a_patchable_graph_extracts_it():
    """A plain (never bridged) model called in a loop by another thread while ``PatchableGraph``
    extracts it: its calls wait for the extraction (its modules' calls are locked for its
    duration) and every one of them, and the PatchableGraph's, returns eager's numbers."""
    for trial in range(3):
        model, reference = _model(), _model()
        x = torch.randn(2, 4)
        expected = reference(x)
        stop = threading.Event()
        returned: list[bool] = []
        errors: list[BaseException] = []

        def loop() -> None:
            try:
                while not stop.is_set():
                    returned.append(torch.equal(model(x), expected))
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        thread = threading.Thread(target=loop)
        thread.start()
        try:
            pg = PatchableGraph(model, torch.randn(3, 4))
            assert torch.equal(pg(x), expected)
        finally:
            stop.set()
            thread.join(30)
        assert not errors, errors
        assert returned and all(returned), f"trial {trial}: a plain call differed from eager during extraction"
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


def test_other_threads_grad_mode_and_functions_are_untouched_during_extraction():
    """Extraction's process-wide hooks (grad-mode freezing, ``autograd.Function.apply``) act only
    in the extracting thread: another thread's ``no_grad`` still applies there."""
    from nnbridge.compat.torch.capture import grad_mode_frozen

    seen: list[bool] = []
    with grad_mode_frozen(lambda: True):
        def other() -> None:
            with torch.no_grad():
                seen.append(torch.is_grad_enabled())
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(30)
        with torch.no_grad():  # frozen in this thread
            seen.append(torch.is_grad_enabled())
    assert seen == [False, True]


def test_patch_after_unbridge_raises_and_nothing_is_patched():
    model, reference = _model(), _model()
    x = torch.randn(3, 4)
    nnbridge.bridge(model, x)
    pg = PatchableGraph(model, x)
    nnbridge.unbridge(model)
    with pytest.raises(PatchError, match="unbridged"):
        with pg.patch({"fc.output": ZeroPatch()}):
            pass
    assert torch.equal(model(x), reference(x))


def test_hooks_under_patchable_graph():
    x = torch.randn(3, 4)
    # over a bridged model the model's hooks fire, with the patches, in one forward
    model, reference = _model(), _model()
    nnbridge.bridge(model, x)
    handle = model.fc.register_forward_hook(lambda mod, args, out: out + 3)
    pg = PatchableGraph(model, x)
    with pg.patch({"mul": AddPatch(value=1.0)}):
        assert torch.equal(pg(x), (reference.fc(x) + 3) * 2 + 1)
    handle.remove()
    nnbridge.unbridge(model)
    # over a plain model the graphs stand in for the modules: hooks would not run, so it refuses
    plain = _model()
    pg = PatchableGraph(plain, x)
    handle = plain.fc.register_forward_hook(lambda mod, args, out: out + 3)
    with pytest.raises(NNBridgeError, match=r"\['fc'\].*bridge the model first"):
        pg(x)
    handle.remove()
    assert torch.equal(pg(x), reference(x))


def test_custom_patches_get_a_clone():
    model, reference = _model(), _model()
    x = torch.randn(3, 4)
    caller_x = x.clone()
    pg = PatchableGraph(model, x)
    with torch.no_grad(), pg.patch({"fc.weight": CustomPatch(custom_op=lambda t: t.add_(1)),
                                    "x": CustomPatch(custom_op=lambda t: t.mul_(0))}):
        out = pg(x)
    assert torch.equal(out, torch.nn.functional.linear(torch.zeros(3, 4), reference.fc.weight + 1,
                                                       reference.fc.bias) * 2)
    assert torch.equal(model.fc.weight, reference.fc.weight), "the patch wrote into the model's weight"
    assert torch.equal(x, caller_x), "the patch wrote into the caller's input"


class InPlace(nnbridge.Patch):
    """A user patch: receives a clone by default (requires_clone)."""

    def __call__(self, original):
        return original.zero_()


def test_user_patch_subclass_gets_a_clone_and_builtins_do_not_need_one():
    model, reference = _model(), _model()
    x = torch.randn(3, 4)
    pg = PatchableGraph(model, x)
    with torch.no_grad(), pg.patch({"fc.bias": InPlace()}):
        pg(x)
    assert torch.equal(model.fc.bias, reference.fc.bias)
    assert InPlace.requires_clone and not ZeroPatch.requires_clone and not AddPatch.requires_clone


@pytest.mark.parametrize("value, problem", [
    (torch.zeros(2, 4), r"shape \(2, 4\)"),
    (None, "put None"),
    (1.5, "put float"),
    (torch.zeros(3, 4, dtype=torch.float64), "torch.float64"),
    (torch.zeros(3, 4, device="meta"), "on meta"),
])
def test_bad_patch_values_name_the_node_path(value, problem):
    model = _model()
    x = torch.randn(3, 4)
    pg = PatchableGraph(model, x)
    with pg.patch({"fc.output": CustomPatch(custom_op=lambda _original: value)}):
        with pytest.raises(PatchError, match=rf"'fc.output'.*{problem}"):
            pg(x)
    assert torch.equal(pg(x), _model()(x)), "nothing stays patched after the error"


@pytest.mark.parametrize("value", [torch.zeros(1, 4, dtype=torch.float64), 1.5, torch.arange(4)])
def test_replace_patch_broadcasts_as_graphpatch(value):
    """graphpatch's ReplacePatch is ``original[None] = value``: broadcast to the node's shape, in its dtype."""
    model = _model()
    x = torch.randn(3, 4)
    pg = PatchableGraph(model, x)
    with pg.patch({"fc.output": [ReplacePatch(value=value), probe := RecordPatch()]}):
        pg(x)
    expected = _model().fc(x).detach().clone()
    expected[None] = torch.as_tensor(value)
    assert torch.equal(probe.activations[0], expected) and probe.activations[0].dtype == expected.dtype


def test_replace_patch_value_that_does_not_broadcast_raises():
    model = _model()
    x = torch.randn(3, 4)
    pg = PatchableGraph(model, x)
    with pg.patch({"fc.output": ReplacePatch(value=torch.zeros(2, 4))}):
        with pytest.raises(PatchError, match=r"'fc.output'.*shape \(2, 4\).*shape \(3, 4\)"):
            pg(x)
    assert torch.equal(pg(x), _model()(x)), "nothing stays patched after the error"
