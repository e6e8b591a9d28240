"""Guards (issue 9): every assumption an extraction bakes in is checked on each call; a failed guard
extracts again, so edits after bridging, dtype changes, autocast and shape-dependent branches give
eager's numbers through bridge, PatchableGraph and nnbridge.NNsight."""

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import types
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nnbridge
from fixtures.data_dependent_module import DataDependentModule
from nnbridge import ExtractionOptions, NNBridgeError, NNBridgeWarning, PatchableGraph
from nnbridge.inplace.bridging import bridge_of
from utils import ListedWeight, assert_same, front_ends, gpt2


class Stack(nn.Module):
    """A ModuleList loop, a Python float attribute and a plain tensor attribute read in forward."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.temperature = 1.0
        self.shift = torch.zeros(4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x / self.temperature + self.shift


class Lora(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base = base
        self.down = nn.Linear(4, 2, bias=False)
        self.up = nn.Linear(2, 4, bias=False)
        nn.init.ones_(self.up.weight)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


class Parity(nn.Module):
    def forward(self, x):
        if x.shape[1] % 2 == 0:
            return x * 2
        return x * 3


def _stack():
    torch.manual_seed(0)
    return Stack().eval()


EDITS = {
    "attribute": lambda m: setattr(m, "temperature", 2.0),
    "tensor_attribute": lambda m: setattr(m, "shift", torch.ones(4)),
    "replaced_child": lambda m: m.layers.__setitem__(2, _seeded(nn.Linear, 4, 4)),
    "wrapped_child": lambda m: m.layers.__setitem__(1, _seeded(Lora, m.layers[1])),
    "parameter_reassigned": lambda m: setattr(m.layers[0], "weight", nn.Parameter(torch.full((4, 4), 0.5))),
    "appended_layer": lambda m: m.layers.append(_seeded(nn.Linear, 4, 4)),
}
CLASS_SWAPS = {
    "child_class_swapped": lambda m: setattr(m.layers[1], "__class__", DoubledLinear),
    "class_swapped": lambda m: setattr(m, "__class__", NegatedStack),
}


class DoubledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2.0


class NegatedStack(Stack):
    def forward(self, x):
        return -super().forward(x)


def _seeded(cls, *args):
    torch.manual_seed(7)
    return cls(*args)


def _assert_edit_honoured(make, edit):
    """Through each front-end (see :func:`utils.front_ends`): equal to eager, then ``edit`` on the
    target and on the eager reference changes eager's output, and the front-end's equals it."""
    x = torch.randn(3, 4)
    for name, run, target, reference in front_ends(make, x):
        before = run(x)
        assert torch.equal(before, reference(x)), name
        assert torch.equal(run(x), before), f"{name}: a second call (guards already counted once) reuses the graphs"
        edit(target)
        edit(reference)
        assert not torch.equal(reference(x), before), "the edit changes eager's output"
        assert torch.equal(run(x), reference(x)), f"{name}: edit ignored"


@pytest.mark.parametrize("edit", list(EDITS))
def test_edits_after_extraction_are_honoured(edit):
    _assert_edit_honoured(_stack, EDITS[edit])


@pytest.mark.parametrize("edit", list(CLASS_SWAPS))
def test_class_swaps_after_extraction_are_honoured(edit):
    """``module.__class__ = Sub`` (found by tests/corpus/test_fuzz.py): the graphs hold the old class's
    code; the class of every module is guarded. Through PatchableGraph and the bridge; a
    module-only nnsight trace runs nnsight's own code, which (nnsight 0.8.1, plain nnsight too)
    keeps calling the old class's forward from its second trace on."""
    x = torch.randn(3, 4)
    for name, run, target, reference in front_ends(_stack, x)[:2]:
        before = run(x)
        assert torch.equal(before, reference(x)) and torch.equal(run(x), before), name
        CLASS_SWAPS[edit](target)
        CLASS_SWAPS[edit](reference)
        assert not torch.equal(reference(x), before), "the edit changes eager's output"
        assert torch.equal(run(x), reference(x)), f"{name}: class swap ignored"


