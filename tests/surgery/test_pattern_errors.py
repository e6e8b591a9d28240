"""Every PatternError path of match/replace_pattern; nothing is edited after one."""

import copy

import pytest
import torch

import nnbridge
from nnbridge import PatternError, SurgeryError, surgery
from pattern_models import CustomLinear, Model, fused, layer_norm_pattern, pattern


@pytest.fixture
def setup():
    x = torch.randn(2, 8)
    model = Model(layers=2)
    eager = copy.deepcopy(model)
    nnbridge.bridge(model, x)
    yield model, eager, x
    assert surgery.edits(model) == []
    with torch.no_grad():
        assert torch.equal(model(x), eager(x))


def unannotated(x, l0):
    return l0(x)


def returns_input(x, l0: CustomLinear):
    return x


def branches_on_a_tensor(x, l0: CustomLinear):
    if x.sum() > 0:
        return l0(x)
    return x


def only_constants(x):
    return 1


@pytest.mark.parametrize("bad, match", [
    (42, r"pattern must be a function or an nn.Module \(its forward is traced\); got int"),
    (unannotated, r"calls its argument 'l0' like a module, but it has no nn.Module annotation.*annotate it"),
    (returns_input, r"must return one computed value"),
    (branches_on_a_tensor, r"cannot be traced by torch.fx.*constants="),
    (only_constants, r"must return one computed value"),
    (lambda *args: args[0], r"\*args/\*\*kwargs"),
])
def test_bad_patterns(setup, bad, match):
    model, _, _ = setup
    with pytest.raises(PatternError, match=match):
        surgery.replace_pattern(model, bad, fused)
    with pytest.raises(PatternError, match=match):
        surgery.match(model, bad)


def test_constants_for_no_argument(setup):
    model, _, _ = setup
    with pytest.raises(PatternError, match=r"constants= names \['cfg'\], which the pattern pattern does not take"):
        surgery.replace_pattern(model, pattern, fused, constants={"cfg": 1})
    with pytest.raises(PatternError, match=r"constants= must be a dict"):
        surgery.match(model, pattern, constants=[1])


def test_example_inputs_for_a_module_argument(setup):
    model, _, x = setup
    with pytest.raises(PatternError, match=r"a tensor per tensor argument \['x'\] \(a tuple in that order.*module and"
                       r" constant arguments take none\); got 3 value\(s\)"):
        surgery.match(model, pattern, example_inputs=(x, CustomLinear(8), CustomLinear(8)))


def test_a_scope_matching_nothing(setup):
    model, _, _ = setup
    with pytest.raises(PatternError, match=r"the scope 'layers_\*' matches no compiled graph; graphs: \['<root>'"):
        surgery.replace_pattern(model, pattern, fused, scope="layers_*")
    with pytest.raises(PatternError, match=r"match: the scope 'layers_\*' matches no compiled graph"):
        surgery.match(model, pattern, scope="layers_*")


def test_replacements_that_do_not_fit(setup):
    model, _, _ = setup

    def takes_another_argument(x, l0, bias):
        return l0(x) + bias

    def changes_the_shape(x, l0, l1):
        return torch.cat([x, x], -1)

    def calls_a_module_twice(x, l0, l1):
        return l0(l0(x))

    def returns_a_tuple(x, l0, l1):
        return x, x

    for replacement, match in [
        (takes_another_argument, r"takes \['bias'\], which the pattern does not bind"),
        (changes_the_shape, r"changes_the_shape: after the pass replace_pattern\(pattern\), the check 'shapes' failed on the graph"
                               r" blocks_\d.*\[2, 16\]"),
        (calls_a_module_twice, r"calls 'l0', which is not a module the match bound \(or calls it twice\)"),
        (returns_a_tuple, r"must return one tensor"),
        ("not callable", r"replacement must be a function"),
    ]:
        with pytest.raises(PatternError, match=match):
            surgery.replace_pattern(model, pattern, replacement)


def test_a_replacement_using_a_dropped_input(setup):
    model, _, _ = setup

    def with_unused(x, l0: CustomLinear, l1: CustomLinear, other: CustomLinear):
        return l1(l0(x))

    def uses_it(x, l0, l1, other):
        return other(x)

    with pytest.raises(PatternError, match=r"left \['other'\] unused, so they were dropped"):
        surgery.replace_pattern(model, with_unused, uses_it)


def test_a_target_that_is_not_bridged():
    with pytest.raises(SurgeryError, match=r"not bridged"):
        surgery.replace_pattern(Model(), layer_norm_pattern, fused)
    assert issubclass(PatternError, SurgeryError) and issubclass(PatternError, nnbridge.NNBridgeError)


def test_a_rewrite_failing_on_a_later_extraction_raises_and_leaves_the_model_usable():
    x = torch.randn(2, 8)
    model = Model(layers=2)
    eager = copy.deepcopy(model)
    nnbridge.bridge(model, x)

    state = {"first": True}

    def only_once(x, l0, l1):
        if not state["first"]:
            raise ValueError("this replacement handles one extraction only")
        return fused(x, l0, l1)

    rewrite = surgery.replace_pattern(model, pattern, only_once)
    state["first"] = False
    with pytest.raises(PatternError, match=r"no longer applies.*one extraction only.*Remove the rewrite"):
        model(torch.randn(1, 3, 8))
    rewrite.remove()
    other = torch.randn(1, 3, 8)
    with torch.no_grad():
        assert torch.equal(model(other), eager(other))
