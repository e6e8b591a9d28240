"""One eager run of a call, watched for what its export would not show or would drop, before
exporting (:func:`eager_findings`) or after an export found a side effect on module state
(:func:`state_writer`).

:func:`eager_findings` tells, per module running at the time: a grad-mode change (export would
record a grad-mode region; found first, one export traces through it), transformers skipping an
sdpa attention mask that a traced call builds (:data:`MASK_SKIP_FIX`), transformers collecting
submodules' outputs with hooks, a native fast path a trace does not take, and a read or
assignment of a tensor's ``.data`` (:data:`DATA_ACCESS_REASON`). :func:`state_writer` names the
module whose own code changed another module's state (``self.child.n += 1``). What export itself
shows is watched by :mod:`.capture_watch`.

*State* here means module state as a forward can change it (a module's parameters, buffers and
attributes, :class:`~nnbridge.guards.preservation.ModuleState`), and the *stateful* arguments
whose state a graph threads (:func:`nnbridge.graph.state.state_keys`). Each run puts module state
and random state back afterwards (:func:`nnbridge.guards.preservation.preserved_state`, through
:func:`~.recording.observed_run`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..compat.torch.capture import grad_mode_changes, native_fast_path
from ..compat.torch.grad_reads import grad_mode_reads
from ..compat.torch.tensor_data import data_accesses
from ..compat.transformers.mask_skips import mask_skips as mask_skips_seen
from ..compat.transformers.output_capturing import active_collector
from ..graph.state import state_keys
from ..guards.preservation import ModuleState
from .argument_writes import ArgumentWrites


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


def _run_with_call_stack(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                         grad_enabled: bool, active: list[str], watches: Sequence[contextlib.AbstractContextManager[Any]],
                         boundary: Callable[[], None] | None = None,
                         entering: Callable[[str, Any, Any], None] | None = None,
                         leaving: Callable[[], None] | None = None, output: list[Any] | None = None) -> bool:
    """One eager run of the call under ``grad_enabled`` with ``watches`` entered, keeping ``active``
    the stack of the running modules' paths (the root is ``""``) and calling ``boundary()`` at every
    module-call boundary, before the stack changes, ``entering(path, args, kwargs)`` as a
    module is entered (``active`` still its caller's) and ``leaving()`` as it returns (``active``
    still its own). Module state and random state are put back
    after the run (:func:`~nnbridge.guards.preservation.preserved_state`). The run's output is
    appended to ``output``. False when the run raised."""
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
        if leaving is not None:
            leaving()
        active.pop()
    hooks = [hook for fqn, sub in modules for hook in ((sub, HookKind.PRE, enter(fqn)), (sub, HookKind.POST, leave))]
    try:
        with contextlib.ExitStack() as stack:  # (the run puts module state back itself)
            for watch in watches:
                stack.enter_context(watch)
            returned = observed_run(module, args, kwargs, hooks=hooks, grad=grad_enabled, reset=active.clear)
    except Exception:  # noqa: BLE001 - the callers fall back to what export finds
        return False
    if output is not None:
        output.append(returned)
    return True


def state_writer(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, holder: str,
                 grad_enabled: bool) -> str:
    """The path of the module whose own code changed ``holder``'s state (see :meth:`ModuleState.changes`)
    in one eager run of the call: the module running between the two module-call boundaries across
    which the state changed (``holder`` itself, or an enclosing module writing its child's
    attribute, ``self.child.n += 1``). ``holder`` when the run shows no change or raises. Module
    state and random state are put back after the run
    (:func:`~nnbridge.guards.preservation.preserved_state`)."""
    from ..graph.module_tree import named_real_modules

    target = dict(named_real_modules(module))[holder]  # (paths as export's watch named them)
    active: list[str] = []
    state = [ModuleState(target, clone=False)]
    writers: list[str] = []

    def check() -> None:  # the code run since the last boundary is the innermost active module's
        if not writers and state[0].changes():
            writers.append(active[-1] if active else "")
        state[0] = ModuleState(target, clone=False)
    if not _run_with_call_stack(module, args, kwargs, grad_enabled=grad_enabled, active=active, watches=(),
                                boundary=check):
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
        grad_reads: paths of the modules (the root ``""`` included) whose code read grad mode
            (see :mod:`nnbridge.compat.torch.grad_reads`) or enabled grad while it was enabled
            (``torch.enable_grad()``); None when unknown (the run raised, or another profile
            function was set: ``cProfile``, a debugger).
        autograd_reads: paths of the modules (the root ``""`` included) whose code reads a
            tensor's ``grad``, ``grad_fn`` or ``is_leaf``, or sets a tensor hook
            (:data:`AUTOGRAD_READ_REASON`).
        seeding: paths of the modules (the root ``""`` included) whose code sets the state of a
            ``torch.Generator`` (:data:`SEEDING_REASON`).
        state_reads: paths of the modules (the root ``""`` included) whose code reads process-wide
            torch state no call structure records (:data:`STATE_READ_REASON`).
        argument_writes: paths of the modules (the root ``""`` included) that write into a
            container their call was passed, and of the callers it passed through
            (:mod:`.argument_writes`, :data:`ARGUMENT_WRITE_REASON`).
        storage_reads: paths of the modules (the root ``""`` included) whose code names where a
            tensor lies in memory (:data:`STORAGE_READ_REASON`).
        replaced: paths of the modules (the root ``""`` included) whose code calls a torch function
            whose module global was replaced (:data:`REPLACED_REASON`).
        printing: paths of the modules (the root ``""`` included) whose code prints, writes to a
            stream, shows a warning or hands a log record to handlers (:data:`OUTPUT_REASON`, see
            :mod:`nnbridge.compat.output`).
        output: ``(what the run returned,)``; ``()`` when the run raised.
    """

    grad_mode: list[str]
    mask_skips: list[str]
    capturing: list[str] = []
    fast_paths: list[tuple[str, str]] = []
    data_access: list[str] = []
    grad_reads: list[str] | None = None
    autograd_reads: list[str] = []
    seeding: list[str] = []
    state_reads: list[str] = []
    argument_writes: list[str] = []
    storage_reads: list[str] = []
    replaced: list[str] = []
    printing: list[str] = []
    output: tuple[Any, ...] = ()


