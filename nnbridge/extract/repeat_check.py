"""A call's eager code, run twice from the same module state and random state on copies of the same
inputs, must give the same outputs (:func:`check_repeatable`).

A forward that keeps state nnbridge can neither read nor put back gives other outputs on the second
run: ``next(self.counter)`` of an ``itertools.count``, a Python generator, a C extension object,
the clock. A graph would keep the values one of extraction's runs computed, and extraction's own
runs have advanced that state, so no graph and no eager run of that module can equal an untouched
model's calls: extraction raises :class:`~nnbridge.errors.ExtractionError` naming the module whose
code computed the first differing value (a warning instead off the CPU, see below). Module
attributes, buffers, parameters, random generators and the globals a module's code reads are put
back after every run (:func:`~nnbridge.guards.preservation.preserved_state`,
:class:`~nnbridge.guards.global_state.GlobalValues`), so they never differ here.

The first run is the one :func:`~.eager_checks.eager_findings` makes, the second the recording
run (:func:`~.recording.record_calls`) when extraction makes one, so the check usually costs no run
of its own. Outputs are compared by :func:`fingerprint`: a tensor on the CPU by its sizes, dtype and
the CRC-32 of its bytes (not held twice: a model's logits can be hundreds of MB); a tensor on
another device by a copy, within ``rtol=1e-3, atol=1e-5`` (kernels may add in another order on each
run, as CUDA's atomic ``index_add_``; a difference there is only a warning, unless
``torch.use_deterministic_algorithms(True)`` is on: a model routing tokens by top-k, say, may route
them otherwise); Python numbers, strings, bytes, ``None`` and booleans with ``==``. Other objects
in an output (that torch's pytree, :mod:`nnbridge.compat.torch.pytree`, does not flatten) are not
compared. State read only every few calls (``if next(self.counter) % 100 == 0``) is not found.

Example::

    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.counter = itertools.count()
        def forward(self, x):
            return x * next(self.counter)

    nnbridge.bridge(Outer(Counted()), x)   # ExtractionError: 'inner' (Counted) gives other outputs ...
"""

from __future__ import annotations

import ctypes
import math
import warnings
import zlib
from typing import Any, NamedTuple

import torch

from ..compat.torch.pytree import pytree
from ..errors import ExtractionError, NNBridgeWarning
from ..graph.kinds import HookKind
from .recording import observed_run

#: Python values compared with ``==`` (other non-tensor leaves are not compared)
_PLAIN = (bool, int, float, complex, str, bytes, type(None))

#: what the user can do about a module :func:`check_repeatable` names
HIDDEN_STATE_FIX = ("Keep the state in an attribute of the module (a Python number, or a tensor buffer: "
                    "self.step += 1) or in a random generator, which nnbridge reads and puts back, "
                    "instead of in an iterator, a generator or another object whose state Python cannot read.")


class _Bits(NamedTuple):
    """A CPU tensor's sizes, dtype and the CRC-32 of its bytes (compared exactly)."""

    shape: torch.Size
    dtype: torch.dtype
    crc: int


class _Held(NamedTuple):
    """A copy of a tensor not read as bytes: a tensor subclass (compared exactly on the CPU), a
    tensor on another device (within a tolerance, see :func:`same_tensor`)."""

    tensor: torch.Tensor
    exact: bool


class _Plain(NamedTuple):
    """A Python number, string, bytes, bool or None."""

    value: Any


class Fingerprint(NamedTuple):
    """What :func:`same_fingerprint` compares of an output: its pytree structure and, per leaf, a
    :class:`_Bits`, :class:`_Held` or :class:`_Plain`, or None for a leaf that is not compared (an
    object torch's pytree does not flatten, a tensor that cannot be copied)."""

    spec: Any
    leaves: tuple[Any, ...]


