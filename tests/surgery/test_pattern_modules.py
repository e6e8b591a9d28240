"""replace_pattern(..., replacement_module=factory): a new module per match (LoRA injection),
against hand-written eager models with the same adapters."""

import copy

import pytest
import torch

import nnbridge
from nnbridge import PatternError, surgery
from pattern_models import LoraAdapter, ProjModel, linear_pattern, with_adapters


def lora(match):
    return LoraAdapter(match.modules["base"])


def bridged(x):
    model = ProjModel()
    eager = copy.deepcopy(model)
    nnbridge.bridge(model, x)
    return model, eager


def adapters_by_path(model, rewrite):
    """``{torch path of the wrapped linear: adapter}``."""
    paths = {id(m): name for name, m in model.named_modules()}
    return {paths[id(adapter.base)]: adapter for adapter in rewrite.modules.values()}


def run(model, x):
    model.zero_grad()
    out = model(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach()


def assert_same(model, reference, adapters, x):
    """Outputs and every gradient equal: the model's own parameters (under the reference's
    wrapping names) and the adapters'."""
    assert torch.equal(run(model, x), run(reference, x))
    wrapped = {f"{path}.": f"{path}.base." for path in adapters}
    theirs = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        if any(parameter is p for a in adapters.values() for p in (a.lora_a.weight, a.lora_b.weight)):
            continue
        prefix = next((p for p in wrapped if name.startswith(p)), None)
        other = theirs[wrapped[prefix] + name[len(prefix):]] if prefix else theirs[name]
        if parameter.grad is None or other.grad is None:  # a parameter this call does not use
            assert parameter.grad is None and other.grad is None, name
            continue
        assert torch.equal(parameter.grad, other.grad), name
    for path, adapter in adapters.items():
        for mine, other in ((adapter.lora_a, reference.get_submodule(path).lora_a),
                            (adapter.lora_b, reference.get_submodule(path).lora_b)):
            if mine.weight.grad is None or other.weight.grad is None:  # an adapter this call does not run
                assert mine.weight.grad is None and other.weight.grad is None, path
                continue
            assert torch.equal(mine.weight.grad, other.weight.grad), path


def test_an_adapter_per_linear_equals_hand_written_lora_and_trains_alike():
    x = torch.randn(2, 3, 8)
    model, eager = bridged(x)
    seen = []

    def factory(match):
        seen.append((match.graph, match.anchor, match.inputs, tuple(match.shapes["x"])))
        return lora(match)

    torch.manual_seed(5)
    rewrite = surgery.replace_pattern(model, linear_pattern, replacement_module=factory, scope="blocks_*")
    assert rewrite.matches == ["blocks_0.q", "blocks_0.o", "blocks_1.q", "blocks_1.o"]
    assert seen[0] == ("blocks_0", "blocks_0.q", ("x",), (2, 3, 8))
    assert list(rewrite.modules) == ["blocks_0.lora_adapter", "blocks_0.lora_adapter_1", "blocks_1.lora_adapter",
                                     "blocks_1.lora_adapter_1"]
    assert surgery.edits(model) == [rewrite]
    adapters = adapters_by_path(model, rewrite)
    assert sorted(adapters) == ["blocks.0.o", "blocks.0.q", "blocks.1.o", "blocks.1.q"]
    params = list(model.parameters())
    for adapter in adapters.values():
        assert any(p is adapter.lora_a.weight for p in params) and any(p is adapter.lora_b.weight for p in params)
    assert "blocks.0.lora_adapter.lora_b.weight" in model.state_dict()
    reference = with_adapters(eager, adapters)
    assert_same(model, reference, adapters, x)
    # the adapter is extracted itself (on the call after the edit): its ops are op points below the new node
    assert type(model.get_submodule("blocks.0.lora_adapter.lora_a.linear")).__name__ == "OpPoint"
    # one Adam step on the adapters' parameters on both sides keeps the models equal
    ours = torch.optim.Adam([p for a in adapters.values() for p in (a.lora_a.weight, a.lora_b.weight)], lr=0.1)
    theirs = torch.optim.Adam([p for path in adapters for p in (reference.get_submodule(path).lora_a.weight,
                                                               reference.get_submodule(path).lora_b.weight)], lr=0.1)
    ours.step()
    theirs.step()
    assert_same(model, reference, adapters, x)
    rewrite.remove()
    assert surgery.edits(model) == [] and rewrite.modules
    assert not any("lora" in name for name, _ in model.named_modules())
    assert len(list(model.parameters())) == len(list(eager.parameters()))
    with torch.no_grad():
        assert torch.equal(model(x), eager(x))
    assert type(model.get_submodule("blocks.0.q.linear")).__name__ == "OpPoint"  # the linears stay bridged


def test_the_adapters_survive_re_extraction():
    x = torch.randn(2, 3, 8)
    model, eager = bridged(x)
    torch.manual_seed(5)
    with surgery.replace_pattern(model, linear_pattern, replacement_module=lora, scope="blocks_*") as rewrite:
        adapters = adapters_by_path(model, rewrite)
        reference = with_adapters(eager, adapters)
        for other in (torch.randn(1, 7, 8), torch.randn(4, 8)):  # another sequence length, another rank
            assert_same(model, reference, adapters, other)
        model.train()
        reference.train()
        assert_same(model, reference, adapters, x)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), eager(x))


