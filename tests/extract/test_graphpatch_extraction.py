"""graphpatch parity of extraction (issue 11): module reuse, aliases, fallbacks, unused submodules,
graph breaks and registration order, each compared with the untouched eager model."""

import pytest
import torch
from torch._dynamo import graph_break
from torch.fx import Graph
from torch.nn import Linear, Module, ModuleList, Parameter

import nnbridge
from nnbridge import (CompiledGraphModule, ExtractionError, ExtractionOptions, MultiplyInvokedModule,
                      NNBridgeWarning, OpaqueGraphModule, PatchableGraph, ZeroPatch)
from utils import falls_back

STRICT = ExtractionOptions(error_on_compilation_failure=True)


def bridged_output(model, x, **options):
    """``model(x)`` through :func:`nnbridge.bridge` (the model is unbridged afterwards)."""
    nnbridge.bridge(model, x, options=ExtractionOptions(**options))
    try:
        return model(x)
    finally:
        nnbridge.unbridge(model)


# -- 1. a reused module that calls its own child twice ---------------------------------------------
class TwiceLinear(Module):
    def __init__(self):
        super().__init__()
        self.c_linear = Linear(4, 4)

    def forward(self, x):
        return self.c_linear(self.c_linear(x))


class Reused(Module):
    def __init__(self):
        super().__init__()
        self.c = TwiceLinear()

    def forward(self, x):
        return self.c(self.c(x))


