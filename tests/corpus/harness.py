"""The comparison machinery of the differential corpus, shared by ``tests/corpus/test_corpus.py`` (the
hand-written entries) and ``tests/corpus/test_fuzz.py`` (generated programs): run an :class:`Entry`'s
script eagerly and through one front-end, and list every difference.

:func:`check` is the whole rule: it builds the entry's module from seed 0, deep-copies it before
any nnbridge call (the eager reference), runs the script on both sides from seed 1 and returns the
differences in every call's output, the input and parameter gradients, the parameters, buffers,
CPU RNG state and the Python attributes the entry names, and, with ``hooks=True``, what torch hooks
(forward and full backward) on every module saw (:class:`HookLog`); or passes a loud outcome (an
:class:`nnbridge.NNBridgeError` whose message names a module of the model).
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
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
        self.printed: list[str] = []  # what each call wrote to stdout


def _backward(out: Any) -> None:
    leaves = [t for t in pytree.tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if leaves:
        with warnings.catch_warnings():
            # torch's note on a module whose inputs need no gradient (the first layer's): its full
            # backward hook fires with the output gradients, as eager's does (HookLog's hooks)
            warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
            sum(t.float().sum() for t in leaves).backward()


def _seen(value: Any) -> Any:
    """What a hook saw, kept for comparison: tensors copied, containers walked, plain values kept,
    any other object (a transformers cache, a module) by its type's name."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_seen(v) for v in value) if type(value) in (tuple, list) else tuple(_seen(v) for v in value)
    if isinstance(value, dict):
        return {k: _seen(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return f"<{type(value).__name__}>"


def _shifted(value: Any, by: float) -> Any:
    """``value`` with ``by`` added to every floating-point tensor inside plain tuples, lists and
    dicts (other objects as they are)."""
    if isinstance(value, torch.Tensor):
        return value + by if value.is_floating_point() else value
    if type(value) in (tuple, list):
        return type(value)(_shifted(v, by) for v in value)
    if type(value) is dict:
        return {k: _shifted(v, by) for k, v in value.items()}
    return value


class HookLog:
    """A forward pre-hook and a forward hook (both with keyword arguments) on every module of a
    model, logging ``(module path, "input", args, kwargs)`` and ``(module path, "output", output)``
    while :attr:`on`: a bridged model must call each module as eager does, with the same values.
    With ``backward``, a full backward pre-hook and a full backward hook on every module too,
    logging ``(module path, "grad_output", grads)`` and ``(module path, "grad_input", grads)`` in
    every backward pass: a bridged model's autograd graph must reach each module as eager's does.

    ``edit``: the hooks also replace what they see: each module's floating-point inputs shifted by
    ``edit``, its outputs by ``edit / 2`` (see :func:`_shifted`), its output gradients scaled by
    ``1 + edit``, so a bridged model must run on what its hooks return; the root's output too
    unless ``root_output=False`` (nnsight's ``model.output`` is the forward's return, before the
    root's forward hooks, as in nnsight, whose traces fire no full backward hook of the root
    either: nnsight 0.8.1 alike)."""

    def __init__(self, model: torch.nn.Module, edit: float = 0.0, *, root_output: bool = True,
                 backward: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.on = False
        self.edit = edit
        self.root = model if not root_output else None
        for path, module in model.named_modules():
            module.register_forward_pre_hook(self._pre(path), with_kwargs=True)
            module.register_forward_hook(self._post(path), with_kwargs=True)
            if backward and module is not self.root:
                module.register_full_backward_pre_hook(self._grad_output(path))
                module.register_full_backward_hook(self._grad_input(path))

    def _pre(self, path: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if self.on:
                self.calls.append((path or "<root>", "input", _seen(args), _seen(kwargs)))
                if self.edit:
                    return _shifted(args, self.edit), _shifted(kwargs, self.edit)
            return None
        return hook

    def _post(self, path: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            if self.on:
                self.calls.append((path or "<root>", "output", _seen(output)))
                if self.edit and module is not self.root:
                    return _shifted(output, self.edit / 2)
            return None
        return hook


    def _grad_output(self, path: str) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, grad_output: tuple[Any, ...]) -> Any:
            self.calls.append((path or "<root>", "grad_output", _seen(grad_output)))
            if self.edit:
                return tuple(None if g is None else g * (1 + self.edit) for g in grad_output)
            return None
        return hook

    def _grad_input(self, path: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...]) -> None:
            self.calls.append((path or "<root>", "grad_input", _seen(grad_input)))
        return hook


def _run(model: torch.nn.Module, steps: list[Call | Edit], setup: Callable[[Call], None] | None,
         call: Callable[[Call], Any], log: HookLog | None = None) -> Run:
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
            if log is not None:
                log.on = True
                stack.enter_context(warnings.catch_warnings())
                # torch's note on a module returning a dict: its full backward hooks do not fire, in
                # eager as in a bridged model (HookLog's hooks)
                warnings.filterwarnings("ignore", "For backward hooks to be called", UserWarning)
            printed = stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            try:
                out = call(step)
            finally:
                if log is not None:
                    log.on = False
        run.outputs.append(out)
        run.printed.append(printed.getvalue())
        if step.grad:
            _backward(out)
    for step in steps:
        if isinstance(step, Call):
            run.input_grads.extend(t.grad for t in pytree.tree_leaves((step.args, step.kwargs))
                                   if isinstance(t, torch.Tensor) and t.requires_grad)
    run.rng = torch.get_rng_state()
    return run


def _envoy(wrapped: Any, path: str) -> Any:
    envoy = wrapped
    for part in path.split("."):
        envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
    return envoy


def _front_end(name: str, model: torch.nn.Module, options: nnbridge.ExtractionOptions | None = None,
               nnsight_graphs: bool = False, set_output: str | None = None
               ) -> tuple[Callable[[Call], None], Callable[[Call], Any]]:
    """(setup(example_call), call(step)) for a front-end over ``model``. ``nnsight_graphs``: the
    NNsight front-end runs its traces on the graphs (``eager_module_traces = False``; by default a
    trace reading only the output runs the model's own code). ``set_output``: the NNsight
    front-end's traces set that module's output to its output + 0.5 (``envoy.output = ...``, its
    first call in each forward, as nnsight's ``.output`` is)."""
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
                if set_output is not None:
                    envoy = _envoy(wrapped, set_output)
                    envoy.output = envoy.output + 0.5
                out = wrapped.output.save()
            return out
    return setup, call


def _first_output_target(entry: Entry, mode: str) -> str | None:
    """The path of the first module (not the root) that every call of ``entry``'s script calls, its
    first call returning a floating-point tensor, run eagerly on a model of its own (nnsight raises
    for an output edit of a module a forward never reaches); None if there is none."""
    torch.manual_seed(0)
    probe = entry.make().train(mode == "train")
    torch.manual_seed(0)
    log = HookLog(probe)
    per_call: list[list[str]] = []

    def call(step: Call) -> Any:
        start = len(log.calls)
        out = probe(*step.args, **step.kwargs)
        seen: dict[str, Any] = {}
        for c in log.calls[start:]:
            if c[1] == "output" and c[0] != "<root>":
                seen.setdefault(c[0], c[2])
        per_call.append([path for path, value in seen.items()
                         if isinstance(value, torch.Tensor) and value.is_floating_point()])
        return out

    _run(probe, entry.script(), None, call, log)
    return next((path for path in per_call[0] if all(path in paths for paths in per_call)), None) if per_call else None


def _add_to_first_output(model: torch.nn.Module, path: str) -> None:
    """Eager's equivalent of :func:`_front_end`'s ``set_output``: a forward hook adding 0.5 to the
    output of ``path``'s first call in each forward of ``model``."""
    calls = [0]

    def reset(module: torch.nn.Module, args: Any) -> None:
        calls[0] = 0

    def add(module: torch.nn.Module, args: Any, output: Any) -> Any:
        calls[0] += 1
        return output + 0.5 if calls[0] == 1 else None

    model.register_forward_pre_hook(reset)
    model.get_submodule(path).register_forward_hook(add)


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
    for i, (e, a) in enumerate(zip(eager.printed, other.printed)):
        if e != a:
            problems.append(f"call {i} printed {a!r}, eager {e!r}")
    if not torch.equal(eager.rng, other.rng):
        problems.append("RNG state after the script differs from eager")
    if entry.attrs is not None:
        _diff_tree("Python attributes", entry.attrs(ref), entry.attrs(model), problems)
    return problems


def _diff_hooks(eager: HookLog, other: HookLog, problems: list[str]) -> None:
    """The first module call whose hooks saw another module, order or count than eager's, else every
    value each hook saw compared as :func:`_diff_tree` does."""
    for i in range(max(len(eager.calls), len(other.calls))):
        e = eager.calls[i][:2] if i < len(eager.calls) else None
        a = other.calls[i][:2] if i < len(other.calls) else None
        if e != a:
            problems.append(f"hook call {i}: {a or 'nothing'} != eager {e or 'nothing'} (module calls differ)")
            return
    for i, (e, a) in enumerate(zip(eager.calls, other.calls)):
        _diff_tree(f"hook call {i} ('{e[0]}' {e[1]})", e[2:], a[2:], problems)


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
          nnsight_graphs: bool = False, hooks: bool = False, edit: float = 0.0, set_output: bool = False
          ) -> list[str]:
    """The differences between ``entry`` run eagerly and through ``front_end`` in ``mode``
    (``"train"``/``"eval"``), empty when there is none or when nnbridge raised an
    :class:`nnbridge.NNBridgeError` naming a module of the model (the loud outcome). An error
    that is not loud propagates; a loud one that names no module is a difference.

    ``hooks``: a :class:`HookLog` on both models, registered before the front-end sees the model
    (with full backward hooks unless the entry opts out, :attr:`Entry.backward_hooks`); what the
    hooks saw in the script's calls and backward passes is compared too (not with ``"pg"``, whose
    graphs do not call the user's modules); ``edit``: the hooks replace what they see (see
    :class:`HookLog`).
    ``set_output`` (``"nnsight"`` only): each trace sets the output of the first module returning a
    floating-point tensor to that output + 0.5 (see :func:`_first_output_target`), which eager's
    side does with a forward hook (:func:`_add_to_first_output`): nnsight's output edits act as
    eager's."""
    torch.manual_seed(0)
    model = entry.make().train(mode == "train")
    ref = copy.deepcopy(model)
    torch.manual_seed(0)
    steps = entry.script()
    eager_steps, steps = copy.deepcopy(steps), copy.deepcopy(steps)
    hooks = hooks and front_end != "pg"
    root_output = front_end != "nnsight"
    eager_log, log = (tuple(HookLog(m, edit, root_output=root_output, backward=entry.backward_hooks)
                            for m in (ref, model)) if hooks else (None, None))

    target = _first_output_target(entry, mode) if set_output and front_end == "nnsight" else None
    if target is not None:
        _add_to_first_output(ref, target)

    eager = _run(ref, eager_steps, None, lambda step: ref(*step.args, **step.kwargs), eager_log)
    setup, call = _front_end(front_end, model, options, nnsight_graphs, set_output=target)
    try:
        other = _run(model, steps, setup, call, log)
    except Exception as error:  # the loud outcome is allowed when it is an nnbridge error naming the module
        loud = _loud_chain(error)
        if loud is None:
            raise
        if not _names_a_module(str(loud), ref):
            return [f"nnbridge error does not name a module of the model: {loud}"]
        return []
    problems = _diff(entry, ref, model, eager, other)
    if eager_log is not None and log is not None:
        _diff_hooks(eager_log, log, problems)
    return problems