def test_a_patchable_graph_knows_the_models_own_input():
    x = torch.randn(2, 8)
    model = ProjModel()
    eager = copy.deepcopy(model)
    pg = nnbridge.PatchableGraph(model, x)
    torch.manual_seed(5)
    rewrite = surgery.replace_pattern(pg, linear_pattern, replacement_module=lora, scope="*")
    assert rewrite.matches[0] == "embed"  # its input is the model's input x
    reference = with_adapters(eager, adapters_by_path(model, rewrite))
    with torch.no_grad():
        assert torch.equal(pg(x), reference(x))
    rewrite.remove()
    with torch.no_grad():
        assert torch.equal(pg(x), eager(x))


class Narrow(torch.nn.Module):
    def __init__(self, base):
        super().__init__()
        self.proj = torch.nn.Linear(base.in_features, 4)

    def forward(self, x):
        return self.proj(x)


def raising(match):
    raise ValueError("no adapter for this one")


def not_a_module(match):
    return lambda x: x


shared = LoraAdapter(torch.nn.Linear(8, 8))


@pytest.mark.parametrize("factory, message", [
    (raising, r"factory raising raised for the match at blocks_0.q: ValueError: no adapter.*Nothing was edited"),
    (not_a_module, r"returned function for the match at blocks_0.q, not an nn.Module.*forward takes \['x'\]"),
    (lambda match: Narrow(match.modules["base"]),
     r"Narrow at blocks_0.q returns \(2, 3, 4\) float32 on cpu where the graph expects \(2, 3, 8\) float32"),
    (lambda match: shared, r"already part of the model or was returned for another match; return a new instance"),
])
def test_a_refused_module_edits_nothing(factory, message):
    x = torch.randn(2, 3, 8)
    model, eager = bridged(x)
    names = [name for name, _ in model.named_modules()]
    with pytest.raises(PatternError, match=message):
        surgery.replace_pattern(model, linear_pattern, replacement_module=factory, scope="blocks_*")
    assert surgery.edits(model) == []
    assert [name for name, _ in model.named_modules()] == names
    with torch.no_grad():
        assert torch.equal(model(x), eager(x))


def test_a_bridged_models_own_input_is_known():
    x = torch.randn(2, 8)
    model, eager = bridged(x)
    torch.manual_seed(5)
    rewrite = surgery.replace_pattern(model, linear_pattern, replacement_module=lora, scope="*")
    assert rewrite.matches[0] == "embed"
    reference = with_adapters(eager, adapters_by_path(model, rewrite))
    assert_same(model, reference, adapters_by_path(model, rewrite), x)


class ScaledBySequence(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x * x.shape[1])


def scaled(x, n):
    return x * n


