"""The run-time patch registry (nnbridge/compat/registry.py): every patch of torch, transformers
or nnsight is registered and version-gated, still fits the code it patches on the installed
versions, and none is made outside the registry.

- ``test_probe``: for each patch, on whichever torch runs the suite (CI: 2.13.0; 2.14.1 and 2.15.0
  by hand), the patched function still has the signature and behaviour the patch assumes.
- ``test_no_unregistered_patch_in_the_sources`` / ``test_scan_finds_planted_patches``: a static
  scan of nnbridge/ (tests/patch_scan.py), and the same scan on a planted module.
- ``test_no_unregistered_patch_while_extracting`` / ``test_spy_finds_a_planted_patch``: every
  attribute of torch, transformers and nnsight that differs while a module is extracted (seen from
  the module's own forward) is one the registry put in place, or one plain ``torch.export``
  changes too.
- ``test_unknown_torch_*``: on a torch outside the verified versions, speed patches are skipped
  and a tiny GPT-2's ``PatchableGraph`` still equals eager; a correctness patch refuses at import.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import linecache
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import nnbridge
from nnbridge.compat import registry
from nnbridge.errors import NNBridgeError

from patch_scan import scan_source, scan_tree
from utils import gpt2, llama

REPO = Path(__file__).resolve().parents[2]
TORCH = registry.major_minor(torch.__version__)


def _parameters(function: Any) -> list[str]:
    """Parameter names of ``function`` (a function, method, classmethod or staticmethod)."""
    return list(inspect.signature(getattr(function, "__func__", function)).parameters)


def _static(owner: Any, name: str) -> Any:
    return inspect.getattr_static(owner, name)


# -- probes: what each patch assumes about the code it patches -------------------------------------

class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 3  # not the derivative: shows the custom backward ran


def probe_autograd_function_apply() -> None:
    from nnbridge.compat.torch.capture import autograd_function_calls

    assert "apply" in vars(torch.autograd.Function) and hasattr(vars(torch.autograd.Function)["apply"], "__get__")
    seen: list[type] = []
    x = torch.ones(2, requires_grad=True)
    with autograd_function_calls(seen.append):
        y = _Double.apply(x)
    y.sum().backward()
    assert seen == [_Double] and torch.equal(y, torch.full((2,), 2.0)) and torch.equal(x.grad, torch.full((2,), 3.0))
    assert vars(torch.autograd.Function)["apply"] is not None and _Double.apply(x).grad_fn is not None


def probe_set_grad_enabled() -> None:
    from nnbridge.compat.torch.capture import grad_mode_changes, grad_mode_frozen

    assert callable(torch._C._set_grad_enabled)
    changes: list[None] = []
    with grad_mode_changes(lambda: changes.append(None)):
        with torch.no_grad():  # routes through torch._C._set_grad_enabled, looked up at call time
            assert not torch.is_grad_enabled()
    assert len(changes) == 2 and torch.is_grad_enabled()
    with grad_mode_frozen(lambda: True), torch.no_grad():
        assert torch.is_grad_enabled()


def probe_graph_break() -> None:
    from torch._dynamo import decorators, graph_break

    from nnbridge.compat.torch.capture import graph_break_calls

    assert graph_break is decorators.graph_break and isinstance(graph_break, types.FunctionType)
    assert _parameters(graph_break) == ["msg"] and graph_break.__code__.co_freevars == ()
    seen: list[str] = []
    with graph_break_calls(seen.append):
        graph_break("here")
    assert seen == ["here"] and graph_break() is None


def probe_compile_queries() -> None:
    import torch.compiler as compiler

    from nnbridge.compat.torch.capture import compile_queries

    for function in (compiler.is_compiling, compiler.is_exporting):
        assert isinstance(function, types.FunctionType) and _parameters(function) == []
        assert function.__code__.co_freevars == ()

    class Asks(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1 if torch.compiler.is_exporting() else x

    seen: list[tuple[str, str]] = []
    with compile_queries(lambda question, code: seen.append((question, code))):
        torch.export.export(Asks(), (torch.ones(2),), strict=False)
        assert not torch.compiler.is_compiling()
    assert ("torch.compiler.is_exporting()", f"{__name__}.probe_compile_queries.<locals>.Asks.forward") in seen


def probe_tensor_data() -> None:
    from nnbridge.compat.torch.tensor_data import data_accesses, raw_data

    descriptor = vars(torch._C.TensorBase)["data"]
    assert hasattr(descriptor, "__get__") and hasattr(descriptor, "__set__")
    assert "data" not in vars(torch.Tensor) and "data" not in vars(nn.Parameter)
    weight = nn.Parameter(torch.ones(3))
    seen: list[torch.Tensor] = []
    with data_accesses(seen.append):
        weight.data -= 1
        weight.data = torch.full((3,), 5.0)
    assert len(seen) == 3 and all(t is weight for t in seen) and torch.equal(weight, torch.full((3,), 5.0))
    assert torch.equal(raw_data(weight), weight.detach()) and "data" not in vars(torch.Tensor)


class _Child(nn.Module):
    def forward(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        return x * 2 if kind == "double" else x


class _Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = _Child()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x, "double") + 1


def probe_string_arguments() -> None:
    from torch.fx.experimental import proxy_tensor

    from nnbridge.compat.torch.tracepoints import string_arguments_traced

    assert _parameters(proxy_tensor.extract_val) == ["val", "include_real"]
    with string_arguments_traced():
        exported = torch.export.export(_Parent(), (torch.ones(2),), strict=False,
                                       preserve_module_call_signature=("child",))
    assert torch.equal(exported.module()(torch.ones(2)), torch.full((2,), 3.0))


def _helper(x: torch.Tensor) -> torch.Tensor:
    return x.sin()  # the line the node's stack trace must end on


class _CallsHelper(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _helper(x)


def probe_helper_frames() -> None:
    from torch.fx.proxy import TracerBase

    from nnbridge.compat.torch.stack_traces import helper_frames_recorded

    assert _parameters(vars(TracerBase)["_filter_traceback_frames"]) == ["self", "user_stack_summary"]
    with helper_frames_recorded():
        exported = torch.export.export(_CallsHelper(), (torch.ones(2),), strict=False)
    sin = next(node for node in exported.graph.nodes if node.target is torch.ops.aten.sin.default)
    assert "the line the node's stack trace must end on" in sin.meta["stack_trace"].strip().splitlines()[-1]


def probe_lazy_traceback_lines() -> None:
    import torch.utils._traceback as torch_traceback

    from nnbridge.compat.torch.stack_traces import helper_frames_recorded

    assert _parameters(torch_traceback._extract_symbolized_tb) == ["tb", "skip"]
    assert "_extract_symbolized_tb" in torch_traceback.CapturedTraceback.summary.__code__.co_names
    captured = torch_traceback.CapturedTraceback.extract()
    expected = "".join(captured.format())
    with helper_frames_recorded():
        assert registry.active("lazy_traceback_lines")
        assert "".join(captured.format()) == expected and expected.count("\n") > 2


def probe_tracepoint_bookkeeping() -> None:
    from torch.fx.experimental import proxy_tensor
    from torch.fx.proxy import TracerBase

    from nnbridge.compat.torch.tracepoints import tracepoint_bookkeeping_skipped

    assert _parameters(proxy_tensor.set_meta) == ["proxy", "val"]
    assert _parameters(vars(TracerBase)["create_node"]) == ["self", "kind", "target", "args", "kwargs", "name",
                                                            "type_expr"]
    assert hasattr(torch.ops.higher_order, "_export_tracepoint")
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    exported = torch.export.export(model, (torch.ones(1, 2),), strict=False, preserve_module_call_signature=("0",))
    with tracepoint_bookkeeping_skipped():
        skipped = torch.export.export(model, (torch.ones(1, 2),), strict=False, preserve_module_call_signature=("0",))
    assert str(skipped.graph) == str(exported.graph)


def probe_duck_sizing() -> None:
    import dataclasses

    from torch._export import non_strict_utils
    from torch.fx.experimental import symbolic_shapes

    from nnbridge.compat.torch.duck_sizing import duck_sized

    assert _parameters(non_strict_utils._create_symbolic_context_for_tensor) == [
        "t", "source", "t_constraints", "sources", "mode"]
    fields = {f.name for f in dataclasses.fields(symbolic_shapes.StatelessSymbolicContext)}
    assert {"dynamic_sizes", "constraint_sizes"} <= fields and hasattr(symbolic_shapes.DimDynamic, "DUCK")

    class Add(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a.sum() + b.sum()

    a, b = torch.ones(3, 4), torch.ones(3, 4)
    dims = ({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},) * 2
    with duck_sized([a, b]):
        exported = torch.export.export(Add(), (a, b), strict=False, dynamic_shapes=dims)
    sizes = [node.meta["val"].shape for node in exported.graph.nodes if node.op == "placeholder"]
    assert str(sizes[0][0]) == str(sizes[1][0]) and str(sizes[0][1]) == str(sizes[1][1]), sizes


def probe_unbacked_bindings() -> None:
    from torch._export import utils
    from torch.export import _trace
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils._sympy import symbol

    from nnbridge.compat.torch.unbacked import unbacked_bindings_pass_narrowed

    assert _parameters(_trace._replace_unbacked_bindings) == ["gm"] and callable(utils._get_shape_env_from_gm)
    assert hasattr(symbol.SymT, "UNBACKED_INT") and hasattr(symbol.SymT, "UNBACKED_FLOAT")
    assert hasattr(ShapeEnv(), "unbacked_renamings") and hasattr(ShapeEnv(), "var_to_range")

    class NonZero(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.nonzero().sum() + x.sum()

    with unbacked_bindings_pass_narrowed():
        plain = torch.export.export(nn.Linear(2, 2), (torch.ones(1, 2),), strict=False)
        unbacked = torch.export.export(NonZero(), (torch.ones(3),), strict=False)
    assert not any("unbacked_bindings" in node.meta for node in plain.graph.nodes)
    assert any("unbacked_bindings" in node.meta for node in unbacked.graph.nodes), "torch's own pass ran"


def probe_fake_tensor_cache_off() -> None:
    import torch._dynamo.config as config
    from torch._subclasses.fake_tensor import FakeTensorMode

    from nnbridge.compat.torch.fake_tensors import fake_tensor_cache_off

    assert isinstance(config.fake_tensor_cache_enabled, bool)
    with fake_tensor_cache_off():
        assert FakeTensorMode().cache_enabled is False


def probe_shape_envs_released() -> None:
    from torch.export import _trace

    from nnbridge.compat.torch.export import shape_envs_released

    assert _parameters(_trace.make_fake_inputs)[:4] == ["nn_module", "args", "kwargs", "dynamic_shapes"]
    assert "make_fake_inputs" in _trace._non_strict_export.__code__.co_names or "make_fake_inputs" in inspect.getsource(_trace)
    with shape_envs_released():
        exported = torch.export.export(nn.Linear(2, 2), (torch.ones(3, 2),), strict=False,
                                       dynamic_shapes=({0: torch.export.Dim.AUTO},))
    value = next(node.meta["val"] for node in exported.graph.nodes if node.op == "placeholder")
    assert value.fake_mode.shape_env is not None and not value.fake_mode.shape_env.tracked_fakes


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.lin(x))


def probe_no_module_deduplication() -> None:
    from torch.export import unflatten as _  # noqa: F401 - the module, shadowed by the function

    from nnbridge.compat.torch.export import invocation_graphs, unflatten

    module = sys.modules["torch.export.unflatten"]
    assert _parameters(module._deduplicate_modules) == ["partitions"]
    exported = torch.export.export(_Twice(), (torch.ones(1, 2),), strict=False,
                                   preserve_module_call_signature=("lin",))
    unflattened = unflatten(exported)
    assert len(invocation_graphs(unflattened.lin)) == 2


class _DropsOne(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin(x)  # output never read: dead code in the program
        return self.lin(x + 1)


def probe_unused_calls_kept() -> None:
    from torch.export import unflatten as _  # noqa: F401 - the module, shadowed by the function

    from nnbridge.compat.torch.export import invocation_graphs, unflatten

    module = sys.modules["torch.export.unflatten"]
    assert _parameters(module._remove_effect_tokens) == ["ep"]
    exported = torch.export.export(_DropsOne(), (torch.ones(1, 2),), strict=False,
                                   preserve_module_call_signature=("lin",))
    unflattened = unflatten(exported)
    assert len(invocation_graphs(unflattened.lin)) == 2
    # torch's own pass drops the dead call and the program is left without it
    module._remove_effect_tokens(exported)
    assert sum(node.target is torch.ops.aten.linear.default for node in exported.graph.nodes) == 1


def probe_lazy_unflatten_code() -> None:
    from torch.fx import _lazy_graph_module

    from nnbridge.compat.torch.export import unflatten

    module = sys.modules["torch.export.unflatten"]
    for cls in (module.InterpreterModule, module.UnflattenedModule):
        assert _parameters(vars(cls)["finalize"]) == ["self"]
    model = _Twice()
    exported = torch.export.export(model, (torch.ones(1, 2),), strict=False, preserve_module_call_signature=("lin",))
    unflattened = unflatten(exported)
    assert isinstance(unflattened.graph_module, _lazy_graph_module._LazyGraphModule)
    assert isinstance(unflattened.__dict__.get("graph_module"), _lazy_graph_module._LazyGraphModule)


def probe_generated_code_released() -> None:
    import gc

    import torch.fx.graph_module as fx

    from nnbridge.compat.torch.fx import generated_code_released

    assert _parameters(fx._method_from_src) == ["method_name", "src", "globals", "co_fields"]
    assert "_method_from_src" in fx._forward_from_src.__code__.co_names
    with generated_code_released():
        traced = torch.fx.symbolic_trace(nn.ReLU())
    filename = traced.forward.__code__.co_filename
    assert filename in fx._loader.eval_cache
    del traced
    gc.collect()
    assert filename not in fx._loader.eval_cache and filename not in linecache.cache


def probe_fx_patches_confined() -> None:
    from torch.fx._symbolic_trace import _Patcher

    from nnbridge.compat.torch.fx import fx_patches_confined

    assert _parameters(vars(_Patcher)["patch"]) == ["self", "frame_dict", "name", "new_fn", "deduplicate"]
    assert _parameters(vars(_Patcher)["patch_method"]) == ["self", "cls", "name", "new_fn", "deduplicate"]
    called_elsewhere: list[torch.Tensor] = []

    class Calls(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            thread = threading.Thread(target=lambda: called_elsewhere.append(nn.ReLU()(torch.ones(1))))
            thread.start()
            thread.join()
            return x + 1

    with fx_patches_confined(contextlib.nullcontext()):
        torch.fx.symbolic_trace(Calls())
    assert len(called_elsewhere) == 1 and isinstance(called_elsewhere[0], torch.Tensor)


def _program() -> torch.export.ExportedProgram:
    return torch.export.export(_Twice(), (torch.ones(3, 2),), strict=False,
                               dynamic_shapes=({0: torch.export.Dim.AUTO},))


def _round_trip() -> None:
    """A program saved and loaded by nnbridge computes and prints as torch's own load of it."""
    from nnbridge.compat.torch.serialization import load_program, save_program

    exported = _program()
    stream = io.BytesIO()
    save_program(exported, stream)
    ours = load_program(io.BytesIO(stream.getvalue()))
    theirs = torch.export.load(io.BytesIO(stream.getvalue()))
    assert str(ours.graph) == str(theirs.graph)
    x = torch.randn(5, 2)
    assert torch.equal(ours.module()(x), theirs.module()(x))