def same_tensor(first: torch.Tensor, second: torch.Tensor, *, exact: bool) -> bool:
    """Whether two tensors have the same sizes, dtype and device and equal values, NaN equal to NaN:
    exactly, or (``exact`` false) within ``rtol=1e-3, atol=1e-5``. True when no comparison runs on
    them (meta tensors, a subclass that refuses it)."""
    if first.shape != second.shape or first.dtype != second.dtype or first.device != second.device:
        return False
    try:
        if torch.equal(first, second):
            return True
        if not (first.is_floating_point() or first.is_complex()):
            return False
        return torch.allclose(first, second, rtol=0.0 if exact else 1e-3, atol=0.0 if exact else 1e-5,
                              equal_nan=True)
    except (RuntimeError, NotImplementedError):
        return True


def _leaf_print(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        try:
            if leaf.device.type == "cpu" and leaf.layout == torch.strided \
                    and type(leaf) in (torch.Tensor, torch.nn.Parameter):
                data = leaf.detach().resolve_conj().resolve_neg().contiguous()
                size = data.numel() * data.element_size()
                crc = zlib.crc32((ctypes.c_char * size).from_address(data.data_ptr())) if size else 0
                return _Bits(data.shape, data.dtype, crc)
            return _Held(leaf.detach().clone(), leaf.device.type == "cpu")
        except (RuntimeError, NotImplementedError, TypeError):  # a tensor that cannot be read (a subclass)
            return None
    if isinstance(leaf, _PLAIN):
        return _Plain(leaf)
    return None


def fingerprint(value: Any) -> Fingerprint:
    """The :class:`Fingerprint` of an output (any pytree of tensors and Python values). A CPU
    tensor is kept as the CRC-32 of its bytes, not as a copy: an output as large as a model's
    logits is not held twice; a tensor on another device is copied."""
    leaves, spec = pytree.tree_flatten(value)
    return Fingerprint(spec, tuple(map(_leaf_print, leaves)))


def _same_leaf(first: Any, second: Any) -> bool:
    if type(first) is not type(second):
        return False
    if isinstance(first, _Held):
        return same_tensor(first.tensor, second.tensor, exact=first.exact)
    if isinstance(first, _Plain):
        a, b = first.value, second.value
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return type(a) is type(b) and bool(a == b)
    return bool(first == second)  # _Bits, or None (not compared)


def certain(printed: Fingerprint) -> bool:
    """Whether a difference from ``printed`` shows state out of reach for certain: every tensor of
    the output is compared exactly (on the CPU), or ``torch.use_deterministic_algorithms(True)``
    is on. Else kernels on another device may have given other numbers on each run."""
    return torch.are_deterministic_algorithms_enabled() \
        or all(leaf.exact for leaf in printed.leaves if isinstance(leaf, _Held))


def same_fingerprint(first: Fingerprint, second: Fingerprint) -> bool:
    """Whether two outputs' fingerprints match: the same structure; CPU tensors of the same sizes,
    dtype and bytes; other tensors by :func:`same_tensor` within its tolerance (their kernels may
    add in another order on each run); Python values with ``==`` (of the same type, NaN equal to
    NaN)."""
    return first.spec == second.spec and len(first.leaves) == len(second.leaves) \
        and all(map(_same_leaf, first.leaves, second.leaves))


def _events(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            *, grad_enabled: bool) -> list[tuple[str, str, Fingerprint]]:
    """One eager run recording, in order, ``("enter", path, fingerprint of the inputs)`` and
    ``("leave", path, fingerprint of the output)`` of every module call (the root is ``""``)."""
    from ..graph.module_tree import named_real_modules

    events: list[tuple[str, str, Fingerprint]] = []

    def enter(fqn: str) -> Any:
        return lambda mod, a, k: events.append(("enter", fqn, fingerprint((a, k))))

    def leave(fqn: str) -> Any:
        return lambda mod, a, k, out: events.append(("leave", fqn, fingerprint(out)))
    hooks = [hook for fqn, sub in named_real_modules(module)
             for hook in ((sub, HookKind.PRE, enter(fqn)), (sub, HookKind.POST, leave(fqn)))]
    observed_run(module, args, kwargs, hooks=hooks, grad=grad_enabled, reset=events.clear)
    return events


def differing_module(first: list[tuple[str, str, Fingerprint]], second: list[tuple[str, str, Fingerprint]]) -> str:
    """The path of the module whose own code computed the first value that differs between two
    runs' events (see :func:`_events`): the module running just before that event, the caller for
    an ``enter`` whose inputs differ, the module itself for a ``leave`` whose output differs. The
    root ``""`` when no event differs."""
    active: list[str] = []
    for (kind, fqn, value), (other_kind, other_fqn, other_value) in zip(first, second):
        if kind == "enter" and active:
            running = active[-1]
        else:
            running = fqn if kind == "leave" else ""
        if (kind, fqn) != (other_kind, other_fqn) or not same_fingerprint(value, other_value):
            return running
        if kind == "enter":
            active.append(fqn)
        else:
            active.pop()
    return active[-1] if active else ""


def check_repeatable(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                     first: Fingerprint, second: Fingerprint | None = None, grad_enabled: bool,
                     path: str = "") -> None:
    """Compare the fingerprints of two eager runs' outputs of the call, each from the same state (as
    :func:`~.recording.observed_run` runs it: copies of the inputs, state put back). When they
    differ, two more runs with hooks on every module name the module, and this raises; or, when the
    difference is not :func:`certain` (a tensor on another device than the CPU, without
    ``torch.use_deterministic_algorithms(True)``), warns.

    Args:
        module, args, kwargs: the call.
        first: the :func:`fingerprint` of an earlier run's output.
        second: that of a second run's; None to make that run here (under ``grad_enabled``).
        grad_enabled: the grad mode of the runs made here.
        path: the module's NodePath prefix, for the message (``""`` for a bridged model's root).

    Raises:
        ExtractionError: the outputs differ, :func:`certain`; the message names the module (its
            NodePath and class; the call's module when a run naming it raised, that error as
            ``__cause__``) and :data:`HIDDEN_STATE_FIX`.
        Exception: what the module's code raised in the second run, when made here.

    Warns:
        NNBridgeWarning: the outputs differ, not :func:`certain`: the same message, and that the
            device's kernels may also differ on each run.
    """
    from ..graph.module_tree import named_real_modules

    if second is None:
        second = fingerprint(observed_run(module, args, kwargs, hooks=[], grad=grad_enabled))
    if same_fingerprint(first, second):
        return
    failure: Exception | None = None
    try:
        culprit = differing_module(_events(module, args, kwargs, grad_enabled=grad_enabled),
                                   _events(module, args, kwargs, grad_enabled=grad_enabled))
    except Exception as error:  # noqa: BLE001 - a run naming the module raised (an iterator ran out)
        culprit, failure = "", error  # (the call's module is named)
    target = dict(named_real_modules(module)).get(culprit, module)
    full = ".".join(part for part in (path, culprit) if part) or "<root>"
    message = (f"'{full}' ({type(target).__name__}) gives other outputs on two runs from the same module state,"
               " random state and inputs: its forward keeps state nnbridge cannot read or put back (an iterator such"
               " as itertools.count, a generator, a C object, the clock). A graph would keep one run's values, and"
               f" extraction's own runs have already advanced that state. {HIDDEN_STATE_FIX}")
    if failure is not None:
        detail = f": {failure}" if str(failure) else ""
        message += f" (A further run to name the module raised {type(failure).__name__}{detail}.)"
    if certain(first):
        raise ExtractionError(message) from failure
    warnings.warn(f"{message} (Off the CPU its kernels may also give other numbers on each run; under"
                  " torch.use_deterministic_algorithms(True) this is an error.)", NNBridgeWarning, stacklevel=2)
