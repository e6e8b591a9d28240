"""Detect what an exported graph would silently drop, and keep extraction from changing the model.

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
  (:mod:`nnbridge.compat.transformers.mask_skips`; found by :func:`eager_findings`);
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
  them (``global CALLS; CALLS += 1``, ``STORE.append(x)``; see :mod:`.global_state`), found by
  comparing them around each module's call while exporting, as the RNGs are.

:class:`CaptureWatch` notices these while exporting and names the module at fault; extraction
then makes that module opaque (its original code runs eagerly), like a module export cannot trace.

What cannot be detected: writes to closures, to globals holding other objects or created by the
forward, or to objects not reachable from a module's own ``__dict__`` (a list held by a helper
object), changes inside nested containers (a list inside a dict attribute, a tensor two levels
down), mutating an element of a list in place, printing and other I/O. Such modules are extracted
as graphs and the effect does not happen when the graph runs. A side effect on one module's state
made by an enclosing module's code (``self.child.n += 1``) makes the writer opaque
(:func:`state_writer` finds it by one more eager run).

:func:`preserved_state` keeps extraction's own eager runs (observed runs of opaque modules,
example recording) from changing parameters, buffers, module attributes (plain tensor attributes'
values and config-like objects' values included), the watched module globals, the CPU RNG or
Python's and numpy's RNGs.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence, Set as AbstractSet
from typing import Any, NamedTuple

import torch

from ..compat.transformers.mask_skips import mask_skips as mask_skips_seen
from ..compat.torch.tensor_data import data_accesses
from ..compat.transformers.output_capturing import active_collector
from ..guards.global_state import GlobalValues
from ..guards.preservation import (
    ModuleState,
    _INTERNAL,
    preserved_state as preserved_state,
    python_rng_states,
    snapshot,
)
from ..graph.state import state_keys
from ..compat import MODEL_STATE_ATTRIBUTES
from ..compat.nnsight.interleaving import NNSIGHT_MODULE_ATTRIBUTES
from ..compat.torch.capture import (
    autograd_function_calls,
    compile_queries,
    constant_uses,
    grad_mode_changes,
    grad_mode_frozen,
    graph_break_calls,
    layout_reads,
    mode_regions,
    native_fast_path,
    tensor_version,
)
from ..errors import ExtractionError, NNBridgeError

#: ``nn.Module.__dict__`` entries torch manages itself (hooks, children) or nnbridge/nnsight set
#: while extracting; ``_parameters``, ``_buffers`` and ``training`` are compared separately.


#: the reason of a module that changes grad mode (found by export's regions or by :func:`eager_findings`)
GRAD_MODE_REASON = "changes grad mode (torch.no_grad/enable_grad) inside forward, which a graph cannot keep"


def mask_skip_reason(replaced: dict[str, str]) -> str:
    """The reason of a module in which transformers skipped an sdpa mask in eager code while an
    attention function other than transformers' own is registered for it (``replaced``: see
    :func:`nnbridge.compat.transformers.mask_skips.replaced_sdpa_functions`)."""
    functions = ", ".join(f"{function} (as {name!r})" for name, function in sorted(replaced.items()))
    return (f"transformers passes no sdpa mask here in eager code but an explicit one when traced, and {functions}"
            " is not transformers' sdpa function, so a graph could compute other numbers")


#: What to do about :func:`mask_skip_reason`.
MASK_SKIP_FIX = ("Register the attention function under a name of its own (AttentionInterface.register('my_attention',"
                 " f) and attn_implementation='my_attention': transformers then builds no mask, traced or not), or"
                 " use transformers' sdpa.")


class UnfaithfulCaptureError(NNBridgeError):
    """A module's forward does something a graph would not repeat (the reason names it).

    Attributes:
        grad_mode: the forward changes grad mode or autocast (export must ignore those changes to
            trace through it).
        fix: what the user can do to have the module extracted (None: the default advice).
        holder: for a side effect on module state, the path of the module holding that state
            (the writer may be an enclosing module: see :func:`state_writer`); else None.
    """

    def __init__(self, message: str, grad_mode: bool = False, fix: str | None = None, holder: str | None = None):
        super().__init__(message)
        self.grad_mode = grad_mode
        self.fix = fix
        self.holder = holder


def _rng_drawn(old: tuple[Any, Any], new: tuple[Any, Any]) -> str | None:
    """Which of :func:`python_rng_states` differ between ``old`` and ``new`` (the first), or None."""
    return next((which for which, a, b in zip(("Python's random module", "numpy.random"), old, new) if a != b), None)


def _own_changes(modules: list[tuple[str, torch.nn.Module]], read: Callable[[], Any],
                 change: Callable[[Any, Any], str | None], found: dict[str, str]) -> list[Any]:
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

    def __init__(self, modules: list[tuple[str, torch.nn.Module]], active: list[str], known: set[str]):
        self.modules = modules
        self.active = active
        self.known = known  # already opaque: faults in them and below them are not reported again
        self.functions: dict[str, str] = {}
        self.breaks: dict[str, str] = {}
        self.queries: dict[str, tuple[str, str]] = {}
        self.changes: dict[str, list[str]] = {}
        self.draws: dict[str, str] = {}
        self.global_writes: dict[str, str] = {}

    @contextlib.contextmanager
    def watching(self, frozen: AbstractSet[str]) -> Iterator[None]:
        """Watch the body (one export); module state is restored afterwards, also on error.
        Grad-mode changes made while a ``frozen`` module runs are ignored."""
        outer = snapshot(self.modules, clone=False)
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
        handles += _own_changes(self.modules, python_rng_states, _rng_drawn, self.draws)
        # globals count by a module's whole call, not by stretches: a value set and put back around
        # the children (transformers' output collector) is no write; a child's write is not its callers'
        globals_read = GlobalValues(root)
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
        graded = _tensors_requiring_grad(self.modules)
        for path, constant in constant_uses(exported) if exported is not None and graded else []:
            fqn = path.partition(".")[2] if path.startswith("model.") else ""
            held = graded.get(_storage(constant)) if constant.numel() else None
            if held is not None and new(fqn):
                return [(fqn, UnfaithfulCaptureError(
                    f"reads {held}, which requires grad, other than as a parameter (through a list, dict or plain"
                    " attribute): export lifts it as a constant, so a graph would give it no gradient"))]
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


def _tensors_requiring_grad(modules: list[tuple[str, torch.nn.Module]]) -> dict[int, str]:
    """``{storage pointer: description}`` of the tensors requiring grad the modules hold: their
    parameters, and tensors in their attributes (plain, or in a list, tuple or dict)."""
    found: dict[int, str] = {}
    for path, module in modules:
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.requires_grad and parameter.numel():
                found.setdefault(_storage(parameter), f"parameter '{f'{path}.{name}' if path else name}'")
    for path, module in modules:
        for name, value in vars(module).items():
            if name in _INTERNAL:
                continue
            for tensor in _held_tensors_in(value):
                if tensor.requires_grad and tensor.numel():
                    found.setdefault(_storage(tensor), f"tensor attribute '{f'{path}.{name}' if path else name}'")
    return found


def _held_tensors_in(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _held_tensors_in(item, depth + 1)
    elif depth < 3 and isinstance(value, dict) and not isinstance(value, torch.nn.Module):
        for item in value.values():
            yield from _held_tensors_in(item, depth + 1)


def _run_with_call_stack(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                         grad_enabled: bool, active: list[str], watches: Sequence[contextlib.AbstractContextManager[Any]],
                         boundary: Callable[[], None] | None = None,
                         entering: Callable[[str, Any, Any], None] | None = None) -> bool:
    """One eager run of the call under ``grad_enabled`` with ``watches`` entered, keeping ``active``
    the stack of the running modules' paths (the root is ``""``) and calling ``boundary()`` at every
    module-call boundary, before the stack changes, and ``entering(path, args, kwargs)`` as a
    module is entered (``active`` still its caller's). Module state and random state are put back
    after the run (:func:`preserved_state`). False when the run raised."""
    from ..graph.module_tree import named_real_modules
    from .recording import observed_run
    from ..graph.kinds import HookKind

    modules = list(named_real_modules(module))

    def enter(fqn: str) -> Any:
        def pre(mod: torch.nn.Module, a: Any, k: Any) -> None:
            if boundary is not None:
                boundary()
            if entering is not None:
                entering(fqn, a, k)
            active.append(fqn)
        return pre

    def leave(mod: torch.nn.Module, a: Any, k: Any, out: Any) -> None:
        if boundary is not None:
            boundary()
        active.pop()
    hooks = [hook for fqn, sub in modules for hook in ((sub, HookKind.PRE, enter(fqn)), (sub, HookKind.POST, leave))]
    try:
        with contextlib.ExitStack() as stack:  # (the run puts module state back itself)
            for watch in watches:
                stack.enter_context(watch)
            observed_run(module, args, kwargs, hooks, grad=grad_enabled)
    except Exception:  # noqa: BLE001 - the callers fall back to what export finds
        return False
    return True


def state_writer(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], holder: str,
                 grad_enabled: bool) -> str:
    """The path of the module whose own code changed ``holder``'s state (see :meth:`ModuleState.changes`)
    in one eager run of the call: the module running between the two module-call boundaries across
    which the state changed (``holder`` itself, or an enclosing module writing its child's
    attribute, ``self.child.n += 1``). ``holder`` when the run shows no change or raises. Module
    state and random state are put back after the run (:func:`preserved_state`)."""
    from ..graph.module_tree import named_real_modules

    target = dict(named_real_modules(module))[holder]  # (paths as export's watch named them)
    active: list[str] = []
    state = [ModuleState(target, clone=False)]
    writers: list[str] = []

    def check() -> None:  # the code run since the last boundary is the innermost active module's
        if not writers and state[0].changes():
            writers.append(active[-1] if active else "")
        state[0] = ModuleState(target, clone=False)
    if not _run_with_call_stack(module, args, kwargs, grad_enabled, active, (), boundary=check):
        return holder
    return writers[0] if writers else holder


class EagerFindings(NamedTuple):
    """What one eager run of a call shows before exporting it (:func:`eager_findings`).

    Attributes:
        grad_mode: paths of the modules (the root ``""`` included: it runs eagerly, there is no
            caller's graph to trace it into) whose code changed grad mode.
        mask_skips: paths of the modules (the root ``""`` included) running when transformers
            skipped building an sdpa attention mask (see :mod:`nnbridge.compat.transformers.mask_skips`).
        capturing: paths of the modules (the root ``""`` included) to run opaque because their
            code, or the code of a module they call with a stateful argument, collects submodules'
            outputs with transformers' hooks (``output_attentions=True``, see
            :mod:`nnbridge.compat.transformers.output_capturing`): as export finds them (a child entered while
            another collector is active than when the module itself was entered), and as it then
            moves up from a module called with a stateful argument (a stub could not write its
            state) to its caller.
        fast_paths: ``(path, native op)`` of the modules whose eager call may run a native fast
            path a graph would not (``nn.MultiheadAttention`` in eval mode without grad, see
            :func:`nnbridge.compat.torch.capture.native_fast_path`).
        data_access: paths of the modules (the root ``""`` included) whose own code read or
            assigned a tensor's ``.data`` (see :data:`DATA_ACCESS_REASON`).
    """

    grad_mode: list[str]
    mask_skips: list[str]
    capturing: list[str] = []
    fast_paths: list[tuple[str, str]] = []
    data_access: list[str] = []


#: the reason of a module whose code reads or assigns ``tensor.data`` (found by :func:`eager_findings`)
DATA_ACCESS_REASON = ("reads or assigns a tensor's .data in forward (an alias outside autograd whose writes bump no"
                      " version counter), which torch.export cannot trace")


def eager_findings(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   grad_enabled: bool) -> EagerFindings:
    """One eager run of the call under ``grad_enabled``, watching which module runs when:

    - the grad mode changes: export would record grad-mode regions for that module
      (:meth:`CaptureWatch.faults`); found before exporting, one export traces through it (a
      Llama's rotary embedding is ``@torch.no_grad()``) instead of a second one after the first
      found it;
    - transformers skips building an sdpa attention mask, which a graph would build (see
      :mod:`nnbridge.compat.transformers.mask_skips`);
    - transformers starts collecting submodules' outputs with hooks (found before exporting, the
      module is stubbed from the first export on instead of after it failed);
    - a module may take a native fast path (``nn.MultiheadAttention``), which a trace does not;
    - a module's code touches a tensor's ``.data`` (export fails on it, at the root: found here,
      only that module is stubbed).

    Module state and random state are put back after the run (:func:`preserved_state`). The
    lists are empty when the eager run raises (export reports what the run could not show)."""
    active: list[str] = []
    grad_mode: dict[str, None] = {}
    mask_skips: dict[str, None] = {}
    capturing: dict[str, None] = {}
    collectors: list[Any] = []  # the collector active when the module at each depth was entered
    stateful: set[str] = set()  # modules entered with a stateful argument
    fast_paths: dict[str, str] = {}
    data_access: dict[str, None] = {}

    def touched(tensor: torch.Tensor) -> None:
        data_access.setdefault(active[-1] if active else "")

    def entering(fqn: str, a: Any, k: Any) -> None:
        op = native_fast_path(module.get_submodule(fqn) if fqn else module, a, k)
        if op is not None:
            fast_paths.setdefault(fqn, op)
        collector, depth = active_collector(), len(active)
        if collector is not None and depth and collectors[depth - 1] is not collector:
            opaque = depth - 1
            while opaque > 0 and active[opaque] in stateful:
                opaque -= 1
            capturing.setdefault(active[opaque])
        del collectors[depth:]
        collectors.append(collector)
        if state_keys(a, k):
            stateful.add(fqn)

    def changed() -> None:
        if active:
            grad_mode.setdefault(active[-1])

    def skipped() -> None:
        mask_skips.setdefault(active[-1] if active else "")
    if not _run_with_call_stack(module, args, kwargs, grad_enabled, active,
                                (grad_mode_changes(changed), mask_skips_seen(skipped), data_accesses(touched)),
                                entering=entering):
        return EagerFindings([], [])
    return EagerFindings(list(grad_mode), list(mask_skips), list(capturing), list(fast_paths.items()),
                         list(data_access))