def probe_load_fake_tensor_meta() -> None:
    from torch._export.serde import serialize
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    deserializer = serialize.GraphModuleDeserializer
    assert _parameters(vars(deserializer)["deserialize_tensor_meta"]) == ["self", "tensor_meta"]
    # a symbolic size is made as deserialize_sym_int makes it: the parsed expression, then a SymInt node
    assert _parameters(vars(deserializer)["_parse_sym_expr"]) == ["self", "expr_str", "hint"]
    assert {"_parse_sym_expr", "create_symintnode"} <= set(vars(deserializer)["deserialize_sym_int"].__code__.co_names)
    assert "symbol_name_to_symbol" in vars(deserializer)["_parse_sym_expr"].__code__.co_names
    assert callable(serialize.deserialize_device) and serialize._SERIALIZE_TO_TORCH_DTYPE and in_kernel_invocation_manager
    _round_trip()


def probe_load_schema_reader() -> None:
    import json

    from torch._export.serde import schema, serialize
    from torch._export.serde.union import _Union
    from torch.export.pt2_archive import _package

    from nnbridge.compat.torch.schema_reader import SchemaReader

    # the stand-in is called as torch calls the function, from both modules that hold it
    assert _parameters(serialize._dict_to_dataclass) == ["cls", "data"]
    assert _package._dict_to_dataclass is serialize._dict_to_dataclass
    assert "_dict_to_dataclass" in serialize._bytes_to_dataclass.__code__.co_names
    assert "_dict_to_dataclass" in _package._load_payload_config.__code__.co_names
    # the branches the reader follows: names resolved by torch's own function, unions made by create
    reader = serialize._dict_to_dataclass.__code__
    assert {"_resolve_schema_cls", "get_type_hints", "create", "fields", "is_dataclass"} <= set(reader.co_names)
    assert serialize._resolve_schema_cls("TensorArgument") is schema.TensorArgument
    assert issubclass(schema.Argument, _Union) and callable(schema.Argument.create)
    data = json.loads(serialize.serialize(_program()).exported_program)
    assert SchemaReader()(schema.ExportedProgram, data) == serialize._dict_to_dataclass(schema.ExportedProgram, data)
    _round_trip()