@dataclasses.dataclass
class _Settings:
    shift: float = 0.5


class Containers(nn.Module):
    """Plain values in containers read in forward: a list and a dict attribute, and a list and a
    dict of a ``config`` (as transformers' ``config.layer_types`` and ``config.rope_parameters``);
    plain objects: a dataclass instance and an ``argparse.Namespace`` (``self.args = args``); a
    list holding a tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.offsets = [0.0, 1.0]
        self.options = {"relu": True}
        self.config = types.SimpleNamespace(scales=[1.0, 2.0], flags={"negate": False})
        self.settings = _Settings()
        self.args = argparse.Namespace(gain=1.0)
        self.masks = [torch.ones(4)]

    def forward(self, x):
        y = (self.lin(x) * self.config.scales[1] + self.offsets[1] - self.settings.shift) * self.args.gain
        y = y * self.masks[0]
        if self.options["relu"]:
            y = torch.relu(y)
        return -y if self.config.flags["negate"] else y


CONTAINER_EDITS = {
    "list_written": lambda m: m.offsets.__setitem__(1, 3.0),
    "list_reassigned": lambda m: setattr(m, "offsets", [0.0, 4.0]),
    "dict_written": lambda m: m.options.__setitem__("relu", False),
    "config_list_written": lambda m: m.config.scales.__setitem__(1, 5.0),
    "config_list_reassigned": lambda m: setattr(m.config, "scales", [1.0, 7.0]),
    "config_dict_written": lambda m: m.config.flags.__setitem__("negate", True),
    "config_reassigned": lambda m: setattr(m, "config", types.SimpleNamespace(scales=[1.0, 3.0], flags={"negate": True})),
    "dataclass_field_written": lambda m: setattr(m.settings, "shift", 2.0),
    "dataclass_reassigned": lambda m: setattr(m, "settings", _Settings(shift=-1.0)),
    "namespace_field_written": lambda m: setattr(m.args, "gain", 3.0),
    "tensor_in_list_reassigned": lambda m: m.masks.__setitem__(0, torch.full((4,), 2.0)),
    "tensor_in_list_written": lambda m: m.masks[0].mul_(3.0),
}


def _containers():
    torch.manual_seed(0)
    return Containers().eval()


@pytest.mark.parametrize("edit", list(CONTAINER_EDITS))
def test_container_values_written_after_extraction_are_honoured(edit):
    """Lists and dicts of plain values were not guarded: after ``m.offsets[1] = 3.0`` (or a new
    list, or a config's list or dict written) every front-end kept the extracted values, and its
    output differed from eager without an error; so were a dataclass's or a namespace's fields, a
    config object assigned anew, and a tensor in a list (export bakes it in as a constant)."""
    _assert_edit_honoured(_containers, CONTAINER_EDITS[edit])


def _shifted_gelu(x):
    return F.gelu(x) - 0.1


class Callables(nn.Module):
    """Functions held as instance attributes and called in forward: a built-in, a
    ``functools.partial`` and a Python function (``self.act = F.gelu`` style)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fn = torch.relu
        self.leaky = functools.partial(F.leaky_relu, negative_slope=0.1)
        self.post = _shifted_gelu

    def forward(self, x):
        return self.post(self.leaky(self.fn(self.lin(x)) - 0.3))


CALLABLE_EDITS = {
    "builtin_reassigned": lambda m: setattr(m, "fn", torch.tanh),
    "partial_reassigned": lambda m: setattr(m, "leaky", functools.partial(F.leaky_relu, negative_slope=0.5)),
    "partial_keywords_written": lambda m: m.leaky.keywords.__setitem__("negative_slope", 0.7),
    "function_reassigned": lambda m: setattr(m, "post", torch.sigmoid),
    "lambda_assigned": lambda m: setattr(m, "post", lambda x: x * 2),
}


def _callables():
    torch.manual_seed(0)
    return Callables().eval()


@pytest.mark.parametrize("edit", list(CALLABLE_EDITS))
def test_function_attributes_assigned_after_extraction_are_honoured(edit):
    """A function held by a module (not a child module) was not guarded: after ``m.fn =
    torch.tanh`` the graphs kept calling ``relu``, and the output differed from eager without an
    error. Now a function, method, built-in or partial assigned anew (or a partial's keywords
    written) extracts again."""
    _assert_edit_honoured(_callables, CALLABLE_EDITS[edit])


class _ClassGainBase(nn.Module):
    gain = 2.0
    offsets = [0.0, 1.0]


class ClassGain(_ClassGainBase):
    """Plain class attributes read in forward, one inherited."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.gain + self.offsets[1]


def _class_gain():
    torch.manual_seed(0)
    return ClassGain().eval()


CLASS_EDITS = {
    "class_attribute": lambda m: setattr(ClassGain, "gain", 3.0),
    "base_class_attribute": lambda m: setattr(_ClassGainBase, "gain", 5.0),
    "base_class_list_written": lambda m: _ClassGainBase.offsets.__setitem__(1, 4.0),
}


@pytest.mark.parametrize("edit", list(CLASS_EDITS))
def test_class_attributes_changed_after_extraction_are_honoured(edit, monkeypatch):
    """Class attributes were not guarded, nor part of the extraction cache's key: after
    ``ClassGain.gain = 3.0`` the graphs kept 2.0, and the output differed from eager without an
    error. (Each edit is undone after the test.)"""
    x = torch.randn(3, 4)
    for index in range(3):  # one front-end at a time: the edit is the class's, seen by every instance
        monkeypatch.setattr(_ClassGainBase, "gain", 2.0)
        monkeypatch.setattr(_ClassGainBase, "offsets", [0.0, 1.0])
        monkeypatch.setattr(ClassGain, "gain", 2.0, raising=False)
        monkeypatch.delattr(ClassGain, "gain")
        name, run, target, reference = front_ends(_class_gain, x)[index]
        before = run(x)
        assert torch.equal(before, reference(x)), name
        CLASS_EDITS[edit](target)
        assert not torch.equal(reference(x), before), "the edit changes eager's output"
        assert torch.equal(run(x), reference(x)), f"{name}: {edit} ignored"


def test_a_hook_registered_later_does_not_extract_again():
    """nn.Module's own dicts (``_forward_hooks``...) are not guarded as values: registering a
    hook on a bridged module runs it, without a new extraction."""
    x = torch.randn(3, 4)
    model = nnbridge.bridge(_containers(), x)
    model(x)
    extractions = len(bridge_of(model).dispatcher.all_extractions())
    handle = model.lin.register_forward_hook(lambda module, args, out: out * 2)
    reference = _containers()
    reference.lin.register_forward_hook(lambda module, args, out: out * 2)
    assert torch.equal(model(x), reference(x))
    assert len(bridge_of(model).dispatcher.all_extractions()) == extractions
    handle.remove()


def test_config_flags_after_bridging():
    model, reference = gpt2(), gpt2()
    ids = torch.randint(0, 100, (2, 6))
    nnbridge.bridge(model, ids)
    for flag, value, field in [("output_hidden_states", True, "hidden_states"), ("use_cache", False, "past_key_values")]:
        setattr(model.config, flag, value)
        setattr(reference.config, flag, value)
        got, want = model(ids), reference(ids)
        assert_same(got, want)
        assert (getattr(got, field) is None) == (field == "past_key_values"), f"{flag} ignored"
    reasons = [e.reason for e in bridge_of(model).dispatcher.history]
    assert "attribute 'use_cache' of config of <root> (GPT2Config) changed True -> False" in reasons
    nnbridge.unbridge(model)


@pytest.mark.parametrize("convert", ["double", "half", "bfloat16", "to_float64"])
def test_dtype_changes_after_extraction(convert):
    x = torch.randn(3, 4)
    for name, run, target, reference in front_ends(_stack, x):
        for m in (target, reference):
            if convert == "to_float64":
                m.to(torch.float64)
            else:
                getattr(m, convert)()
        dtype = next(reference.parameters()).dtype
        assert torch.equal(run(x.to(dtype)), reference(x.to(dtype))), f"{name}: {convert}"


def test_float_input_on_a_double_model_fails_like_eager():
    model = nnbridge.bridge(_stack(), torch.randn(3, 4))
    reference = _stack().double()
    model.double()
    with pytest.raises(RuntimeError) as eager:
        reference(torch.randn(3, 4))
    with pytest.raises(RuntimeError) as bridged:
        model(torch.randn(3, 4))
    assert str(bridged.value) == str(eager.value)


def test_autocast_state_is_guarded():
    torch.manual_seed(0)
    model = Stack().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pg = PatchableGraph(model, x)
        assert torch.equal(pg(x), reference(x))
    assert torch.equal(pg(x), reference(x)), "called without autocast"
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(pg(x), reference(x))
    assert [e.reason for e in pg._dispatcher.history][1:] == ["autocast state changed", "autocast state changed"]


class DefaultDtypeReader(nn.Module):
    """Branches on ``torch.get_default_dtype()`` and makes a tensor in it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        made = torch.ones(4)  # in the default dtype
        scale = 2.0 if torch.get_default_dtype() == torch.float32 else 5.0
        return (self.lin(x) * scale).to(made.dtype) + made


@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
def test_default_dtype_is_part_of_the_call_structure(front):
    """Extracted under float32, called under ``torch.set_default_dtype(torch.float64)``: as eager
    (before, the graph kept float32's branch and dtype, silently)."""
    torch.manual_seed(0)
    model = DefaultDtypeReader().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    run = nnbridge.bridge(model, x) if front == "bridge" else PatchableGraph(model, x)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got, want = run(x), reference(x)
    finally:
        torch.set_default_dtype(previous)
    assert got.dtype == want.dtype == torch.float64 and torch.equal(got, want)
    assert torch.equal(run(x), reference(x)), "back under float32"
    dispatcher = bridge_of(model).dispatcher if front == "bridge" else run._dispatcher
    assert [e.reason for e in dispatcher.history][1:] == ["default dtype changed (torch.float32 -> torch.float64)"]


class FlagReader(nn.Module):
    """Branches on inference mode and deterministic algorithms."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        scale = 1.0 + torch.is_inference_mode_enabled() + 2 * torch.are_deterministic_algorithms_enabled()
        return self.lin(x) * scale


@contextlib.contextmanager
def _deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("front", ["bridge", "patchable_graph"])
@pytest.mark.parametrize("case", ["inference mode", "deterministic algorithms"])
def test_inference_mode_and_deterministic_algorithms_are_part_of_the_call_structure(front, case):
    """Extracted under ``torch.no_grad()``, then called under ``torch.inference_mode()`` or with
    deterministic algorithms: as eager (before, the graph kept the branch it was exported with,
    silently)."""
    torch.manual_seed(0)
    model = FlagReader().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    with torch.no_grad():
        run = nnbridge.bridge(model, x) if front == "bridge" else PatchableGraph(model, x)
    context = {"inference mode": torch.inference_mode, "deterministic algorithms": _deterministic}[case]
    with torch.no_grad(), context():
        got, want = run(x), reference(x)
    assert torch.equal(got, want)
    dispatcher = bridge_of(model).dispatcher if front == "bridge" else run._dispatcher
    assert [e.reason for e in dispatcher.history][1:] == ["inference mode or deterministic algorithms changed"]


def test_grad_mode_is_part_of_the_call_structure():
    """A graph extracted under torch.no_grad() does not serve a call with grad enabled (it may hold
    code that ran without grad: a ``@torch.no_grad`` helper inlined), and the history says why."""
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        pg = PatchableGraph(model, x)
    pg(x)
    assert len(pg.extractions) == 2
    assert pg._dispatcher.history[-1].reason == "grad mode changed (disabled -> enabled)"


def test_shape_guards_recorded_by_export_are_checked():
    model = Parity()
    pg = PatchableGraph(model, torch.randn(2, 8))
    assert pg.extractions[0].guard.code == ["(L['args'][0].size()[1] % 2) == 0"]
    for length in (7, 8, 9, 10):
        x = torch.randn(2, length)
        assert torch.equal(pg(x), model(x)), length
    assert len(pg.extractions) == 2, "one graph per parity"
    assert "does not hold" in pg._dispatcher.history[1].reason
    bridged = nnbridge.bridge(Parity(), torch.randn(2, 8))
    x = torch.randn(2, 7)
    assert torch.equal(bridged(x), x * 3)


def test_recompile_limit_evicts_and_warns_once_at_the_users_line():
    torch.manual_seed(0)
    model = Stack().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    pg = PatchableGraph(model, x, options=ExtractionOptions(recompile_limit=2))
    with pytest.warns(NNBridgeWarning, match=r"Module 'Stack' \(Stack\) has been extracted 3 times.*"
                                            r"attribute 'temperature' of <root> changed") as caught:
        for temperature in (2.0, 3.0, 4.0, 5.0):
            model.temperature = reference.temperature = temperature
            assert torch.equal(pg(x), reference(x))
    assert len(caught) == 1, "warned once"
    assert caught[0].filename == __file__, "the warning points at the user's line"
    assert len(pg.extractions) == 2, "least recently used extractions are evicted"
    assert len(pg._dispatcher.history) == 5
    # the history keeps why each was made, not the evicted extractions
    from nnbridge.dispatch.dispatcher import EvictedExtraction

    evicted = [e for e in pg._dispatcher.history if isinstance(e, EvictedExtraction)]
    assert [e.reason for e in evicted] == ["first call", "attribute 'temperature' of <root> changed 1.0 -> 2.0",
                                           "attribute 'temperature' of <root> changed 2.0 -> 3.0"]
    assert sum(1 for e in pg._dispatcher.history if not isinstance(e, EvictedExtraction)) == 2
    live = [weakref.ref(e.root) for e in pg.extractions]
    gc.collect()
    assert all(ref() is not None for ref in live)
    assert "2. <root>: attribute 'temperature' of <root> changed 1.0 -> 2.0" in str(nnbridge.explain(pg, x))


@pytest.mark.parametrize("front", ["bridge", "PatchableGraph"])
def test_evicted_extractions_are_freed(front):
    """A call that keeps changing a guarded value (here an attribute; a new int argument is the same)
    keeps at most recompile_limit extractions alive; a PatchableGraph also keeps its first, inspected one."""
    torch.manual_seed(0)
    model = Stack().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    options = ExtractionOptions(recompile_limit=2)
    if front == "bridge":
        run = nnbridge.bridge(model, x, options=options)
        dispatcher = bridge_of(model).dispatcher
    else:
        run = PatchableGraph(model, x, options=options)
        dispatcher = run._dispatcher
    roots = [weakref.ref(dispatcher.all_extractions()[0].root)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NNBridgeWarning)
        for temperature in (2.0, 3.0, 4.0, 5.0):
            model.temperature = reference.temperature = temperature
            assert torch.equal(run(x), reference(x))
            roots.append(weakref.ref(dispatcher.all_extractions()[-1].root))
    gc.collect()
    alive = [ref() is not None for ref in roots]
    first_kept = front == "PatchableGraph"  # pg.graph shows the first extraction
    assert alive == [first_kept, False, False, True, True]


def test_explain_tree_opaque_reasons_guards_and_history():
    model = DataDependentModule().eval()
    x = torch.randn(4, 3)
    with torch.no_grad():
        nnbridge.bridge(model, x)
    model(x)
    explanation = nnbridge.explain(model)
    assert [h for h in explanation.history if h[0] == ""] == [("", "first call"),
                                                              ("", "grad mode changed (disabled -> enabled)")]
    assert ("branchy.inner", "first call") in explanation.history, "the opaque module's children have their own"
    assert set(explanation.opaque) == {"branchy"}
    assert "GuardOnDataDependentSymNode" in explanation.opaque["branchy"]
    text = str(explanation)
    assert "branchy (Branchy): opaque (runs eagerly): GuardOnDataDependentSymNode" in text
    assert "module state: identity, dtype, device, shape and requires_grad of" in text
    nnbridge.unbridge(model)


def test_explain_plain_module_and_pg_and_errors():
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.randn(3, 4)
    explanation = nnbridge.explain(model, x)
    assert [m.kind for m in explanation.modules] == ["graph"] * 4 and explanation.history == [("", "first call")]
    assert "forward" not in model.__dict__ and len(list(model.named_modules())) == 5, "a plain module is not modified"
    assert all(type(m) is torch.nn.Linear for m in model.layers)
    pg = PatchableGraph(model, x)
    assert nnbridge.explain(pg).modules[0].module_type == "Stack"
    with pytest.raises(NNBridgeError, match="has not been extracted yet"):
        nnbridge.explain(model)
    with pytest.raises(NNBridgeError, match="takes a module"):
        nnbridge.explain(3)


def test_unchanged_state_reuses_the_extraction():
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.randn(3, 4)
    pg = PatchableGraph(model, x)
    model.temperature = 1.0  # same value, new object
    model.layers[0].weight.data.mul_(1.0)  # in-place value edits are read live, not guarded
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            pg(x)
    assert len(pg.extractions) == 1



def test_tensor_properties_fast_check_only_accepts():
    """StateGuard checks parameters' properties with torch's C-level tensor check first
    (compat.torch.tensor_checks), which also compares strides and dispatch keys: a strides-only change
    and torch.inference_mode (other dispatch keys) keep the extractions, by the exact check; a dtype,
    shape or requires_grad change still extracts again, and every call equals eager."""
    torch.manual_seed(0)
    model = Stack().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    pg = PatchableGraph(model, x)
    state = pg.extractions[0].state
    assert state._fast_properties is not None and state.holds()
    weight = model.layers[0].weight
    weight.data = weight.data.t().contiguous().t()  # same values and shape, other strides
    assert state.holds() and not state._fast_properties()
    assert torch.equal(pg(x), reference(x)) and len(pg.extractions) == 1
    weight.data = weight.data.contiguous()
    assert state._fast_properties()
    with torch.inference_mode():  # (a call structure of its own: its extraction's state holds too)
        assert state.holds() and not state._fast_properties()
        assert torch.equal(pg(x), reference(x))
        assert torch.equal(pg(x), reference(x)) and len(pg.extractions) == 2
        assert pg.extractions[-1].state.holds()
    assert torch.equal(pg(x), reference(x)) and len(pg.extractions) == 2
    model.layers[1].weight.requires_grad_(False)
    assert not state.holds()
    model.layers[1].weight.requires_grad_(True)
    model.layers[1].bias.data = model.layers[1].bias.data.double()
    assert not state.holds()
    model.layers[1].bias.data = model.layers[1].bias.data.float()
    assert state.holds()
    model.layers[1].bias.data = torch.zeros(5)
    assert not state.holds()


class _BranchOnRequiresGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h * 3 if h.requires_grad else h


def test_requires_grad_of_inputs_and_parameters_is_guarded():
    """A branch on ``requires_grad`` is decided at export: inputs' ``requires_grad`` is part of the
    call structure, parameters' is guarded (freezing after bridging re-extracts)."""
    torch.manual_seed(0)
    model = _BranchOnRequiresGrad()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    nnbridge.bridge(model, x)
    assert torch.equal(model(x), reference(x))
    model.fc.requires_grad_(False)
    reference.fc.requires_grad_(False)
    assert torch.equal(model(x), reference(x))  # before: the graph kept the trainable side (x3)
    assert "changed requires_grad True -> False" in (bridge_of(model).dispatcher.history[-1].reason or "")
    leaf = x.clone().requires_grad_()
    assert torch.equal(model(leaf), reference(leaf))
    nnbridge.unbridge(model)


def test_child_re_extracted_while_transformers_collects_outputs():
    """A child re-extracted inside a forward that collects hidden states with transformers' hooks
    (an opaque GPT2Model) leaves nothing of extraction's runs in the collector (before: the
    extraction's fake tensors were returned as hidden states)."""
    model, reference = gpt2(), gpt2()
    ids = torch.randint(0, 100, (2, 6))
    nnbridge.bridge(model, ids, output_hidden_states=True)
    assert_same(model(ids, output_hidden_states=True), reference(ids, output_hidden_states=True))
    for m in (model, reference):
        m.transformer.h[1].attn.scale_attn_weights = False  # a plain attribute the layer's graph bakes in
    got, want = model(ids, output_hidden_states=True), reference(ids, output_hidden_states=True)
    assert all(type(h) is torch.Tensor for h in got.hidden_states)
    assert_same(got, want)
    nnbridge.unbridge(model)


class _OpPointLike(nn.Module):
    """Stands for nnbridge's op points: children the guard is told to skip."""


def test_size_guard_counts_again_when_a_dict_holding_op_points_grows():
    """A module dict longer than its guarded size (it holds op points) is counted once per length:
    a child added after that first count still fails the guard, an op point added does not."""
    from nnbridge.guards.module_state import StateGuard
    model = _stack()
    model.add_module("point_0", _OpPointLike())
    guard = StateGuard(model, opaque=set(), skip=lambda child: isinstance(child, _OpPointLike))
    assert guard.holds() and guard.holds(), "op points are not guarded"
    model.add_module("point_1", _OpPointLike())
    assert guard.holds(), "another op point is not an edit"
    model.add_module("extra", nn.Linear(4, 4))
    assert not guard.holds()
    assert guard.what_changed() == "entries of <root> were added or removed (1 -> 4)"


def test_functional_call_with_other_tensors_equals_eager():
    """``torch.func.functional_call`` swaps plain tensors into the parameter slots for one call:
    the guard sees them re-assigned and extracts again (building the opaque stand-in of a module
    whose parameter slot held a plain tensor raised ``TypeError`` from ``register_parameter``).
    Outputs and gradients equal eager's; after the call the model is served by its first
    extraction again."""
    ids = torch.randint(0, 100, (1, 8))
    model, reference = gpt2(), gpt2()
    nnbridge.bridge(model, ids)
    first = len(bridge_of(model).dispatcher.all_extractions())
    swapped = {name: (p.detach() * 1.5).requires_grad_() for name, p in model.named_parameters()}
    expected = {name: t.detach().clone().requires_grad_() for name, t in swapped.items()}
    out = torch.func.functional_call(model, swapped, (ids,)).logits
    eager = torch.func.functional_call(reference, expected, (ids,)).logits
    assert torch.equal(out, eager) and not torch.equal(out, reference(ids).logits)
    out.sum().backward()
    eager.sum().backward()
    for name in swapped:
        assert torch.equal(swapped[name].grad, expected[name].grad), name
    assert torch.equal(model(ids).logits, reference(ids).logits)
    assert all(p.grad is None for p in model.parameters())
    extractions = len(bridge_of(model).dispatcher.all_extractions())
    model(ids)
    assert len(bridge_of(model).dispatcher.all_extractions()) == extractions > first


def test_a_listed_frozen_parameter_written_in_place_extracts_again():
    """A frozen parameter in a list attribute (as ``nn.LSTM._flat_weights``) is baked in as a
    constant like any tensor there: written in place, it extracts again and equals eager (one
    requiring grad runs eagerly: test_faithful_extraction's
    test_a_parameter_read_through_a_list_runs_eagerly_with_its_gradient)."""
    x = torch.randn(3, 4)
    model, reference = ListedWeight(), ListedWeight()
    for module in (model, reference):
        module.lin.weight.requires_grad_(False)
    nnbridge.bridge(model, x)
    assert torch.equal(model(x), reference(x))
    with torch.no_grad():
        for module in (model, reference):
            module.lin.weight.mul_(2.0)
    assert torch.equal(model(x), reference(x))
    assert len(bridge_of(model).dispatcher.all_extractions()) == 2


class _CountingRoot(nn.Module):
    """Runs opaque (it counts its calls, a Python side effect) and calls blocks held in a
    ModuleDict of ModuleLists."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.blocks = nn.ModuleDict({"stack": nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])})

    def forward(self, x):
        for block in self.blocks["stack"]:
            x = block(x)
        self.calls += 1
        return x * self.calls


def test_an_opaque_modules_containers_registries_are_guarded():
    """An opaque module runs with its children swapped for dispatchers found through its
    ModuleList/ModuleDict containers when it was extracted: a container entry replaced after that
    fails the guard (the replaced block is called, as eager calls it), the containers' other
    state is not guarded (the opaque code never reads those objects while the graphs run)."""
    from nnbridge.guards.module_state import StateGuard
    model = _CountingRoot()
    guard = StateGuard(model, opaque={id(model)})
    model.blocks["stack"].note = 1.0
    assert guard.holds()
    model.blocks["stack"][0] = nn.Linear(4, 4)
    assert not guard.holds()
    assert guard.what_changed() == "child '0' of blocks.stack (Linear) was replaced by a Linear"


def _front(front: str, model: nn.Module, x: torch.Tensor) -> nn.Module:
    """``model`` bridged in place (``front == "bridge"``) or a PatchableGraph over it (``"pg"``)."""
    if front == "bridge":
        nnbridge.bridge(model, x)
        return model
    return PatchableGraph(model, x)


@pytest.mark.parametrize("front", ["bridge", "pg"])
def test_an_entry_replaced_in_an_opaque_roots_container_is_called(front):
    torch.manual_seed(0)
    eager = _CountingRoot()
    model = copy.deepcopy(eager)
    x = torch.randn(2, 4)
    run = _front(front, model, x)
    assert torch.equal(run(x), eager(x))
    assert "" in nnbridge.explain(run).opaque, "the root runs opaque"
    torch.manual_seed(1)
    eager.blocks["stack"][0] = nn.Linear(4, 4)
    torch.manual_seed(1)
    model.blocks["stack"][0] = nn.Linear(4, 4)
    assert torch.equal(run(x), eager(x))
    assert model.calls == eager.calls


class _Ordered(nn.ModuleList):
    """A ModuleList whose iteration order is an attribute."""

    backwards = False

    def __iter__(self):
        items = list(super().__iter__())
        return iter(items[::-1] if self.backwards else items)


class _OrderedRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0  # (counted in forward, a Python side effect: the root runs opaque)
        self.blocks = _Ordered([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.blocks.backwards = True

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        self.calls += 1
        return x


@pytest.mark.parametrize("front", ["bridge", "pg"])
def test_an_opaque_modules_container_keeps_and_guards_its_own_state(front):
    """The opaque root iterates a copy of its container holding its children's dispatchers: the
    copy keeps the container's attributes (its ``__iter__`` reads one), and a change to them after
    extraction is honoured."""
    torch.manual_seed(0)
    eager = _OrderedRoot()
    model = copy.deepcopy(eager)
    x = torch.randn(2, 4)
    run = _front(front, model, x)
    assert torch.equal(run(x), eager(x))
    eager.blocks.backwards = model.blocks.backwards = False
    assert torch.equal(run(x), eager(x))
