"""Random generator objects a model's code draws from: ``random.Random(0)``,
``np.random.default_rng(0)``, ``np.random.RandomState(0)``, ``torch.Generator().manual_seed(0)``,
held by a module (``self.rng``), by a plain object it holds (``self.cfg.rng``), or read as a module
global or from a closure cell.

A forward drawing from one changes the generator's state, a Python side effect a graph does not
repeat (a graph would keep the numbers drawn while it was extracted), and extraction's own runs
would draw from it too. :func:`generator_state` reads such an object's state (through each
library's public state API), :func:`same_generator_state` compares two states and
:func:`set_generator_state` puts one back, so that
:class:`~nnbridge.guards.preservation.ModuleState` (a module's own attributes) and
:class:`~nnbridge.guards.global_state.GlobalValues` (the others) find the draws and put the state
back after each of extraction's runs, as is done for the global RNGs.

Example::

    rng = random.Random(0)
    saved = generator_state(rng)
    rng.random()
    same_generator_state(generator_state(rng), saved)   # False
    set_generator_state(rng, saved)
"""

from __future__ import annotations

import copy
import pickle
import random
import sys
from typing import Any

import torch


def generator_state(value: Any) -> Any:
    """The state of a random generator object (``random.Random``, numpy's ``Generator`` or
    ``RandomState``, ``torch.Generator``); None for any other value."""
    if isinstance(value, random.Random):
        return value.getstate()
    if isinstance(value, torch.Generator):
        return value.get_state()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if isinstance(value, numpy.random.Generator):
            return copy.deepcopy(value.bit_generator.state)
        if isinstance(value, numpy.random.RandomState):
            return copy.deepcopy(value.get_state(legacy=False))
    return None


def same_generator_state(state: Any, other: Any) -> bool:
    """Whether two states from :func:`generator_state` are equal."""
    if isinstance(state, torch.Tensor):
        return isinstance(other, torch.Tensor) and torch.equal(state, other)
    if isinstance(state, dict):  # numpy's (arrays inside: compared by their bytes)
        return pickle.dumps(state) == pickle.dumps(other)
    return bool(state == other)


def set_generator_state(value: Any, state: Any) -> None:
    """Put back the state ``state`` (from :func:`generator_state`) of the generator ``value``."""
    if isinstance(value, random.Random):
        value.setstate(state)
    elif isinstance(value, torch.Generator):
        value.set_state(state)
    elif hasattr(value, "bit_generator"):  # numpy's Generator
        value.bit_generator.state = copy.deepcopy(state)
    else:  # numpy's RandomState
        value.set_state(copy.deepcopy(state))