def probe_mask_skips() -> None:
    from transformers import masking_utils

    from nnbridge.compat.transformers.mask_skips import mask_skips

    assert _parameters(masking_utils._ignore_causal_mask_sdpa)[:2] == ["padding_mask", "q_length"]
    assert _parameters(masking_utils._ignore_bidirectional_mask_sdpa)[:2] == ["padding_mask", "kv_length"]
    assert "_ignore_causal_mask_sdpa" in masking_utils.sdpa_mask.__code__.co_names or any(
        "_ignore_causal_mask_sdpa" in getattr(c, "co_names", ()) for c in masking_utils.sdpa_mask.__code__.co_consts)
    model = llama("sdpa")
    skips: list[None] = []
    with mask_skips(lambda: skips.append(None)), torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert skips, "an unpadded causal sdpa call skips its mask in eager code"


def probe_cache_layer_touches() -> None:
    from transformers.cache_utils import CacheLayerMixin, DynamicCache

    from nnbridge.compat.transformers import cache_layers

    assert "__getattribute__" not in vars(CacheLayerMixin)
    cache = DynamicCache()
    cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)
    layer = cache.layers[0]
    assert "__getattribute__" not in vars(type(layer))
    with cache_layers.layer_touches():
        assert cache_layers.watchable(layer)
        with cache_layers.scope([cache]) as opened:
            layer.keys  # noqa: B018 - a touch
        assert opened is not None and opened.touched
    assert "__getattribute__" not in vars(CacheLayerMixin)


