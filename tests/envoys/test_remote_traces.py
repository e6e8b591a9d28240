"""Remote traces (``remote=True`` / nnsight's server simulation ``remote="local"``) of a bridged model
travel as a plain nnsight model's: module envoys work and equal nnsight's, op reads are refused
before anything is sent (an NDIF server runs nnsight, without op envoys)."""

import threading

import nnsight
import pytest
import torch
from nnsight.schema.request import RequestModel

import nnbridge
from nnbridge.compat.nnsight.remote import serialised_as_nnsight, typing_kept
from nnbridge.envoys.remote import NNsightRequest, is_op_point
from nnbridge.errors import NNBridgeError
from utils import PROMPTS, wrap


def mean_of_first_layers(model, count):
    """The mean of the first ``count`` layers' hidden states (a helper shipped by value)."""
    return sum(model.transformer.h[i].output.mean() for i in range(count))


def module_reads(model, remote):
    with torch.no_grad(), model.trace(PROMPTS[0], remote=remote):
        hidden = model.transformer.h[0].output.save()
        total = mean_of_first_layers(model, 2).save()
        logits = model.lm_head.output.save()
    return hidden, total, logits


@pytest.mark.parametrize("extracted", [False, True], ids=["fresh", "after-an-op-trace"])
def test_local_simulation_of_module_reads_equals_nnsight(extracted):
    """Layer 0's output ``(1, seq, 64)``, a helper's scalar and the logits ``(1, seq, vocab)``:
    torch.equal to nnsight's remote="local" run and to nnbridge's own local run, also once op
    envoys exist (they are left out of the request, not sent)."""
    with typing_kept():  # plain nnsight's "local" may replace typing's functions (see typing_kept)
        expected = module_reads(wrap(nnsight, "gpt2"), "local")
    model = wrap(nnbridge, "gpt2")
    if extracted:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            model.transformer.h[0].attn.softmax.output.save()
    for remote in ("local", False):
        for value, reference in zip(module_reads(model, remote), expected):
            assert torch.equal(value, reference)


def test_the_request_names_no_nnbridge_class():
    """What would be sent: nnsight's own classes only (a server without nnbridge can unpickle it),
    and no op envoy; the same bytes pickled outside the request context do name nnbridge."""
    model = wrap(nnbridge, "gpt2")
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.transformer.h[0].attn.softmax.output.save()
    sent = []

    def capture(tracer):
        sent.append(RequestModel.serialize(tracer))
    request = NNsightRequest(capture, model._module, [], module_names=[])
    with torch.no_grad(), model.trace(PROMPTS[0], backend=request):
        model.transformer.h[0].output.save()
    assert b"nnbridge." not in sent[0]  # no module path of nnbridge's (class references)
    assert b"LanguageModel" in sent[0] or b"TransformersModel" in sent[0]
    assert b"softmax" not in sent[0]

    def capture_plain(tracer):
        sent.append(RequestModel.serialize(tracer))
    with torch.no_grad(), model.trace(PROMPTS[0], backend=capture_plain):
        model.transformer.h[0].output.save()
    assert b"nnbridge.envoys" in sent[1]  # the override acts only inside a request


@pytest.mark.parametrize("body", ["softmax", "helper", "string"])
def test_remote_op_reads_are_refused_before_sending(body):
    model = wrap(nnbridge, "gpt2")
    path = "transformer.h.0.attn.softmax"

    def helper(m):
        return m.transformer.h[0].attn.softmax.output

    with pytest.raises(NNBridgeError, match=r"remote trace may read op envoys \['softmax'\].*remote=False"):
        with torch.no_grad(), model.trace(PROMPTS[0], remote="local"):
            if body == "softmax":
                model.transformer.h[0].attn.softmax.output.save()
            elif body == "helper":
                helper(model).save()
            else:
                model.get(path).output.save()
    # nothing left changed: local traces read ops and modules as before
    with torch.no_grad(), model.trace(PROMPTS[0]):
        softmax = model.transformer.h[0].attn.softmax.output.save()
    assert softmax.shape[-1] == softmax.shape[-2]
    assert torch.allclose(softmax.sum(-1), torch.ones(()))