#: the reason of a module whose code reads or assigns ``tensor.data`` (found by :func:`eager_findings`)
DATA_ACCESS_REASON = ("reads or assigns a tensor's .data in forward (an alias outside autograd whose writes bump no"
                      " version counter), which torch.export cannot trace")


#: the reason of a module whose code names a tensor's ``grad``, ``grad_fn`` or ``is_leaf``, or a tensor
#: hook's ``register_hook`` or ``retain_grad`` (found by :func:`eager_findings`)
AUTOGRAD_READ_REASON = ("reads a tensor's grad, grad_fn or is_leaf, or sets a tensor hook (register_hook, retain_grad),"
                        " in forward: a graph would keep what they were while it was extracted (a parameter's .grad"
                        " before the first backward, whether an argument is a leaf) and registers no tensor hook")
#: the reason of a module whose code seeds or sets a ``torch.Generator`` (found by :func:`eager_findings`)
SEEDING_REASON = ("sets the state of a torch random generator in forward (torch.manual_seed, torch.set_rng_state): a"
                  " graph would draw from the generator without setting it")
#: the reason of a module that writes, or whose callee writes, into a container it was passed
#: (found by :func:`eager_findings`)
ARGUMENT_WRITE_REASON = ("writes into a list, dict or set it was passed in forward, or passes one to a module that does"
                         " (acts.append(h), store['h'] = h): a graph rebuilds its arguments' containers and would"
                         " write into its own copies")
#: the reason of a module whose code names where a tensor lies in memory (found by :func:`eager_findings`)
STORAGE_READ_REASON = ("reads where a tensor lies in memory in forward (storage_offset, data_ptr, untyped_storage,"
                       " is_shared, _version), which no call structure records: a graph would keep what they were"
                       " while it was extracted")
#: the reason of a module whose code calls a torch function through a replacement of its global
#: (found by :func:`eager_findings`)
REPLACED_REASON = ("calls a torch function whose global in its module was replaced (F.softmax = wrapper): the"
                   " original hands the replacement to __torch_function__ by that name, and torch.export traces"
                   " the wrapper once per torch-function mode, so a graph would repeat its ops")
#: the reason of a module whose code writes output (found by :func:`eager_findings`)
OUTPUT_REASON = ("writes output in forward (print, a write to sys.stdout or a file, a shown warning, a handled log"
                 " record): a graph would not repeat it")
#: the reason of a module whose code calls one of ``STATE_QUERIES`` (found by :func:`eager_findings`)
STATE_READ_REASON = ("reads process-wide torch state in forward that no call structure records (torch.get_num_threads,"
                     " torch.initial_seed, torch.get_float32_matmul_precision, torch.is_anomaly_enabled, a"
                     " torch.backends flag such as cudnn.enabled): a graph would keep what it read while it was"
                     " extracted")