class ReusedInList(Module):
    def __init__(self):
        super().__init__()
        self.layers = ModuleList([TwiceLinear(), TwiceLinear()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(layer(x))
        return x


@pytest.mark.parametrize("cls, prefixes", [(Reused, ["c_0", "c_1"]),
                                           (ReusedInList, ["layers_0_0", "layers_0_1", "layers_1_0", "layers_1_1"])])
def test_reused_module_calling_its_child_twice(cls, prefixes):
    """Before: ``RuntimeError: Node c_linear_2 target c_linear references nonexistent attribute``
    (``AttributeError: ... 'c_linear@2'`` in a ModuleList). Every invocation is its own graph,
    named as graphpatch names repeated invocations (``c_0.c_linear_1``)."""
    model, x = cls().eval(), torch.randn(2, 4)
    pg = PatchableGraph(model, x, options=STRICT)
    assert torch.equal(pg(x), model(x))
    paths = set(pg.node_paths())
    for prefix in prefixes:
        assert {f"{prefix}.c_linear_0.linear", f"{prefix}.c_linear_1.linear"} <= paths
    last = prefixes[-1]
    with pg.patch({f"{last}.c_linear_0.output": ZeroPatch()}):
        patched = pg(x)
    last_layer = model.c if cls is Reused else model.layers[1]
    assert torch.equal(patched, last_layer.c_linear(torch.zeros(2, 4)))
    assert torch.equal(pg(x), model(x))
    expected = model(x)
    assert torch.equal(bridged_output(model, x, error_on_compilation_failure=True), expected)


def failing_postprocess(graph_module, module):
    if isinstance(module, TwiceLinear):
        raise RuntimeError("simulated build failure")


def test_failure_while_building_a_graph_falls_back_to_opaque():
    """Any exception while building a graph module makes that module opaque (as graphpatch), or
    raises an ExtractionError naming it under error_on_compilation_failure."""
    model, x = Reused().eval(), torch.randn(2, 4)
    with falls_back("c"):
        pg = PatchableGraph(model, x, options=ExtractionOptions(postprocessing_function=failing_postprocess))
    assert isinstance(pg._graph_module, CompiledGraphModule)
    assert all(isinstance(c, OpaqueGraphModule) for c in pg._graph_module.c)
    assert "simulated build failure" in pg.extractions[0].opaque["c"]
    assert torch.equal(pg(x), model(x))
    with pytest.raises(ExtractionError, match="module 'c' \\(TwiceLinear\\).*simulated build failure"):
        PatchableGraph(model, x, options=ExtractionOptions(postprocessing_function=failing_postprocess,
                                                           error_on_compilation_failure=True))


# -- 2. a module registered under two names ---------------------------------------------------------
class Aliased(Module):
    def __init__(self):
        super().__init__()
        self.linear = Linear(4, 4)
        self.alias = self.linear

    def forward(self, x):
        return self.alias(self.linear(x))


def test_module_registered_under_two_names():
    """Before: ``KeyError: 'linear'``. Both calls are graphs (export names a module by its first
    registered name, so both are ``linear_k``)."""
    model, x = Aliased().eval(), torch.randn(2, 4)
    pg = PatchableGraph(model, x, options=STRICT)
    assert torch.equal(pg(x), model(x))
    assert {"linear_0.linear", "linear_1.linear"} <= set(pg.node_paths())
    with pg.patch({"linear_1.output": ZeroPatch()}):
        assert torch.equal(pg(x), torch.zeros(2, 4))
    expected = model(x)
    assert torch.equal(bridged_output(model, x, error_on_compilation_failure=True), expected)


# -- 3. a failing custom extraction function --------------------------------------------------------
class Holder(Module):
    def __init__(self):
        super().__init__()
        self.linear = Linear(4, 4)

    def forward(self, x):
        return self.linear(x) * 2


def simulate_extraction_failure(module) -> Graph:
    raise RuntimeError("simulated failure")


def test_failing_custom_extraction_function_falls_back_to_opaque():
    model, x = Holder().eval(), torch.randn(2, 4)
    custom = {Linear: simulate_extraction_failure}
    with falls_back("linear"):  # one warning, its table (graphpatch's per-module warning is off)
        pg = PatchableGraph(model, x, options=ExtractionOptions(custom_extraction_functions=custom))
    assert isinstance(pg._graph_module, CompiledGraphModule)
    assert isinstance(pg._graph_module.linear, OpaqueGraphModule)
    assert "simulated failure" in pg._graph_module.linear.reason
    assert torch.equal(pg(x), model(x))
    with pytest.warns(NNBridgeWarning, match="simulated failure"):
        PatchableGraph(model, x, options=ExtractionOptions(custom_extraction_functions=custom,
                                                           warn_on_compilation_failure=True))
    with pytest.raises(ExtractionError, match="module 'linear' \\(Linear\\).*simulated failure") as info:
        PatchableGraph(model, x, options=ExtractionOptions(custom_extraction_functions=custom,
                                                           error_on_compilation_failure=True))
    assert "simulated failure" in str(info.value.__cause__)
    # the root's own function failing: the root is opaque, its children still graphs
    with falls_back("<root>"):
        pg = PatchableGraph(model, x, options=ExtractionOptions(custom_extraction_functions={Holder: simulate_extraction_failure}))
    assert isinstance(pg._graph_module, OpaqueGraphModule)
    assert isinstance(pg._graph_module.linear, CompiledGraphModule)
    assert torch.equal(pg(x), model(x))


# -- 4. unused submodules are kept ------------------------------------------------------------------
class SkipsOne(Module):
    def __init__(self):
        super().__init__()
        self.layers = ModuleList([Linear(4, 4) for _ in range(3)])
        self.spare = TwiceLinear()

    def forward(self, x):
        return self.layers[2](self.layers[0](x))


def test_unused_submodules_are_kept_by_default():
    """graphpatch's default: allow_unused_submodules unless error_on_compilation_failure. Unused
    modules (also ModuleList entries, also their children) stay, as opaque modules, so the
    graphs' parameters and state_dict are the module's."""
    assert ExtractionOptions().allow_unused_submodules is True
    assert STRICT.allow_unused_submodules is False
    assert ExtractionOptions(error_on_compilation_failure=True, allow_unused_submodules=True).allow_unused_submodules
    model, x = SkipsOne().eval(), torch.randn(2, 4)
    for options in (ExtractionOptions(), ExtractionOptions(allow_unused_submodules=True, error_on_compilation_failure=True)):
        pg = PatchableGraph(model, x, options=options)
        root = pg._graph_module
        assert list(root.layers._modules) == ["0", "1", "2"]
        assert isinstance(root.layers[1], OpaqueGraphModule) and root.layers[1].reason == "not invoked during extraction"
        assert isinstance(root.spare, OpaqueGraphModule) and isinstance(root.spare.c_linear, OpaqueGraphModule)
        assert [n for n, _ in root.named_parameters()] == [n for n, _ in model.named_parameters()]
        assert list(root.state_dict()) == list(model.state_dict())
        assert all(a is b for a, b in zip(root.parameters(), model.parameters()))
        assert torch.equal(pg(x), model(x))


def test_unused_submodule_in_strict_mode_names_it():
    model, x = SkipsOne().eval(), torch.randn(2, 4)
    with pytest.raises(ExtractionError, match="module 'layers.1' \\(Linear\\).*allow_unused_submodules=True"):
        PatchableGraph(model, x, options=STRICT)
    with pytest.warns(NNBridgeWarning, match="was never called") as record:
        PatchableGraph(model, x, options=ExtractionOptions(warn_on_compilation_failure=True))
    messages = sorted(str(w.message) for w in record)
    assert [m.split(";")[0] for m in messages] == ["Unable to compile layers.1", "Unable to compile spare"]
    assert all("; it was never called" in m for m in messages)  # graphpatch's sentence


# -- 5. torch._dynamo.graph_break() -----------------------------------------------------------------
class Breaks(Module):
    def __init__(self):
        super().__init__()
        self.linear = Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        graph_break()
        return y * 2 + 1


class HoldsBreaks(Module):
    def __init__(self):
        super().__init__()
        self.pre = Linear(4, 4)
        self.breaks = Breaks()

    def forward(self, x):
        return self.breaks(self.pre(x)) - 1


def test_graph_break_makes_its_module_opaque():
    model, x = HoldsBreaks().eval(), torch.randn(2, 4)
    with falls_back("breaks"):
        pg = PatchableGraph(model, x)
    root = pg._graph_module
    assert isinstance(root, CompiledGraphModule) and isinstance(root.pre, CompiledGraphModule)
    assert isinstance(root.breaks, OpaqueGraphModule) and "graph_break" in root.breaks.reason
    assert isinstance(root.breaks.linear, CompiledGraphModule)
    assert "graph_break" in pg.extractions[0].opaque["breaks"]
    assert torch.equal(pg(x), model(x))
    expected = model(x)
    with falls_back("breaks"):
        assert torch.equal(bridged_output(model, x), expected)
    with pytest.raises(ExtractionError, match="module 'breaks' \\(Breaks\\).*graph_break"):
        PatchableGraph(model, x, options=STRICT)
    with falls_back("<root>"):
        pg = PatchableGraph(Breaks().eval(), x)  # at the root
    assert isinstance(pg._graph_module, OpaqueGraphModule)
    assert isinstance(pg._graph_module.linear, CompiledGraphModule)


# -- 6. registration order --------------------------------------------------------------------------
class OutOfOrder(Module):
    def __init__(self):
        super().__init__()
        self.b = Parameter(torch.randn(4))
        self.a = Parameter(torch.randn(4))
        self.first = Linear(4, 4)
        self.layers = ModuleList([Linear(4, 4) for _ in range(3)])
        self.second = Linear(4, 4)
        self.register_buffer("late", torch.ones(4))
        self.register_buffer("early", torch.ones(4))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = layer(x)
        return self.first(self.second(x * self.a + self.early)) * self.b + self.late


def test_graph_children_keep_registration_order():
    """The forward calls children (and reads tensors) in another order than it registered them;
    the graphs keep the registration order (as graphpatch), so ``named_parameters()`` and
    ``state_dict()`` list them as the module does."""
    model, x = OutOfOrder().eval(), torch.randn(2, 4)
    pg = PatchableGraph(model, x, options=STRICT)
    root = pg._graph_module
    assert list(root._modules) == ["first", "layers", "second"]
    assert list(root.layers._modules) == ["0", "1", "2"]
    assert [n for n, _ in root.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(root.state_dict()) == list(model.state_dict())
    assert [n for n, _ in pg.named_parameters()] == [f"_graph_module.{n}" for n, _ in model.named_parameters()]
    assert torch.equal(pg(x), model(x))


# -- 1. (cont.) any failure while compiling falls back ---------------------------------------------------------------------------
class ShapeBranch(Module):
    def __init__(self):
        super().__init__()
        self.linear = Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        return -y if x.shape[0] == 1 else y  # each call's graph is specialised to its branch


class DiscardsACall(Module):
    def __init__(self):
        super().__init__()
        self.branch = ShapeBranch()

    def forward(self, x):
        self.branch(x[:1])  # result unused: dead code in the caller's graph
        return self.branch(x)


def test_a_call_whose_output_is_discarded_is_kept_in_the_callers_graph():
    """The first call's output is never read: it still runs, as in eager, with a graph of its own
    specialised to its branch (torch 2.13's unflatten would drop it, see
    ``nnbridge.compat.torch.export.unused_calls_kept``)."""
    model, x = DiscardsACall().eval(), torch.randn(2, 4)
    expected = model(x)
    pg = PatchableGraph(model, x, options=STRICT)
    assert isinstance(pg._graph_module, CompiledGraphModule)
    branch = pg._graph_module.branch  # called twice: one graph per invocation
    assert isinstance(branch, MultiplyInvokedModule) and all(isinstance(b, CompiledGraphModule) for b in branch)
    with pg.patch({"branch_0.output": [probe := nnbridge.ProbePatch()]}):
        assert torch.equal(pg(x), expected)
    with torch.no_grad():
        assert torch.equal(probe.activation, model.branch(x[:1]))
    assert torch.equal(bridged_output(model, x, error_on_compilation_failure=True), expected)


@pytest.mark.no_extraction_cache  # a cold export, whose unflatten fails
def test_failure_while_unflattening_falls_back_to_opaque(monkeypatch):
    """With torch's own dead-code pass (a program with effect tokens), unflatten fails on this
    program (``'Module' object has no attribute 'linear@1'``): the root runs its own code and its
    children are extracted per call; strict extraction raises naming the call."""
    from nnbridge.compat.torch import export as torch_export

    monkeypatch.setattr(torch_export, "_has_effect_tokens", lambda exported: True)
    model, x = DiscardsACall().eval(), torch.randn(2, 4)
    with falls_back("<root>"):
        pg = PatchableGraph(model, x)
    assert isinstance(pg._graph_module, OpaqueGraphModule)
    assert "building its graph failed" in pg.extractions[0].opaque["<root>"]
    branch = pg._graph_module.branch  # called twice: one graph per invocation, as compiled mode
    assert isinstance(branch, MultiplyInvokedModule) and all(isinstance(b, CompiledGraphModule) for b in branch)
    assert {"branch_0.output", "branch_1.output"} <= set(pg.graph.keys())
    assert torch.equal(pg(x), model(x))
    with pytest.raises(ExtractionError, match="module '<root>' \\(DiscardsACall\\).*linear@1"):
        PatchableGraph(model, x, options=STRICT)


class ReservedFirst(Module):
    def __init__(self):
        super().__init__()
        self.graph = Linear(4, 4)  # reserved: renamed graph_ while extracting
        self.alias = self.graph  # hidden while extracting
        self.other = Linear(4, 4)

    def forward(self, x):
        return self.other(self.alias(self.graph(x)))


def test_extraction_leaves_the_models_registration_order():
    """Renamed (reserved) and hidden (alias) children go back to their places: the model's
    ``_modules`` and ``state_dict()`` order are unchanged by extraction."""
    model, x = ReservedFirst().eval(), torch.randn(2, 4)
    keys = list(model.state_dict())
    pg = PatchableGraph(model, x, options=STRICT)
    assert list(model._modules) == ["graph", "alias", "other"] and list(model.state_dict()) == keys
    assert torch.equal(pg(x), model(x))
    expected = model(x)
    assert torch.equal(bridged_output(model, x), expected)
    assert list(model._modules) == ["graph", "alias", "other"] and list(model.state_dict()) == keys
