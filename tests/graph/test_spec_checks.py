"""The cache check before each bridged call (:class:`nnbridge.graph.state.SpecCheck`) compares a
state object with the structure its graph was extracted for while walking it (:func:`_matches`);
it must decide exactly as comparing the built structures (:func:`_structure`) does."""

import copy
import random

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import nnbridge
from nnbridge.graph.state import SpecCheck, _matches, _structure, _untouched_trie
from nnbridge.compat.torch.pytree import pytree


class Holder:
    def __init__(self, **values):
        self.__dict__.update(values)


class Listy(list):
    """A list subclass: walked as an object (its ``__dict__``), not as a list."""


def _variants(base, rng):
    """Objects near ``base`` (a nested structure of lists, tuples, dicts, objects and tensors):
    each differs from it in one place, or not at all."""
    def paths(value, path=()):
        yield path
        if isinstance(value, torch.Tensor):
            return
        if type(value) in (list, tuple):
            for i, item in enumerate(value):
                yield from paths(item, (*path, (i,)))
        elif type(value) is dict:
            for key, item in value.items():
                yield from paths(item, (*path, (key,)))
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            for key, item in vars(value).items():
                yield from paths(item, (*path, key))

    def replace(value, path, new):
        if not path:
            return new
        step, rest = path[0], path[1:]
        if isinstance(step, tuple):
            if type(value) is tuple:
                return tuple(replace(item, rest, new) if i == step[0] else item for i, item in enumerate(value))
            value[step[0]] = replace(value[step[0]], rest, new)
            return value
        setattr(value, step, replace(getattr(value, step), rest, new))
        return value

    def at(value, path):
        for step in path:
            value = value[step[0]] if isinstance(step, tuple) else getattr(value, step)
        return value

    every = list(paths(base))
    changes = [lambda old: torch.zeros(3), lambda old: 1, lambda old: 2.5, lambda old: "s", lambda old: None,
               lambda old: [old], lambda old: (old,), lambda old: {"k": old}, lambda old: Holder(v=old),
               lambda old: Listy([old]), lambda old: [], lambda old: {}, lambda old: Holder(),
               lambda old: torch.float16, lambda old: True, lambda old: type(old)]
    for _ in range(60):
        obj = copy.deepcopy(base)
        if rng.random() < 0.85:
            path = rng.choice(every)
            obj = replace(obj, path, rng.choice(changes)(at(obj, path)))
        yield obj, every


def _example():
    return Holder(layers=[Holder(keys=torch.ones(2), values=torch.ones(2), is_initialized=True, dtype=torch.float32)
                          for _ in range(3)],
                  extra={"a": 1, "b": (torch.ones(1), [2, 3.0])}, offloading=False, names=("x", None))


@pytest.mark.parametrize("seed", range(8))
def test_matches_decides_as_comparing_the_built_structures(seed):
    """Random objects one change away from an example, against random sets of by-type paths."""
    rng = random.Random(seed)
    base = _example()
    for obj, every in _variants(base, rng):
        untouched = frozenset(rng.sample(every, rng.randint(0, min(4, len(every)))))
        expected = _structure(base, untouched)
        assert _matches(obj, expected, _untouched_trie(untouched)) == (_structure(obj, untouched) == expected)
        assert _matches(obj, _structure(obj, untouched), _untouched_trie(untouched))


def test_untouched_trie_stops_at_the_shorter_path_and_the_empty_path_compares_the_type_only():
    trie = _untouched_trie(frozenset({("layers", (1,)), ("layers", (1,), "keys"), ("extra", ("a",))}))
    assert trie["layers"][(1,)] is trie["extra"][("a",)]  # both the by-type marker
    assert _untouched_trie(frozenset()) is None
    base = _example()
    whole = _untouched_trie(frozenset({()}))
    assert _matches(Holder(), _structure(base, frozenset({()})), whole)
    assert not _matches([], _structure(base, frozenset({()})), whole)


class EqRaises:
    def __eq__(self, other):
        raise TypeError("no ==")

    __hash__ = object.__hash__


def test_spec_check_falls_back_to_the_full_check_when_a_value_cannot_be_compared():
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2)).eval()
    nnbridge.bridge(model, torch.randint(0, 100, (1, 4)))  # registers the cache pytrees
    with torch.no_grad():
        cache = model(torch.randint(0, 100, (1, 4))).past_key_values
    spec = pytree.tree_flatten(cache)[1]
    check = SpecCheck(spec, untouched=frozenset({("layers", (0,))}))
    assert check(cache)
    cache.layers[1].odd = EqRaises()  # a new attribute: the structure differs, and comparing raises
    assert check(cache) == (pytree.tree_flatten(cache)[1] == spec)
    del cache.layers[1].odd
    full = SpecCheck(spec)
    assert full(cache) and full(cache) and len(full.held) == 1  # the second call: a remembered structure
    cache.layers[1].is_initialized = False
    assert not full(cache)