def test_the_request_context_is_undone_on_error_and_per_thread():
    model = wrap(nnbridge, "gpt2")
    with pytest.raises(RuntimeError, match="boom"):
        with serialised_as_nnsight(is_op_point):
            raise RuntimeError("boom")
    assert b"nnbridge.envoys.models" in nnsight.intervention.serialization.dumps(model)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(nnsight.intervention.serialization.dumps(model)))
    with serialised_as_nnsight(is_op_point):
        thread.start()
        thread.join()
        assert b"nnbridge.envoys.models" not in nnsight.intervention.serialization.dumps(model)
    assert b"nnbridge.envoys.models" in seen[0]  # another thread's pickling is untouched


def test_module_names_are_not_refused():
    """Llama's final ``norm`` module is named like an ATen op: a module name, not an op read."""
    model = wrap(nnbridge, "llama")
    reference = wrap(nnsight, "llama")
    values = []
    for m in (model, reference):
        with typing_kept(), torch.no_grad(), m.trace(PROMPTS[0], remote="local"):
            values.append(m.model.norm.output.save())
    assert torch.equal(values[0], values[1])


def _typing_extensions_run_again() -> None:
    """What nnsight 0.8.1's ``remote="local"`` does where its deserialisation imports
    ``typing_extensions``: the loaded module is hidden from ``sys.modules`` meanwhile, so the import
    runs the module again (a new copy, dropped when nnsight puts the hidden modules back), and that
    import replaces functions of ``typing``."""
    import importlib
    import sys

    assert "typing_extensions" not in sys.modules, "called while nnsight hides the loaded modules"
    importlib.import_module("typing_extensions")


def _generic_over_a_param_spec() -> object:
    """``Generic[P, T]`` with ``P`` a typing_extensions ``ParamSpec`` (a base of a class torch's
    inductor defines when first imported)."""
    import typing

    import typing_extensions

    return typing.Generic[typing_extensions.ParamSpec("P"), typing.TypeVar("T")]


@pytest.mark.parametrize("library", [nnsight, nnbridge], ids=["nnsight", "nnbridge"])
def test_a_local_request_that_runs_typing_extensions_again_leaves_typing_as_it_was(library, monkeypatch):
    """nnbridge's ``remote="local"`` puts ``typing``'s attributes back after the request; plain
    nnsight's leaves them replaced (shown here, then undone), and ``Generic[P, T]`` raises."""
    import typing

    before = dict(vars(typing))
    deserialize = RequestModel.deserialize

    def running_it_again(*args, **kwargs):
        _typing_extensions_run_again()
        return deserialize(*args, **kwargs)
    monkeypatch.setattr(RequestModel, "deserialize", running_it_again)
    model = wrap(library, "gpt2")
    with typing_kept():
        with torch.no_grad(), model.trace(PROMPTS[0], remote="local"):
            logits = model.lm_head.output.save()
        changed = sorted(name for name, value in vars(typing).items() if before.get(name) is not value)
        if library is nnsight:
            assert "_collect_parameters" in changed
            with pytest.raises(TypeError, match="without a default follows"):
                _generic_over_a_param_spec()
        else:
            assert changed == []
            _generic_over_a_param_spec()
    assert logits.shape[:2] == (1, len(model.tokenizer(PROMPTS[0]).input_ids))
    _generic_over_a_param_spec()


def test_typing_kept_puts_back_replaced_added_and_removed_attributes():
    import typing

    original = typing.cast
    with pytest.raises(RuntimeError, match="boom"):
        with typing_kept():
            typing.cast = len
            typing.nnbridge_added = 1
            del typing.overload
            raise RuntimeError("boom")
    assert typing.cast is original and not hasattr(typing, "nnbridge_added") and callable(typing.overload)
