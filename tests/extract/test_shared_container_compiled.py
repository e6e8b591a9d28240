"""One module object under several names, container entries among them, extracted as graphs.

graphpatch's ContainerModule holds one Linear as ``self.linear``, ``self.duped_linear``,
``module_dict["foo"]``, ``module_dict["bar"]["baz"][0]`` and ``[1]`` and inside two Sequentials.
Each name the code calls it by is its own call in the graph and its own NodePath, as graphpatch
made them; a patch at one name changes only the calls through that name. A call passing a
stateful argument (a cache) keeps the owner of the container opaque, loudly under
``error_on_compilation_failure``.
"""

import copy

import pytest
import torch
from torch import nn
from transformers import DynamicCache

import nnbridge
from nnbridge import ExtractionError, ExtractionOptions, PatchableGraph, ProbePatch, ZeroPatch
from nnbridge.graph.graph_module import CompiledGraphModule, OpaqueGraphModule
from utils import assert_same_grads


class ContainerModule(nn.Module):
    """graphpatch's fixture of the same name (tests/fixtures/container_module.py)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.duped_linear = self.linear
        chained_linear = nn.Linear(3, 3)
        chained_sequential = nn.Sequential(self.duped_linear, self.linear)
        self.sequential = nn.Sequential(chained_linear, self.linear, chained_sequential, chained_linear)
        self.module_list = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
        self.module_dict = nn.ModuleDict(
            {"foo": self.linear, "bar": nn.ModuleDict({"baz": nn.ModuleList([self.linear, self.linear, self.sequential])})})

    def forward(self, x):
        y = self.duped_linear(x) - self.module_dict["foo"](x)
        for i in range(3):
            y += self.module_dict["bar"]["baz"][i](x) * self.linear(x)
        y += self.module_list[0](x)
        y += self.module_list[1](x)
        return self.sequential(y) + self.linear(y) + self.module_list[0](y)


def _made():
    torch.manual_seed(0)
    return ContainerModule()


def _input():
    torch.manual_seed(1)
    return torch.randn(3, 3)


#: the calls of the shared Linear in eager order, by the name each went through (graphpatch's NodePaths;
#: a Sequential's entries are ``sequential.1`` where graphpatch wrote ``sequential.sub_1``)
LINEAR_CALLS = ["duped_linear", "module_dict_foo", "module_dict_bar_baz_0", "linear_0", "module_dict_bar_baz_1",
                "linear_1", "module_dict_bar_baz_2.1", "module_dict_bar_baz_2.2.0", "module_dict_bar_baz_2.2.1", "linear_2",
                "sequential.1", "sequential.2.0", "sequential.2.1", "linear_3"]


def _zeroing_call(model: nn.Module, call: int) -> None:
    """Zero the output of the ``call``-th call (0-based) of ``model.linear``, as a patch there would."""
    seen = []

    def hook(module, args, output):
        seen.append(None)
        return torch.zeros_like(output) if len(seen) == call + 1 else output
    model.linear.register_forward_hook(hook)


def test_every_name_is_a_graph_of_its_own_and_the_output_equals_eager():
    x = _input()
    pg = PatchableGraph(_made(), x, options=ExtractionOptions(error_on_compilation_failure=True))
    assert torch.equal(pg(x), _made()(x))
    keys = set(pg.graph.keys())
    assert {f"{name}.output" for name in LINEAR_CALLS} <= keys
    assert {"module_list_0_0.output", "module_list_0_1.output", "module_list_1.output", "sub", "mul_2"} <= keys
    assert nnbridge.explain(pg).opaque == {}
    root = pg._graph_module
    assert isinstance(root, CompiledGraphModule)
    assert not any(isinstance(m, OpaqueGraphModule) for m in root.modules())


@pytest.mark.parametrize("call", [0, 1, 3, 7, 13])
def test_a_patch_at_one_name_changes_only_the_calls_through_that_name(call):
    x = _input()
    pg = PatchableGraph(_made(), x)
    reference = _made()
    _zeroing_call(reference, call)
    name = LINEAR_CALLS[call]
    others = [n for n in LINEAR_CALLS if n != name]
    probes = {n: ProbePatch() for n in others}
    with pg.patch({f"{name}.output": ZeroPatch(), **{f"{n}.output": [p] for n, p in probes.items()}}):
        patched = pg(x)
    assert torch.equal(patched, reference(x))
    assert not torch.equal(patched, _made()(x))
    assert all(not torch.equal(p.activation, torch.zeros(3, 3)) for p in probes.values())


def test_gradients_equal_eager_through_every_name():
    x = _input()
    model, reference = _made(), _made()
    expected = reference(x)
    expected.sum().backward()
    pg = PatchableGraph(model, x)
    out = pg(x)
    out.sum().backward()
    assert torch.equal(out, expected)
    assert_same_grads(model, reference)


def test_a_bridged_model_equals_eager_and_a_hook_on_one_call_only_changes_that_call():
    x = _input()
    model, reference = _made(), _made()
    nnbridge.bridge(model, x)
    assert torch.equal(model(x), _made()(x))
    out = model(x)
    out.sum().backward()
    expected = reference(x)
    expected.sum().backward()
    assert_same_grads(model, reference)
    # the bridged object's calls are its invocations, in call order, whatever name each went through
    point = model.get_submodule("linear.invocation_1.linear")
    handle = point.register_forward_hook(lambda module, args, output: torch.zeros_like(output))
    zeroed = _made()
    _zeroing_call(zeroed, 1)
    assert torch.equal(model(x), zeroed(x))
    handle.remove()
    assert torch.equal(nnbridge.unbridge(model)(x), _made()(x))


class Repeats(nn.Module):
    """``ModuleList([block, other, block])``, with the cache passed on when ``cached``."""

    def __init__(self):
        super().__init__()
        block = nn.Linear(4, 4)
        self.layers = nn.ModuleList([block, nn.Linear(4, 4), block])

    def forward(self, h, cache=None):
        if cache is not None:
            keys, _ = cache.update(h[None, None], h[None, None], 1)
            h = h + keys[0, 0, -h.shape[0]:]
        for layer in self.layers:
            h = torch.relu(layer(h))
        return h


class CachedOuter(nn.Module):
    """Writes a cache passed in (a stateful argument), and passes it on to ``stack`` when ``passed``."""

    def __init__(self, passed):
        super().__init__()
        self.passed = passed
        self.pre = nn.Linear(4, 4)
        self.stack = Repeats()

    def forward(self, x, cache):
        keys, _ = cache.update(x[None, None], x[None, None], 0)
        h = self.pre(x) + keys[0, 0, -x.shape[0]:]
        return (self.stack(h, cache) if self.passed else self.stack(h)) * 2


def _cached_made(passed):
    torch.manual_seed(0)
    return CachedOuter(passed).eval()


@pytest.mark.parametrize("passed", [False, True], ids=["owner-opaque", "caller-opaque"])
def test_with_a_stateful_argument_the_owner_runs_opaque_and_equals_eager(passed):
    """The owner of the container runs its code (when the cache is passed to it, its caller does:
    a module running its own code cannot hand the state it writes back to a graph); the children
    are still graphs, each entry its own invocation."""
    x = torch.randn(3, 4)
    model = _cached_made(passed)
    expected, expected_cache = _cached_made(passed)(x, cache := DynamicCache()), cache
    pg = PatchableGraph(model, x, DynamicCache())
    out = pg(x, cache := DynamicCache())
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(cache.layers[0].keys, expected_cache.layers[0].keys, strict=True))
    keys = set(pg.graph.keys())
    assert "stack.relu" not in keys, "the owner of the container runs its code"
    assert {"pre.output", "stack.layers_0.output", "stack.layers_2.output"} <= keys
    reasons = str(nnbridge.explain(pg))
    assert "'stack.layers.0' and 'stack.layers.2' are one module object, held in a ModuleList" in reasons, reasons
    if passed:
        assert isinstance(pg._graph_module, OpaqueGraphModule)
        assert "the call passes a stateful argument to '<root>', 'stack'" in reasons, reasons
        assert "'stack' is called with the stateful argument, so its caller '<root>' runs its code" in reasons
    else:
        assert "mul" in keys, "the root's own ops stay a graph"
        assert "the call passes a stateful argument to '<root>'" in reasons, reasons


@pytest.mark.parametrize("passed", [False, True], ids=["owner-opaque", "caller-opaque"])
def test_with_a_stateful_argument_the_error_option_names_the_module_the_cause_and_the_fix(passed):
    x = torch.randn(3, 4)
    model = _cached_made(passed)
    before = copy.deepcopy(model)
    with pytest.raises(ExtractionError) as raised:
        PatchableGraph(model, x, DynamicCache(), options=ExtractionOptions(error_on_compilation_failure=True))
    message = str(raised.value)
    assert f"module '{'<root>' if passed else 'stack'}'" in message, message
    assert "'stack.layers.0' and 'stack.layers.2' are one module object" in message
    assert "stateful argument" in message
    assert "Give each container entry its own module object" in message
    assert "docs/graphpatch.md, 'A ModuleList/ModuleDict holding one module object twice'" in message
    assert torch.equal(model(x, DynamicCache()), before(x, DynamicCache())), "nothing left half-extracted"
    assert list(dict(model.stack.layers.named_children())) == ["0", "1"] and len(model.stack.layers) == 3


class Branchy(nn.Module):
    """A forward export cannot trace (a branch on a tensor's value): it runs opaque."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) if x.sum() > 0 else -self.lin(x)


class SharedBranchy(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block
        self.layers = nn.ModuleList([block, nn.Linear(4, 4)])
        self.table = nn.ModuleDict({"again": block})

    def forward(self, x):
        h = self.block(x)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.table["again"](h) * 2


def _branchy(block_cls=Branchy):
    torch.manual_seed(0)
    return SharedBranchy(block_cls())


@pytest.mark.parametrize("how", ["export-failure", "classes_to_skip_compiling"])
def test_a_shared_module_that_runs_opaque_is_opaque_under_every_name(how):
    """An opaque stand-in replaces the module object, whichever name a call goes through: every
    name of it is opaque (a name left a graph would hold the stand-in's zeros)."""
    x = _input()[:, :3].repeat(1, 2)[:, :4]
    options = ExtractionOptions(classes_to_skip_compiling={Branchy}) if how != "export-failure" else ExtractionOptions()
    pg = PatchableGraph(_branchy(), x, options=options)
    assert torch.equal(pg(x), _branchy()(x))
    assert torch.equal(pg(-x), _branchy()(-x))
    root = pg._graph_module
    assert isinstance(root, CompiledGraphModule)
    assert all(isinstance(root.get_submodule(path), OpaqueGraphModule) for path in ("block", "layers.0", "table.again"))
    assert isinstance(root.get_submodule("layers.1"), CompiledGraphModule)
    assert "relu_1" in pg.graph.keys(), "the owner's own ops are a graph"


def test_lock_overrides_are_lifted_only_while_the_body_runs_and_put_back_after_an_error():
    from nnbridge.compat.torch.forwards import call_override
    from nnbridge.graph.locking import calls_unlocked, lock_calls, unlock_calls

    model = _made()
    installed = lock_calls(model.modules())
    overrides = {id(m): call_override(m) for m in model.modules()}
    assert all(o is not None for o in overrides.values())
    with pytest.raises(RuntimeError, match="inside"):
        with calls_unlocked(model.modules()):
            assert all(call_override(m) is None for m in model.modules())
            assert torch.equal(model(_input()), _made()(_input()))
            raise RuntimeError("inside")
    assert all(call_override(m) is overrides[id(m)] for m in model.modules())
    unlock_calls(installed)
    assert all(call_override(m) is None for m in model.modules())