def probe_cache_update_traced() -> None:
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

    from nnbridge.compat.transformers.cache_updates import CacheIndex, CacheTrace, cache_updates_traced

    assert _parameters(vars(Cache)["update"])[:4] == ["self", "key_states", "value_states", "layer_idx"]
    assert "keys" not in vars(CacheLayerMixin) and "values" not in vars(CacheLayerMixin)
    cache = DynamicCache()
    cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)
    assert isinstance(vars(cache).get("layers"), list) and getattr(cache, "offloading", True) is False
    assert "keys" in vars(cache.layers[0]) and "values" in vars(cache.layers[0])
    trace = CacheTrace()
    uses: list[str] = []
    with cache_updates_traced(trace):
        keys, _ = cache.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), CacheIndex(0, nn.Module(), "i", uses=uses))
    assert keys.shape[2] == 4 and len(trace.updates) == 1 and not uses and not trace.uses


def probe_reuse_reads_watched() -> None:
    from nnbridge.extract.watched_attributes import reads_watched

    layer = nn.Linear(2, 2)
    layer.layer_idx = 3  # type: ignore[assignment]
    with reads_watched([(layer, "layer_idx")]) as reads:
        assert layer.layer_idx == 3
    assert reads == ["Linear.layer_idx"] and "layer_idx" not in vars(nn.Linear)