def eager_findings(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                   grad_enabled: bool) -> EagerFindings:
    """One eager run of the call under ``grad_enabled``, watching which module runs when:

    - the grad mode changes: export would record grad-mode regions for that module
      (:meth:`~.capture_watch.CaptureWatch.faults`); found before exporting, one export traces through it (a
      Llama's rotary embedding is ``@torch.no_grad()``) instead of a second one after the first
      found it;
    - transformers skips building an sdpa attention mask, which a graph would build (see
      :mod:`nnbridge.compat.transformers.mask_skips`);
    - transformers starts collecting submodules' outputs with hooks (found before exporting, the
      module is stubbed from the first export on instead of after it failed);
    - a module may take a native fast path (``nn.MultiheadAttention``), which a trace does not;
    - a module's code touches a tensor's ``.data`` (export fails on it, at the root: found here,
      only that module is stubbed);
    - a module's code reads grad mode (see :mod:`nnbridge.compat.torch.grad_reads`): only a graph
      of code that reads none serves calls made under another grad mode;
    - a module's code reads a tensor's ``grad``, ``grad_fn`` or ``is_leaf``, sets a tensor hook
      (``register_hook``, ``retain_grad``), sets the state of a torch random generator, or reads
      process-wide torch state no call structure records (:data:`AUTOGRAD_READ_REASON`,
      :data:`SEEDING_REASON`, :data:`STATE_READ_REASON`);
    - a module writes into a container its call was passed (:mod:`.argument_writes`).

    Module state and random state are put back after the run
    (:func:`~nnbridge.guards.preservation.preserved_state`). The lists are empty when the eager
    run raises (export reports what the run could not show)."""
    active: list[str] = []
    grad_mode: dict[str, None] = {}
    mask_skips: dict[str, None] = {}
    capturing: dict[str, None] = {}
    collectors: list[Any] = []  # the collector active when the module at each depth was entered
    stateful: set[str] = set()  # modules entered with a stateful argument
    fast_paths: dict[str, str] = {}
    data_access: dict[str, None] = {}
    grad_reads: dict[str, None] = {}
    unwatched: list[bool] = []  # grad-mode reads could not be watched (another profile function is set)
    autograd_reads: dict[str, None] = {}
    seeding: dict[str, None] = {}
    state_reads: dict[str, None] = {}
    printing: dict[str, None] = {}
    storage_reads: dict[str, None] = {}
    replaced: dict[str, None] = {}
    writes = ArgumentWrites()

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
        writes.entering(depth, a, k)

    def skipped() -> None:
        mask_skips.setdefault(active[-1] if active else "")

    def marker(found: dict[str, None], *, stubbed: bool = False) -> Callable[[], None]:
        def mark() -> None:  # (what runs outside every module is the run's own machinery)
            if active:
                depth = len(active) - 1
                # a module to run eagerly that was called with a stateful argument (a cache): its
                # caller runs eagerly instead, as for ``capturing`` (a stub cannot write its state)
                while stubbed and depth > 0 and active[depth] in stateful:
                    depth -= 1
                found.setdefault(active[depth])
        return mark

    def stub(found: dict[str, None]) -> Callable[[], None]:
        return marker(found, stubbed=True)
    read = marker(grad_reads)
    watches = (grad_mode_changes(marker(grad_mode), on_enable=read), mask_skips_seen(skipped), data_accesses(touched),
               grad_mode_reads(read, on_unwatched=lambda: unwatched.append(True), on_autograd=stub(autograd_reads),
                               on_seeding=stub(seeding), on_query=stub(state_reads), on_output=stub(printing),
                               on_storage=stub(storage_reads), on_replaced=stub(replaced)))
    output: list[Any] = []
    if not _run_with_call_stack(module, args, kwargs, grad_enabled=grad_enabled, active=active, watches=watches,
                                entering=entering, leaving=lambda: writes.leaving(active), output=output):
        return EagerFindings([], [])
    return EagerFindings(list(grad_mode), list(mask_skips), list(capturing), list(fast_paths.items()),
                         list(data_access), None if unwatched else list(grad_reads), list(autograd_reads),
                         list(seeding), list(state_reads), list(writes.writers), list(storage_reads), list(replaced), list(printing),
                         tuple(output))