def test_an_input_that_is_no_tensor_is_refused():
    x = torch.randn(2, 3, 8)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), ScaledBySequence())
    eager = copy.deepcopy(model)
    nnbridge.bridge(model, x)
    with pytest.raises(PatternError, match=r"the pattern's input n is 1.sym_size at 1.mul, whose value is a"
                                           r" SymInt; a replacement_module takes tensors of known size"):
        surgery.replace_pattern(model, scaled, replacement_module=lambda match: torch.nn.Identity())
    assert surgery.edits(model) == []
    with torch.no_grad():
        assert torch.equal(model(x), eager(x))


@pytest.mark.parametrize("kwargs, message", [
    ({}, r"exactly one of replacement \(a function\) and replacement_module.*got neither"),
    ({"replacement": lambda x, base: base(x), "replacement_module": lora}, r"exactly one of.*got both"),
    ({"replacement_module": LoraAdapter(torch.nn.Linear(8, 8))}, r"replacement_module must be a function making a"),
])
def test_replacement_and_replacement_module_are_exclusive(kwargs, message):
    x = torch.randn(2, 8)
    model, _ = bridged(x)
    with pytest.raises(PatternError, match=message):
        surgery.replace_pattern(model, linear_pattern, **kwargs)
    assert surgery.edits(model) == []


class GrowingBlock(torch.nn.Module):
    """``o`` runs only on batches of more than 2: an extraction for such a batch has a match of
    ``linear_pattern`` that a batch of 2's extraction lacks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.o = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        y = x + self.q(x)
        if x.shape[0] > 2:
            y = y + self.o(y)
        return y


def test_a_match_only_a_later_extraction_has_raises_until_replace_pattern_sees_it():
    small, large = torch.randn(2, 8), torch.randn(4, 8)
    model = GrowingBlock()
    eager = copy.deepcopy(model)
    nnbridge.bridge(model, small)
    torch.manual_seed(5)
    rewrite = surgery.replace_pattern(model, linear_pattern, replacement_module=lora)
    assert rewrite.matches == ["q"]
    assert surgery.edits(model) == [rewrite]
    with pytest.raises(PatternError, match=r"replace_pattern\(linear_pattern, replacement_module=...\): the extraction"
                                           r" of '<root>' made now \(extracted for: .*\) has a match at o that the"
                                           r" rewrite made no module for.*Remove the rewrite.*run this call once, then"
                                           r" call replace_pattern again"):
        model(large)
    reference = with_adapters(eager, adapters_by_path(model, rewrite))
    assert_same(model, reference, adapters_by_path(model, rewrite), small)  # the first extraction still serves
    rewrite.remove()
    with torch.no_grad():
        assert torch.equal(model(large), eager(large))
    torch.manual_seed(5)
    again = surgery.replace_pattern(model, linear_pattern, replacement_module=lora)
    assert sorted(again.matches) == ["o", "q"]
    adapters = adapters_by_path(model, again)
    reference = with_adapters(eager, adapters)
    for x in (small, large):
        assert_same(model, reference, adapters, x)
    again.remove()
    assert surgery.edits(model) == []


class ShiftingBlock(torch.nn.Module):
    """On batches of more than 2, ``relu(o(x))`` comes first and takes the node name ``relu`` that
    ``relu(q(x))`` has on smaller batches."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.o = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[0] > 2:
            x = x + torch.relu(self.o(x))
        return x + torch.relu(self.q(x))


def relu_pattern(x, base: torch.nn.Linear):
    return torch.relu(base(x))


class Doubled(torch.nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base = base

    def forward(self, x):
        return torch.relu(self.base(x)) * 2


def test_a_later_extraction_whose_anchor_binds_other_modules_raises():
    small, large = torch.randn(2, 8), torch.randn(4, 8)
    model = ShiftingBlock()
    eager = copy.deepcopy(model)
    nnbridge.bridge(model, small)
    rewrite = surgery.replace_pattern(model, relu_pattern, replacement_module=lambda m: Doubled(m.modules["base"]))
    assert rewrite.matches == ["relu"]
    with pytest.raises(PatternError, match=r"no longer applies: .* at 'relu': it binds the modules \{'base': 'o'\},"
                                           r" the module was made for \{'base': 'q'\}.*Remove the rewrite"):
        model(large)
    rewrite.remove()
    with torch.no_grad():
        assert torch.equal(model(large), eager(large))
        assert torch.equal(model(small), eager(small))