def probe_nnsight_request_pickler() -> None:
    from nnsight.intervention import serialization

    pickler = serialization.CustomCloudPickler
    assert _parameters(pickler.reducer_override) == ["self", "obj"]
    assert pickle.loads(pickler_dumps(pickler, [1, "a"])) == [1, "a"]


def probe_cache_context_classes() -> None:
    from transformers.cache_utils import DynamicCache
    from transformers.exporters import exporter_dynamo

    path_to_class = getattr(exporter_dynamo._path_to_class, "__nnbridge_original__", exporter_dynamo._path_to_class)
    assert _parameters(path_to_class) == ["path"]
    assert path_to_class(exporter_dynamo._class_to_path(DynamicCache)) is DynamicCache


def probe_envoy_missing_attribute_hint() -> None:
    import nnsight

    getattr_ = vars(nnsight.Envoy)["__getattr__"]
    original = getattr(getattr_, "__nnbridge_original__", getattr_)
    assert _parameters(original) == ["self", "name"]
    envoy = nnsight.NNsight(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(AttributeError, match="has attribute 'nothing_here'"):
        original(envoy, "nothing_here")


def pickler_dumps(pickler: type, value: Any) -> bytes:
    stream = io.BytesIO()
    pickler(stream).dump(value)
    return stream.getvalue()


def probe_nnsight_bridged_state() -> None:
    from nnsight.intervention.source import State

    from nnbridge.compat.nnsight import source as nnsight_source

    assert {"body", "sourced", "routes"} <= set(State.__slots__)
    assert type(vars(State)["body"]).__name__ == "member_descriptor" and callable(State.active)
    model = nnbridge.NNsight(nn.Sequential(nn.Linear(2, 2)))
    module = model._module[0] if hasattr(model._module, "__getitem__") else model._module
    state = module.__dict__.get(nnsight_source.NNSIGHT_STATE)
    if state is None:
        pytest.skip("nnsight wraps this module lazily")
    previous = nnsight_source.install(module, lambda m, *a, **k: "bridged")
    assert type(state) is nnsight_source.BridgedState and state.body(module, 1) == "bridged"
    nnsight_source.uninstall(module, previous)
    assert type(state) is State


#: patches installed for the rest of the process once used
PROCESS_WIDE = frozenset({"nnsight_request_pickler", "cache_context_classes", "envoy_missing_attribute_hint"})


def _in_place() -> dict[tuple[int, str], list[str]]:
    """The patches in place now, less those installed for the rest of the process once used."""
    return {key: names for key, names in registry.places().items() if not set(names) <= PROCESS_WIDE}


PROBES = {name[len("probe_"):]: function for name, function in dict(globals()).items() if name.startswith("probe_")}


def test_every_patch_has_a_probe_and_a_reason():
    assert sorted(PROBES) == sorted(registry.BY_NAME), "one probe per registered patch"
    for patch in registry.PATCHES:
        assert patch.kind in ("correctness", "speed") and patch.why.endswith(".") and patch.target
        assert patch.library is None or patch.verified


@pytest.mark.parametrize("name", [patch.name for patch in registry.PATCHES])
def test_probe(name):
    """The patched code still has the signature and behaviour ``name`` assumes, on this torch."""
    PROBES[name]()
    assert not _in_place(), "every probe's patches are put back"


# -- the registry knows every patch ----------------------------------------------------------------

def test_no_unregistered_patch_in_the_sources():
    found = scan_tree(REPO / "nnbridge", registry.BY_NAME)
    assert not found, "patches of torch/transformers/nnsight outside the registry:\n" + "\n".join(map(str, found))


PLANTED = '''
import importlib
import sys
import torch
import torch.fx.graph_module as fx
from transformers.cache_utils import Cache
from nnsight.intervention import serialization

_unflatten = sys.modules["torch.export.unflatten"]


def planted():
    torch.Tensor.data = property(lambda self: self)                      # planted: attribute of a torch class
    setattr(torch.autograd.Function, "apply", classmethod(lambda c: 0))    # planted: setattr
    trace = importlib.import_module("torch.export._trace")
    trace.make_fake_inputs = None                                         # planted: module from import_module
    function = torch.compiler.is_compiling
    function.__code__ = (lambda: True).__code__                           # planted: __code__ swap
    Cache.update = lambda *a: None                                        # planted: transformers class
    serialization.CustomCloudPickler.reducer_override = None              # planted: nnsight
    for cls in (_unflatten.InterpreterModule,):
        setattr(cls, "finalize", None)                                    # planted: loop over foreign classes
    fx.__dict__["_exec_with_source"] = None                               # planted: module __dict__ entry
    del torch._C._set_grad_enabled                                        # planted: deletion
    import torch._dynamo.config as config
    with config.patch(fake_tensor_cache_enabled=False):                   # planted: config switch, no pragma
        pass


def innocent(module, exported):
    module.weight = None          # not a library object
    exported._state_dict = {}     # an instance nnbridge owns
    with torch.no_grad():
        pass
    config = importlib.import_module("torch._dynamo.config")
    with config.patch(fake_tensor_cache_enabled=False):  # registry: fake_tensor_cache_off
        pass
'''


def test_scan_finds_planted_patches(tmp_path):
    """The scan, shown failing: a module with one patch on each line marked "planted", none in ``innocent``."""
    path = tmp_path / "planted.py"
    path.write_text(PLANTED)
    found = scan_source(path.read_text(), str(path), registry.BY_NAME)
    planted = [number for number, line in enumerate(PLANTED.splitlines(), 1) if "# planted" in line]
    assert len(planted) == 10 and sorted({f.line for f in found}) == planted, "\n".join(map(str, found))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(PLANTED)
    assert scan_tree(tmp_path / "pkg", registry.BY_NAME), "scan_tree reports them too"
    registered_pragma = PLANTED.replace("# registry: fake_tensor_cache_off", "# registry: no_such_patch")
    assert len(scan_source(registered_pragma, "x.py", registry.BY_NAME)) == len(found) + 1, \
        "a pragma must name a registered patch"


def _foreign_modules() -> list[types.ModuleType]:
    return [module for name, module in list(sys.modules.items())
            if type(module) is types.ModuleType and name.split(".")[0] in ("torch", "transformers", "nnsight")]


def _snapshot() -> dict[tuple[int, str], Any]:
    """``{(id(owner), attribute): value}`` of the callables and descriptors in every loaded
    torch/transformers/nnsight module and class defined there, and ``(id(function), "__code__")``
    of their functions; the owners themselves under ``(0, "owners")`` (held, so that their ids are
    not reused while the snapshot is compared)."""
    found: dict[tuple[int, str], Any] = {}
    owners: dict[int, Any] = {}

    def add(owner: Any, namespace: dict[str, Any]) -> None:
        owners[id(owner)] = owner
        for name, value in list(namespace.items()):
            kind = type(value)  # (not isinstance: some objects warn when their __class__ is read)
            if issubclass(kind, (types.ModuleType, str, int, float, bool, type(None))):
                continue
            if callable(value) or hasattr(kind, "__get__"):
                found[(id(owner), name)] = value
            if kind is types.FunctionType:
                owners[id(value)] = value
                found[(id(value), "__code__")] = value.__code__

    for module in _foreign_modules():
        namespace = vars(module)
        add(module, namespace)
        for value in list(namespace.values()):
            if issubclass(type(value), type) and id(value) not in owners and str(
                    vars(value).get("__module__", "")).split(".")[0] in ("torch", "transformers", "nnsight"):
                add(value, dict(vars(value)))
    found[(0, "owners")] = owners
    return found


_ABSENT = object()
#: what the spy records (outside the module: nnbridge puts a module's attributes back after its own runs)
class _SpyState:
    """What the spy records, kept in slots: a global dict of it would be read item by item by the
    code walk, and the spy's writes into it would make the spy run eagerly, never exported."""

    __slots__ = ("baseline", "changed", "plant")

    def __init__(self) -> None:
        self.update(baseline={}, changed={}, plant=None)

    def update(self, **values: Any) -> None:
        for name, value in values.items():
            setattr(self, name, value)


_SPY = _SpyState()


class _Spy(nn.Module):
    """Records, each time it runs, the attributes that differ from ``_SPY.baseline``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _SPY.plant is not None:
            _SPY.plant()
        baseline, changed = _SPY.baseline, _SPY.changed
        if baseline:
            now = _snapshot()
            in_place = registry.places()
            owners = baseline[(0, "owners")]
            # replaced, removed, or added to a module or class seen before; a code object only replaced
            for key in now.keys() | baseline.keys():
                if key[0] in owners and baseline.get(key, _ABSENT) is not now.get(key, _ABSENT) and (
                        key[1] != "__code__" or (key in baseline and key in now)):
                    changed.setdefault(key, set()).update(in_place.get(key, ["<unregistered>"]))
        return self.lin(x).relu()


def _changes_while(run: Any, plant: Any = None) -> dict[tuple[int, str], set[str]]:
    _SPY.update(baseline=_snapshot(), changed={}, plant=plant)
    try:
        run()
        return _SPY.changed
    finally:
        _SPY.update(baseline={}, changed={}, plant=None)


def _unregistered(plant: Any = None, seen: set[str] | None = None) -> dict[tuple[int, str], set[str]]:
    """Attributes changed while nnbridge extracts a spy (eager checks and export), that the registry
    did not put in place and that plain ``torch.export`` does not change either (``seen`` gets the
    names of the registered patches seen in place)."""
    x = torch.ones(2, 4)
    # a first extraction in the process sets torch's lazily made module globals
    # (``torch._opaque_base._FakeScriptObject_cls``), which plain export may not reach
    nnbridge.PatchableGraph(_Spy(), x)(x)
    torch_own = _changes_while(lambda: torch.export.export(_Spy(), (x,), strict=False))
    spy = _Spy()
    ours = _changes_while(lambda: nnbridge.PatchableGraph(spy, x)(x), plant)
    for names in ours.values():
        (seen if seen is not None else set()).update(names)
    return {key: names for key, names in ours.items() if "<unregistered>" in names and key not in torch_own}


@pytest.mark.no_extraction_cache  # each extracts: export runs
def test_no_unregistered_patch_while_extracting():
    seen: set[str] = set()
    unregistered = _unregistered(seen=seen)
    assert not unregistered, unregistered
    assert {"autograd_function_apply", "set_grad_enabled", "graph_break", "compile_queries", "string_arguments",
            "tracepoint_bookkeeping"} <= seen, f"the spy sees the registered patches in place: {sorted(seen)}"


@pytest.mark.no_extraction_cache  # each extracts: export runs
def test_spy_finds_a_planted_patch():
    """The run-time check, shown failing: a raw replacement of a torch function during extraction."""
    original = torch.nn.functional.gelu

    def plant() -> None:
        torch.nn.functional.gelu = lambda *args, **kwargs: original(*args, **kwargs)

    try:
        unregistered = _unregistered(plant)
    finally:
        torch.nn.functional.gelu = original
    assert (id(torch.nn.functional), "gelu") in unregistered


@pytest.mark.no_extraction_cache  # each extracts: export runs
def test_patched_attributes_are_put_back():
    """Every attribute the registry replaced so far in this process is back to what it was."""
    model = gpt2()
    ids = torch.tensor([[1, 2, 3, 4]])
    nnbridge.PatchableGraph(model, ids)(ids)
    _round_trip()
    assert registry.touched(), "the extraction patched"
    assert not _in_place()
    for owner, attribute, original in registry.touched():
        current = owner.__code__ if attribute == "__code__" else vars(owner).get(attribute, registry.MISSING)
        if set(registry.places().get((id(owner), attribute), ())) <= PROCESS_WIDE and \
                registry.places().get((id(owner), attribute)):
            continue  # installed for the process (see PROCESS_WIDE)
        assert current is original, (owner, attribute)


# -- version gates ---------------------------------------------------------------------------------

def test_installed_versions_are_verified():
    assert all(registry.unverified(patch) is None for patch in registry.PATCHES), registry.describe()
    assert TORCH in registry.BY_NAME["tensor_data"].verified


@pytest.mark.no_extraction_cache  # each extracts: export runs
def test_unknown_torch_speed_patches_skipped_graph_still_equals_eager():
    """As on a torch where only the correctness patches were verified: every speed patch on torch is
    skipped (torch's own code runs), and a tiny GPT-2 through PatchableGraph equals eager."""
    speed = [patch.name for patch in registry.PATCHES if patch.kind == "speed" and patch.library == "torch"]
    seen: set[str] = set()
    original_install = registry.install

    def install(name: str, *args: Any, **kwargs: Any) -> Any:
        seen.add(name)
        return original_install(name, *args, **kwargs)

    model, ids = gpt2(), torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        expected = model(ids).logits
    with registry.assumed("torch", "2.99", kinds=["speed"]), pytest.MonkeyPatch.context() as patching:
        patching.setattr(registry, "install", install)
        pg = nnbridge.PatchableGraph(model, ids)
        with torch.no_grad():
            actual = pg(ids).logits
        for name in speed:
            assert registry.status(name).startswith("skipped: torch 2.99 (assumed)"), registry.status(name)
        skipped = registry.skipped()
    assert torch.equal(actual, expected)
    assert not seen & set(speed), f"speed patches applied on an unverified torch: {seen & set(speed)}"
    assert {"tracepoint_bookkeeping", "unbacked_bindings", "fake_tensor_cache_off"} <= skipped.keys()
    assert "autograd_function_apply" in seen, "correctness patches still run"
    assert registry.status("tracepoint_bookkeeping") == "ready", "the assumption ends with its block"


@pytest.mark.no_extraction_cache  # each extracts: export runs
def test_unknown_torch_cache_and_reuse_still_equal_eager():
    """The same for a tiny Llama with its cache and layer reuse, transformers' speed patches skipped too."""
    model, ids = llama(), torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        expected = model(ids).logits
    with registry.assumed("torch", "2.99", kinds=["speed"]), \
            registry.assumed("transformers", "5.99", kinds=["speed"]):
        bridged = copy.deepcopy(model)
        nnbridge.bridge(bridged, ids)
        with torch.no_grad():
            actual = bridged(ids).logits
    assert torch.equal(actual, expected)


def _verified(name: str) -> str:
    """The versions patch ``name`` was verified on, as the gates' messages list them (``"2.13, 2.14"``)."""
    return ", ".join(sorted(registry.BY_NAME[name].verified, key=registry.version_key))


def test_correctness_patch_refuses_at_use():
    from nnbridge.compat.torch.capture import graph_break_calls

    with registry.assumed("torch", "2.99"), pytest.raises(NNBridgeError) as raised:
        with graph_break_calls(lambda msg: None):
            pass
    message = str(raised.value)
    assert "'graph_break'" in message and "torch 2.99 (assumed)" in message and _verified("graph_break") in message
    with pytest.raises(NNBridgeError, match="correctness patch"):
        with registry.disabled("tensor_data"):
            pass


@pytest.mark.integration  # end to end: a second process
def test_unknown_torch_refuses_at_import():
    """``import nnbridge`` on a torch outside the verified versions raises, naming each correctness
    patch, the version and the verified ones (a subprocess: the check runs once, at import)."""
    env = {**os.environ, "NNBRIDGE_ASSUME_TORCH": "2.99", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", "import nnbridge"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode != 0
    assert "nnbridge.errors.NNBridgeError" in result.stderr
    for patch in registry.PATCHES:
        if patch.library == "torch":
            assert (patch.name in result.stderr) == (patch.kind == "correctness"), patch.name
    assert f"torch 2.99 (assumed) is not among the verified {_verified('graph_break')}" in result.stderr


def test_disabled_speed_patch_is_skipped_and_said():
    with registry.disabled("duck_sizing"):
        assert not registry.enabled("duck_sizing")
        assert registry.status("duck_sizing").startswith("skipped: disabled")
    assert registry.enabled("duck_sizing") and registry.status("duck_sizing") == "ready"


def test_describe_lists_every_patch():
    text = registry.describe()
    for patch in registry.PATCHES:
        assert patch.name in text and patch.target in text
    table = registry.table_markdown()
    assert table.count("\n") == len(registry.PATCHES) + 1


def test_docs_table_is_the_registry():
    """docs/compat.md holds the table :func:`registry.table_markdown` prints."""
    assert registry.table_markdown() in (REPO / "docs" / "compat.md").read_text()


def test_source_of_the_planted_module_is_valid_python():
    compile(textwrap.dedent(PLANTED), "planted.py", "exec")


@pytest.mark.integration  # end to end: second processes
def test_doctor_reports_on_an_unknown_torch_where_import_refuses():
    """``nnbridge doctor`` is the tool for a torch outside the verified versions: it prints the
    report (torch's version as assumed, every correctness patch refused, every speed patch skipped)
    and the refusal, and exits 1; ``import nnbridge`` in any other process still refuses."""
    env = {**os.environ, "NNBRIDGE_ASSUME_TORCH": "2.99", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "nnbridge", "doctor"], capture_output=True, text=True, env=env,
                            timeout=300, cwd=REPO.parent)
    assert result.returncode == 1, result.stderr
    assert "torch         2.99 (assumed: $NNBRIDGE_ASSUME_TORCH" in result.stdout
    assert "NO, outside the tested range" in result.stdout
    for patch in registry.PATCHES:
        if patch.library == "torch":
            kind = "refused" if patch.kind == "correctness" else "skipped"
            assert any(line.startswith(f"  {patch.name} ") and f"{kind}: torch 2.99 (assumed)" in line
                       for line in result.stdout.splitlines()), patch.name
    assert result.stderr.startswith("nnbridge: error: nnbridge's correctness patches were not verified")
    other = subprocess.run([sys.executable, "-c", "import nnbridge", "doctor"], capture_output=True, text=True,
                           env=env, timeout=300)
    assert other.returncode != 0 and "NNBridgeError" in other.stderr
