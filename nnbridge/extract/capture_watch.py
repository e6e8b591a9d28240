"""Watch one export for what its graphs would silently drop, and name the module at fault.

A graph replays the tensor operations of one traced call. It does not replay:

- grad-mode or autocast changes inside a forward (``with torch.no_grad():``, ``@torch.no_grad``);
  export records them as higher-order ops that unflatten cannot keep (see
  :func:`nnbridge.compat.torch.capture.mode_regions`);
- custom ``torch.autograd.Function``s: export inlines their forward and loses their backward;
- ``torch.compiler.is_compiling()`` / ``is_exporting()`` asked by a model's own code (not torch's
  or transformers'): True while exporting, False in eager code (:func:`nnbridge.compat.torch.capture.compile_queries`);
- Dynamo's ``graph_break()``: the author asked for the code around it not to be one graph
  (graphpatch made such a module opaque; non-strict export would run it as a no-op);
- transformers skipping its sdpa attention mask in eager code, which a traced call builds: equal
  for transformers' own sdpa, not for an attention function registered in its place
  (:mod:`nnbridge.compat.transformers.mask_skips`; found by :func:`~.eager_checks.eager_findings`);
- Python side effects on module state: an attribute set in forward (``self.calls += 1``, a tensor
  cached on ``self``), a list/dict/set attribute mutated (``self.seen.append(x)``), a buffer
  re-assigned (``self.ema = 0.9 * self.ema + ...``; in-place buffer updates are replayed), a plain
  tensor attribute (not a parameter or buffer), or a tensor directly inside a list/tuple/dict
  attribute, written in place (``self.total.add_(x)``, ``self.slots[0].add_(x)``), a value set on
  a config-like attribute (``self.config.scale = 2``);
- draws from Python's ``random`` module or numpy's global RNG (``random.random()``): Python
  numbers the graph would keep from the traced call (found by comparing both RNGs' states around
  each module's call while exporting);
- reads of a stride or storage offset that export keeps as a symbol: torch 2.13's unflatten puts
  the tensor itself where the symbol is used (:func:`nnbridge.compat.torch.capture.layout_reads`);
- writes to a module global the code reads that holds a plain value, a tensor or a container of
  them (``global CALLS; CALLS += 1``, ``STORE.append(x)``; see
  :mod:`nnbridge.guards.global_state`), found by comparing them around each module's call while
  exporting, as the RNGs are.

:class:`CaptureWatch` notices these while exporting and names the module at fault; extraction
then makes that module opaque (its original code runs eagerly), like a module export cannot trace.
What one eager run of the call shows before exporting (grad-mode changes, skipped sdpa masks,
collected outputs, native fast paths, ``.data`` accesses) is found by :mod:`.eager_checks`.

What cannot be detected: writes to closures, to globals holding other objects or created by the
forward, or to objects not reachable from a module's own ``__dict__`` (a list held by a helper
object), changes inside nested containers (a list inside a dict attribute, a tensor two levels
down), mutating an element of a list in place, printing and other I/O. Such modules are extracted
as graphs and the effect does not happen when the graph runs. A side effect on one module's state
made by an enclosing module's code (``self.child.n += 1``) makes the writer opaque
(:func:`~.eager_checks.state_writer` finds it by one more eager run).

:meth:`CaptureWatch.watching` puts back what export changed on the modules it watched (module
attributes, list/dict attributes export replaced by copies, the watched module globals); the
model's state around extraction's own eager runs is kept by
:func:`nnbridge.guards.preservation.preserved_state`.

*State* here means module state as a forward can change it: each watched module's parameters,
buffers and attributes (:class:`~nnbridge.guards.preservation.ModuleState`), the watched module
globals (:class:`~nnbridge.guards.global_state.GlobalValues`) and Python's and numpy's RNGs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Set as AbstractSet
from typing import Any

import torch

from ..compat.torch.capture import (
    autograd_function_calls,
    compile_queries,
    constant_uses,
    graph_break_calls,
    grad_mode_frozen,
    layout_reads,
    mode_regions,
)
from ..compat.torch.module_dicts import buffers_of, parameters_of
from ..errors import NNBridgeError
from ..guards.global_state import GlobalValues
from ..guards.preservation import ModuleState, _INTERNAL, python_rng_states, snapshot

#: the reason of a module that changes grad mode (found by export's regions or by
#: :func:`~.eager_checks.eager_findings`)
GRAD_MODE_REASON = "changes grad mode (torch.no_grad/enable_grad) inside forward, which a graph cannot keep"


class UnfaithfulCaptureError(NNBridgeError):
    """A module's forward does something a graph would not repeat (the reason names it).

    Attributes:
        grad_mode: the forward changes grad mode or autocast (export must ignore those changes to
            trace through it).
        fix: what the user can do to have the module extracted (None: the default advice).
        holder: for a side effect on module state, the path of the module holding that state
            (the writer may be an enclosing module: see :func:`~.eager_checks.state_writer`); else None.
    """

    def __init__(self, message: str, grad_mode: bool = False, *, fix: str | None = None, holder: str | None = None):
        super().__init__(message)
        self.grad_mode = grad_mode
        self.fix = fix
        self.holder = holder


def _rng_drawn(old: tuple[Any, Any], new: tuple[Any, Any]) -> str | None:
    """Which of :func:`python_rng_states` differ between ``old`` and ``new`` (the first), or None."""
    return next((which for which, a, b in zip(("Python's random module", "numpy.random"), old, new) if a != b), None)


def _own_changes(modules: list[tuple[str, torch.nn.Module]], read: Callable[[], Any],
                 change: Callable[[Any, Any], str | None], *, found: dict[str, str]) -> list[Any]:
    """Hooks recording in ``found[path]`` what ``change(before, after)`` (a description or None)
    finds in ``read()`` across each stretch of a module's own code: from its call (or the return
    of a child it called) to its next child call (or its return). A change is its module's, not
    its callers' nor its children's: a parent drawing a random number before calling a child is
    found too (each module's state is saved in its own frame, so a child's return does not reset
    the parent's and lose the draw).
    For state that cannot be put back (RNG draws). Returns the hook handles."""
    frames: list[list[Any]] = []  # [path, state when its own code last resumed]

    def entered(path: str) -> Callable[..., None]:
        def pre(mod: torch.nn.Module, args: tuple[Any, ...]) -> None:
            now = read()
            if frames:
                caller = frames[-1]
                changed = change(caller[1], now)
                if changed is not None:
                    found.setdefault(caller[0], changed)
            frames.append([path, now])
        return pre

    def left(mod: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        path, resumed = frames.pop()
        now = read()
        changed = change(resumed, now)
        if changed is not None:
            found.setdefault(path, changed)
        if frames:
            frames[-1][1] = now
    return [handle for path, sub in modules
            for handle in (sub.register_forward_pre_hook(entered(path)), sub.register_forward_hook(left))]


class CaptureWatch:
    """Watch one export of ``modules`` (``[(path, module)]``, paths relative to the exported
    module, the exported module first) for what its graphs would drop; ``active`` is the live stack
    of module paths being traced. Use :meth:`watching` around the export, then call :meth:`fault`.

    Module state is compared from the exported module's forward pre-hook to its forward hook, inside
    the trace: torch.export (2.13, non-strict) swaps parameters and buffers for fake tensors while
    tracing and restores module attributes itself afterwards (replacing list/dict attributes by
    copies), so a comparison after export would see nothing (and the copies must be undone).
    """

    def __init__(self, modules: list[tuple[str, torch.nn.Module]], active: list[str], *, known: set[str]):
        self.modules = modules
        self.active = active
        self.known = known  # already opaque: faults in them and below them are not reported again
        self.functions: dict[str, str] = {}
        self.breaks: dict[str, str] = {}
        self.queries: dict[str, tuple[str, str]] = {}
        self.changes: dict[str, list[str]] = {}
        self.draws: dict[str, str] = {}
        self.global_writes: dict[str, str] = {}
        #: ``[(where, value)]`` of the module globals and held objects' attributes the code reads
        #: (see :class:`~nnbridge.guards.global_state.GlobalValues`), as :meth:`watching` found them
        self.read_values: list[tuple[str, Any]] = []
        self._outer: dict[str, ModuleState] = {}

    def registries_put_back(self) -> None:
        """Put every watched module's registered children back as they were when :meth:`watching`
        began. :class:`~.exporting.ExportRoot` calls it when the exported module's call ends, also
        on error: torch.export then puts the modules' attributes back by path
        (``_detect_attribute_assignment``), and would give a module the forward bound in another's
        place (``self.lin = spare``, ``self.blocks[1] = spare``) the attributes of the one it
        replaced, this export's wrappers of its forward included."""
        for state in self._outer.values():
            state.restore_children()

    @contextlib.contextmanager
    def watching(self, frozen: AbstractSet[str]) -> Iterator[None]:
        """Watch the body (one export); module state is restored afterwards, also on error.
        Grad-mode changes made while a ``frozen`` module runs are ignored."""
        outer = self._outer = snapshot(self.modules, clone=False)
        inner: list[dict[str, ModuleState]] = []

        def on_apply(cls: type) -> None:
            if self.active:
                self.functions.setdefault(self.active[-1], cls.__qualname__)

        def on_break(msg: str) -> None:
            if self.active:
                self.breaks.setdefault(self.active[-1], msg)

        def on_query(question: str, asking: str) -> None:
            if self.active:
                self.queries.setdefault(self.active[-1], (question, asking))

        def before(mod: torch.nn.Module, args: tuple[Any, ...]) -> None:
            inner.append(snapshot(self.modules, clone=False))

        def after(mod: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            for path, state in inner.pop().items():
                changed = state.changes()
                if changed:
                    self.changes.setdefault(path, changed)
        root = self.modules[0][1]
        handles = [root.register_forward_pre_hook(before), root.register_forward_hook(after)]
        handles += _own_changes(self.modules, python_rng_states, _rng_drawn, found=self.draws)
        # globals count by a module's whole call, not by stretches: a value set and put back around
        # the children (transformers' output collector) is no write; a child's write is not its callers'
        globals_read = GlobalValues(root)
        self.read_values = [(where, value) for (where, _, _), (value, _, _) in zip(globals_read.entries,
                                                                                globals_read.saved)]
        globals_stack: list[list[tuple[Any, Any, Any]]] = []

        def globals_before(mod: torch.nn.Module, args: tuple[Any, ...]) -> None:
            globals_stack.append(globals_read.state())

        def globals_after(path: str) -> Callable[..., None]:
            def hook(mod: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
                written = globals_read.changed(globals_stack.pop())
                if written is not None:
                    self.global_writes.setdefault(path, written)
                    globals_stack[:] = [globals_read.state()] * len(globals_stack)
            return hook
        if globals_read.entries:
            for path, sub in self.modules:
                handles += [sub.register_forward_pre_hook(globals_before),
                            sub.register_forward_hook(globals_after(path))]
        try:
            # (the shim only while needed: export records grad-mode changes through the original)
            # only while needed: export records no grad-mode change while the shim is in place, and
            # every module changing grad mode was found by the first export (without it)
            frozen_modes = (grad_mode_frozen(lambda: any(p in frozen for p in self.active)) if frozen
                            else contextlib.nullcontext())
            with autograd_function_calls(on_apply), graph_break_calls(on_break), compile_queries(on_query), \
                    frozen_modes:
                yield
        finally:
            for handle in handles:
                handle.remove()
            for state in outer.values():
                state.restore()
            globals_read.restore()
            self._outer = {}

    def faults(self, exported: torch.export.ExportedProgram | None) -> list[tuple[str, UnfaithfulCaptureError]]:
        """Modules (paths) whose graph would differ from their eager code, with the reasons: every
        module changing grad mode or autocast, else the first other fault found; [] if none."""
        def new(fqn: str) -> bool:
            return not any(fqn == k or fqn.startswith(f"{k}.") or not k for k in self.known)
        found: dict[str, UnfaithfulCaptureError] = {}
        for path, kind in mode_regions(exported) if exported is not None else []:
            fqn = path.partition(".")[2] if path.startswith("model.") else ""
            reason = GRAD_MODE_REASON if kind == "grad" else \
                "changes autocast inside forward, which a graph cannot keep"
            if new(fqn) and fqn not in found:
                found[fqn] = UnfaithfulCaptureError(reason, grad_mode=True)
        if found:
            return list(found.items())
        for path, name in layout_reads(exported) if exported is not None else []:
            fqn = path.partition(".")[2] if path.startswith("model.") else ""
            if new(fqn) and fqn not in found:
                found[fqn] = UnfaithfulCaptureError(
                    f"reads a tensor's {'stride' if name == 'sym_stride' else 'storage offset'} as a symbol, which"
                    " torch.export.unflatten (torch 2.13) turns into the tensor itself in the graph")
        if found:
            return list(found.items())
        constants = constant_uses(exported) if exported is not None else []
        graded = _tensors_requiring_grad(self.modules, self.read_values) if constants else {}
        for path, constant, _ in constants if graded else []:
            fqn = path.partition(".")[2] if path.startswith("model.") else ""
            held = graded.get(_storage(constant)) if constant.numel() else None
            if held is not None and new(fqn):
                return [(fqn, UnfaithfulCaptureError(
                    f"reads {held}, which requires grad, other than as a parameter (through a list, dict, plain"
                    " attribute, module global or held object): export lifts it as a constant, so a graph would"
                    " give it no gradient"))]
        guarded = _guarded_storages(self.modules, self.read_values) if constants else set()
        for path, constant, fresh in constants:
            fqn = path.partition(".")[2] if path.startswith("model.") else ""
            if not fresh and constant.numel() and _storage(constant) not in guarded and new(fqn):
                return [(fqn, UnfaithfulCaptureError(UNGUARDED_CONSTANT_REASON.format(
                    shape=tuple(constant.shape), dtype=constant.dtype)))]
        for fqn, name in self.functions.items():
            if new(fqn):
                return [(fqn, UnfaithfulCaptureError(
                    f"calls the custom autograd Function {name}.apply, whose backward a graph would lose"))]
        for fqn, msg in self.breaks.items():
            if new(fqn):
                return [(fqn, UnfaithfulCaptureError(
                    f"calls Dynamo's graph_break({msg!r}) in forward; as graphpatch, nnbridge keeps"
                    " such a module opaque"))]
        for fqn, (question, asking) in self.queries.items():
            if new(fqn):
                return [(fqn, UnfaithfulCaptureError(
                    f"asks {question} in forward ({asking}), which is True while exporting and False in eager"
                    " code: a graph would keep the compiled side of a branch on it"))]
        for fqn, which in self.draws.items():
            if new(fqn):
                return [(fqn, UnfaithfulCaptureError(
                    f"draws from {which} in forward: a graph would keep the values drawn while it was extracted"))]
        for fqn, where in self.global_writes.items():
            if new(fqn):
                return [(fqn, UnfaithfulCaptureError(
                    f"writes {where} in forward (a value read through a module global or an object a module"
                    " holds), a Python side effect a graph does not repeat"))]
        for fqn, changed in self.changes.items():
            if new(fqn):
                return [(fqn, UnfaithfulCaptureError(
                    f"{', '.join(changed)} in forward, a Python side effect a graph does not repeat", holder=fqn))]
        return []


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _followed_tensors(modules: list[tuple[str, torch.nn.Module]],
                      read_values: list[tuple[str, Any]]) -> Iterator[tuple[torch.Tensor, str]]:
    """``(tensor, description)`` of every non-empty tensor a guard follows by identity and values: the
    modules' parameters and buffers, then their tensor attributes (plain, or in a list, tuple or dict),
    then the tensors in ``read_values`` (``[(where, value)]``: module globals and attributes of objects
    a module holds that the code reads)."""
    def named(path: str, name: str) -> str:
        return f"{path}.{name}" if path else name
    for path, module in modules:
        for kind, tensors in (("parameter", parameters_of(module)), ("buffer", buffers_of(module))):
            yield from ((t, f"{kind} '{named(path, n)}'") for n, t in tensors.items()
                        if isinstance(t, torch.Tensor) and t.numel())
    for path, module in modules:
        for name, value in vars(module).items():
            if name not in _INTERNAL:
                described = f"tensor attribute '{named(path, name)}'"
                yield from ((t, described) for t in _held_tensors_in(value) if t.numel())
    for where, value in read_values:
        yield from ((t, f"the tensor '{where}'") for t in _held_tensors_in(value) if t.numel())


def _tensors_requiring_grad(modules: list[tuple[str, torch.nn.Module]],
                            read_values: list[tuple[str, Any]]) -> dict[int, str]:
    """``{storage pointer: description}`` of the followed tensors (``_followed_tensors``) that require grad."""
    found: dict[int, str] = {}
    for tensor, description in _followed_tensors(modules, read_values):
        if tensor.requires_grad:
            found.setdefault(_storage(tensor), description)
    return found


def _guarded_storages(modules: list[tuple[str, torch.nn.Module]], read_values: list[tuple[str, Any]]) -> set[int]:
    """The storage pointers of every followed tensor (``_followed_tensors``)."""
    return {_storage(tensor) for tensor, _ in _followed_tensors(modules, read_values)}


#: the reason of a module whose graph would keep a tensor no guard covers as a constant
UNGUARDED_CONSTANT_REASON = (
    "reads a {shape} {dtype} tensor that is not a parameter, buffer or tensor attribute of a module of the"
    " extracted tree, nor a module global or an attribute of an object a module holds (a module kept out of"
    " the registry, in a plain list or set with object.__setattr__, or a tensor in a closure): export bakes"
    " it into the graph as a constant, and no guard would see it change")


def _held_tensors_in(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _held_tensors_in(item, depth + 1)
    elif depth < 3 and isinstance(value, dict) and not isinstance(value, torch.nn.Module):
        for item in value.values():
            yield from _held_tensors_in(item, depth + 1)
