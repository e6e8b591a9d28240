"""The comparison machinery of the differential corpus, shared by ``tests/corpus/test_corpus.py`` (the
hand-written entries) and ``tests/corpus/test_fuzz.py`` (generated programs): run an :class:`Entry`'s
script eagerly and through one front-end, and list every difference.

:func:`check` is the whole rule: it builds the entry's module from seed 0, deep-copies it before
any nnbridge call (the eager reference), runs the script on both sides from seed 1 and returns the
differences in every call's output, the input and parameter gradients, the parameters, buffers,
CPU RNG state and the Python attributes the entry names; or passes a loud outcome (an
:class:`nnbridge.NNBridgeError` whose message names a module of the model).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

import nnbridge
from . import Call, Edit, Entry

FRONT_ENDS = ("bridge", "pg", "nnsight")


# -- running one side ---------------------------------------------------------------------------
class Run:
    """What one side produced: per-call outputs, then the state after the script."""

    def __init__(self) -> None:
        self.outputs: list[Any] = []
        self.input_grads: list[torch.Tensor | None] = []
        self.rng: torch.Tensor | None = None


def _backward(out: Any) -> None:
    leaves = [t for t in pytree.tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if leaves:
        sum(t.float().sum() for t in leaves).backward()


def _run(model: torch.nn.Module, steps: list[Call | Edit], setup: Callable[[Call], None] | None,
         call: Callable[[Call], Any]) -> Run:
    run = Run()
    torch.manual_seed(1)
    if setup is not None:
        setup(next(s for s in steps if isinstance(s, Call)))
    for step in steps:
        if isinstance(step, Edit):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(2)
                step.fn(model)
            continue
        with contextlib.ExitStack() as stack:
            if not step.grad:
                stack.enter_context(torch.no_grad())
            if step.context is not None:
                stack.enter_context(step.context())
            out = call(step)
        run.outputs.append(out)
        if step.grad:
            _backward(out)
    for step in steps:
        if isinstance(step, Call):
            run.input_grads.extend(t.grad for t in pytree.tree_leaves((step.args, step.kwargs))
                                   if isinstance(t, torch.Tensor) and t.requires_grad)
    run.rng = torch.get_rng_state()
    return run


def _front_end(name: str, model: torch.nn.Module, options: nnbridge.ExtractionOptions | None = None,
               nnsight_graphs: bool = False) -> tuple[Callable[[Call], None], Callable[[Call], Any]]:
    """(setup(example_call), call(step)) for a front-end over ``model``. ``nnsight_graphs``: the
    NNsight front-end runs its traces on the graphs (``eager_module_traces = False``; by default a
    trace reading only the output runs the model's own code)."""
    holder: dict[str, Any] = {}
    if name == "bridge":
        def setup(example: Call) -> None:
            nnbridge.bridge(model, *example.args, options=options, **example.kwargs)

        def call(step: Call) -> Any:
            return model(*step.args, **step.kwargs)
    elif name == "pg":
        def setup(example: Call) -> None:
            holder["pg"] = nnbridge.PatchableGraph(model, *example.args, options=options, **example.kwargs)

        def call(step: Call) -> Any:
            return holder["pg"](*step.args, **step.kwargs)
    else:
        def setup(example: Call) -> None:
            if options is not None:
                nnbridge.bridge(model, options=options)  # deferred: the first trace extracts
            holder["nn"] = nnbridge.NNsight(model)
            if nnsight_graphs:
                holder["nn"].eager_module_traces = False

        def call(step: Call) -> Any:
            wrapped = holder["nn"]
            with wrapped.trace(*step.args, **step.kwargs):
                out = wrapped.output.save()
            return out
    return setup, call


# -- comparing ----------------------------------------------------------------------------------
def _diff_tree(what: str, expected: Any, actual: Any, problems: list[str]) -> None:
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    act_leaves, act_spec = pytree.tree_flatten(actual)
    if exp_spec != act_spec:
        problems.append(f"{what}: structure {act_spec} != eager {exp_spec}")
        return
    for i, (e, a) in enumerate(zip(exp_leaves, act_leaves)):
        where = f"{what}[leaf {i}]"
        if isinstance(e, torch.Tensor) != isinstance(a, torch.Tensor):
            problems.append(f"{where}: {type(a).__name__} != eager {type(e).__name__}")
        elif isinstance(e, torch.Tensor):
            if (e.dtype, e.shape) != (a.dtype, a.shape):
                problems.append(f"{where}: {a.dtype}{list(a.shape)} != eager {e.dtype}{list(e.shape)}")
            elif not torch.equal(e, a):
                problems.append(f"{where}: values differ (max abs diff "
                                f"{(e.double() - a.double()).abs().max().item():.3g})")
            if e.requires_grad != a.requires_grad:
                problems.append(f"{where}: requires_grad {a.requires_grad} != eager {e.requires_grad}")
        elif type(e) is not type(a) or e != a:
            problems.append(f"{where}: {a!r} != eager {e!r}")


def _diff(entry: Entry, ref: torch.nn.Module, model: torch.nn.Module, eager: Run, other: Run) -> list[str]:
    problems: list[str] = []
    for i, (e, a) in enumerate(zip(eager.outputs, other.outputs)):
        _diff_tree(f"output of call {i}", e, a, problems)
    _diff_tree("input grads", eager.input_grads, other.input_grads, problems)
    for kind in ("parameters", "buffers"):
        exp = dict(getattr(ref, f"named_{kind}")())
        act = dict(getattr(model, f"named_{kind}")())
        if exp.keys() != act.keys():
            problems.append(f"{kind}: names {sorted(act)} != eager {sorted(exp)}")
            continue
        for name in exp:
            _diff_tree(f"{kind[:-1]} {name}", exp[name].detach(), act[name].detach(), problems)
            if kind == "parameters":
                _diff_tree(f"grad of {name}", exp[name].grad, act[name].grad, problems)
    if not torch.equal(eager.rng, other.rng):
        problems.append("RNG state after the script differs from eager")
    if entry.attrs is not None:
        _diff_tree("Python attributes", entry.attrs(ref), entry.attrs(model), problems)
    return problems


def _loud_chain(error: BaseException) -> nnbridge.NNBridgeError | None:
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, nnbridge.NNBridgeError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _names_a_module(message: str, model: torch.nn.Module) -> bool:
    names = {type(m).__name__ for m in model.modules()}
    names |= {path for path, _ in model.named_modules() if path}
    return any(name in message for name in names)


# -- one case -----------------------------------------------------------------------------------
def check(entry: Entry, front_end: str, mode: str, options: nnbridge.ExtractionOptions | None = None,
          nnsight_graphs: bool = False) -> list[str]:
    """The differences between ``entry`` run eagerly and through ``front_end`` in ``mode``
    (``"train"``/``"eval"``), empty when there is none or when nnbridge raised an
    :class:`nnbridge.NNBridgeError` naming a module of the model (the loud outcome). An error
    that is not loud propagates; a loud one that names no module is a difference."""
    torch.manual_seed(0)
    model = entry.make().train(mode == "train")
    ref = copy.deepcopy(model)
    torch.manual_seed(0)
    steps = entry.script()
    eager_steps, steps = copy.deepcopy(steps), copy.deepcopy(steps)

    eager = _run(ref, eager_steps, None, lambda step: ref(*step.args, **step.kwargs))
    setup, call = _front_end(front_end, model, options, nnsight_graphs)
    try:
        other = _run(model, steps, setup, call)
    except Exception as error:  # the loud outcome is allowed when it is an nnbridge error naming the module
        loud = _loud_chain(error)
        if loud is None:
            raise
        if not _names_a_module(str(loud), ref):
            return [f"nnbridge error does not name a module of the model: {loud}"]
        return []
    return _diff(entry, ref, model, eager, other)
