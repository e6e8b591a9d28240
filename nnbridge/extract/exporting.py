"""torch.export of a module with every submodule's call signature kept, and failure attribution.

:func:`export_module` exports a root (non-strict, the caller's grad mode, dynamic sizes), with
the submodules that cannot be traced stubbed by their recorded outputs. A failure is attributed
to the innermost submodule running when it happened (:class:`ModuleFailure`), so that one module
becomes opaque and the rest stays a graph; outputs captured by transformers' ``OutputRecorder``
make the caller opaque instead (:class:`CapturingOutputs`). Example::

    exported, states, constants = export_module(model, (ids,), {}, stubs={}, ...)
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Sequence, Set as AbstractSet
from typing import Any, TypeVar

import torch

from .cache_narrowing import narrowing
from .capture_watch import CaptureWatch, UnfaithfulCaptureError
from .eager_checks import state_writer
from ..graph.state import plain_container
from ..graph.kinds import CONTAINERS, StubKind
from ..graph.locking import calls_unlocked
from ..graph.module_tree import aliases_hidden, named_real_modules, named_registrations, op_points_hidden
from .recording import copy_inputs, stub_output
from .sibling_roots import RootWatch
from .reuse_plan import ReuseFallback, ReusePlan, cache_indices
from .sibling_stubs import sibling_stub
from .watched_attributes import reads_watched
from ..graph.state import Key, UntouchedLayers, argument, state_keys, states_returned
from ..compat.transformers import cache_layers
from ..compat.transformers.cache_updates import CacheTrace, cache_updates_traced
from ..compat.torch.export import export
from ..compat.transformers.output_capturing import active_collector
from ..compat.torch.pytree import pytree
from ..errors import ExtractionError


class ExportRoot(torch.nn.Module):
    """Export root whose child ``model`` is the user's module, so the module's own call signature
    is preserved like every other submodule's. When the module is called with stateful arguments
    (a transformers Cache), the root returns ``(output, [tensors each argument holds after the
    call])``: the state the module wrote stays live in the program (only the module's own graph is
    built, so the extra outputs change nothing else).

    ``returned``, when set, is called as the module's call ends, also on error (a capture watch's
    :meth:`~.capture_watch.CaptureWatch.registries_put_back`)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.model = module
        self.returned: Callable[[], None] | None = None

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            output = self.model(*args, **kwargs)
        finally:
            if self.returned is not None:
                self.returned()
        keys = state_keys(args, kwargs)
        if not keys:
            return output
        # the state the module wrote into its stateful arguments (see .state) is an output of the
        # program too: export would drop a tensor the module only stores (a sliding-window cache
        # layer's truncated keys), leaving None where eager leaves the tensor
        written = [pytree.tree_leaves(argument(args, kwargs, key)) for key in keys]
        return output, [[leaf for leaf in leaves if isinstance(leaf, torch.Tensor)] for leaves in written]


SCALARS = (bool, int, float, complex, str)


def scalar_stub_caller(module: torch.nn.Module, stubs: dict[str, str], traced: set[str],
                        *, calls: dict[str, list]) -> tuple[str, UnfaithfulCaptureError] | None:
    """The caller of a stub that returned Python scalars, which must then run its own code too.

    A stub replays its recorded output while export traces the caller, so an ``int`` it returned
    (``int(x.argmax())``, a size) would be frozen into the caller's graph as a constant, wrong for
    the next input. Returns ``(caller path, reason)`` for the first such stub whose callers are
    not stubbed already, else None. Modules export traces through (``traced``) return their real
    values (symbolic or specialised), so they are not concerned.
    """
    for fqn in stubs:
        if fqn in traced or stubs[fqn] == StubKind.CUSTOM:
            continue
        values = [leaf for _, _, out in calls.get(fqn, []) for leaf in pytree.tree_leaves(out)
                  if isinstance(leaf, SCALARS)]
        if not values:
            continue
        caller = caller_of(module, fqn)
        if any(other != fqn and (not other or fqn.startswith(f"{other}.")) for other in stubs):
            continue  # an enclosing module already runs its own code
        return caller, UnfaithfulCaptureError(
            f"calls '{fqn}', which runs its own code and returned the Python value {values[0]!r}"
            f" ({type(values[0]).__name__}); a graph would keep the value of the extracted call")
    return None


class CapturingOutputs(Exception):
    """A module's body collects its submodules' outputs with transformers' hooks
    (``output_attentions=True``, ``output_hidden_states=True``): the collected values cross the
    preserved call signatures of the modules in between, which one graph cannot express."""

    def __init__(self, fqn: str):
        super().__init__(
            "transformers collects outputs of its submodules with hooks here (output_attentions or"
            " output_hidden_states); the module runs its own code and its children are graphs")
        self.fqn = fqn


_E = TypeVar("_E", bound=BaseException)


def cause_of(error: BaseException | None, kind: type[_E]) -> _E | None:
    """The exception of type ``kind`` behind ``error`` (itself, or along its causes and contexts:
    export may wrap it), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class ModuleFailure(Exception):
    def __init__(self, fqn: str, error: BaseException, states: dict[str, list[list[Key]]],
                 *, more: Sequence[tuple[str, BaseException]] | None = None):
        super().__init__(fqn)
        self.fqn, self.error, self.states = fqn, error, states
        self.more: Sequence[tuple[str, BaseException]] = more or []  # further modules at fault found by the same export


def _writer(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, fqn: str,
            error: UnfaithfulCaptureError, grad_enabled: bool) -> tuple[str, UnfaithfulCaptureError]:
    """A side effect on ``fqn``'s state is the fault of the module whose code made it (an enclosing
    module writing its child's attribute: its graph would bake the value in); others stay as found."""
    if error.holder is None:
        return fqn, error
    writer = state_writer(module, args, kwargs, holder=error.holder, grad_enabled=grad_enabled)
    if writer == fqn:
        return fqn, error
    where = f"'{fqn}'" if fqn else "the root module"
    return writer, UnfaithfulCaptureError(f"changes the state of {where}: {error}", holder=error.holder)


def caller_of(module: torch.nn.Module, fqn: str) -> str:
    """Path of the module that calls ``fqn`` (its parent, looking through ModuleList/ModuleDict)."""
    parent = fqn.rpartition(".")[0]
    while parent and isinstance(module.get_submodule(parent), CONTAINERS):
        parent = parent.rpartition(".")[0]
    return parent


class _Instruments:
    """What :func:`export_module` installs on the module for one export, and what it records:
    hooks keeping ``active`` (the modules running, innermost last) and ``collectors`` (transformers'
    output collector when each was entered), the stubs replaying ``stubs``' recorded outputs, hooks
    keeping ``seen`` (``{representative: (inputs, output)}``) and the siblings' stubs built from it
    (see :mod:`.reuse_plan`). Installed on creation; :meth:`remove` takes it all off again."""

    def __init__(self, module: torch.nn.Module, stubs: dict[str, str], calls: dict[str, list], *,
                 reuse: ReusePlan, root_watch: RootWatch | None):
        self.module, self.stubs, self.reuse = module, stubs, reuse
        self.active: list[str] = []
        self.collectors: list[dict[str, Any] | None] = []
        self.stub_counters: Counter[str] = Counter()
        self.seen: dict[str, tuple[Any, Any]] = {}
        self.handles: list[Any] = []
        for fqn, sub in named_real_modules(module):
            self.handles.append(sub.register_forward_pre_hook(self._enter(fqn)))
            self.handles.append(sub.register_forward_hook(self._leave))
        for fqn in stubs:
            module.get_submodule(fqn).__dict__["forward"] = self._stub(fqn, calls.get(fqn, []))
        for rep in reuse.representatives():
            self.handles.append(module.get_submodule(rep).register_forward_hook(self._saw(rep), with_kwargs=True))
        reps = tuple(reuse.representatives())
        active = self.active
        self.trace = CacheTrace(rep_active=lambda: bool(root_watch and root_watch.indices)
                                or any(a == r or a.startswith(f"{r}.") for a in active for r in reps))
        self.indices = cache_indices(reuse, module) | (root_watch.indices if root_watch is not None else frozenset())
        self.watched = [*reuse.watched, *(root_watch.watched if root_watch is not None else ())]
        for sibling, rep in reuse.siblings.items():
            rep_modules = frozenset(id(sub) for _, sub in named_real_modules(module.get_submodule(rep)))
            module.get_submodule(sibling).__dict__["forward"] = sibling_stub(
                sibling, rep, self.seen, rebinding=reuse.caches.get(sibling), trace=self.trace, rep_modules=rep_modules)

    def _enter(self, fqn: str) -> Callable[..., None]:
        def hook(mod: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
            collector = active_collector()
            if collector is not None and self.collectors and self.collectors[-1] is not collector:
                # the caller's body started collecting outputs with hooks (output_attentions...)
                raise CapturingOutputs(self.active[-1])
            self.active.append(fqn)
            self.collectors.append(collector)
        return hook

    def _leave(self, mod: torch.nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        self.active.pop()
        self.collectors.pop()

    def _stub(self, fqn: str, recorded: list) -> Callable[..., Any]:
        stub_counters = self.stub_counters

        def stub(*a: Any, _fqn: str = fqn, _recorded: list = recorded, **k: Any) -> Any:
            i = stub_counters[_fqn]
            stub_counters[_fqn] += 1
            return stub_output(a, k, _recorded[min(i, len(_recorded) - 1)][2])
        return stub

    def _saw(self, fqn: str) -> Callable[..., None]:
        def hook(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            self.seen[fqn] = ((args, kwargs), output)
        return hook

    def clear(self) -> None:
        """Forget what an earlier attempt recorded."""
        self.active.clear()
        self.collectors.clear()
        self.stub_counters.clear()
        self.seen.clear()
        self.trace.updates.clear()

    def cache_updates(self) -> contextlib.AbstractContextManager[Any]:
        """The cache updates traced for reuse (see :func:`~.reuse.cache_updates_traced`), when any."""
        return cache_updates_traced(self.trace) if self.reuse.caches or self.indices else contextlib.nullcontext()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for fqn in [*self.stubs, *self.reuse.siblings]:
            self.module.get_submodule(fqn).__dict__.pop("forward", None)


def export_module(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, stubs: dict[str, str],
                  calls: dict[str, list], dynamic: bool, grad_enabled: bool = False,
                  dims: tuple[tuple[int, ...] | None, ...] | None = None,
                  traced: AbstractSet[str] = frozenset(), frozen: AbstractSet[str] = frozenset(),
                  reuse: ReusePlan | None = None, untouched: dict[str, list[UntouchedLayers | None]] | None = None,
                  root_watch: RootWatch | None = None, watch_reads: list[str] | None = None,
                  by_name: bool = False) -> tuple[torch.export.ExportedProgram, bool, dict[str, list[list[Key]]]]:
    """Export once (dynamic, then static on failure); raise ModuleFailure naming the innermost
    module that was running when export failed.

    Every module keeps its call signature and threads the state of stateful arguments (see
    :mod:`.state`). ``stubs`` are replaced by their recorded output; one called with a stateful
    argument (only a custom-extraction module can be: a failing one makes its caller opaque)
    keeps a flat signature, since its recorded output cannot carry the state it would have
    written. ``dims``: the dynamic dimensions of the positional arguments (see
    :func:`dynamic_shapes`). ``traced`` modules will be opaque although export traces them; inside ``frozen`` ones,
    grad-mode changes are ignored (see :mod:`.capture_watch`). Returns the program, whether it is
    dynamic, and the state keys of every threaded call (``{path: [keys per invocation]}``).
    ``reuse``'s siblings are stubbed with outputs shaped as their representative's (see
    :mod:`.reuse_plan`); :class:`~.reuse_plan.ReuseFallback` when unsafe. ``untouched``, when given, is
    filled with the cache layers each threaded call's code never touched (see
    :func:`~.state.states_returned`), for the successful attempt. ``root_watch`` (the module is the
    representative of its siblings, see :mod:`.sibling_roots`) watches its attributes that differ
    between them: their reads, and touches of cache layers other than its own, are put in
    ``watch_reads`` (not raised: they only make the program unshareable); with ``reuse`` siblings
    of its own, any read raises :class:`~.reuse_plan.ReuseFallback` as without ``root_watch``.
    ``by_name`` (see :mod:`.shared_names`; no call passes a stateful argument): every name a module
    is registered under keeps its signature, nothing is hidden or threaded, and the modules' lock
    overrides are off while tracing, so each call is known by the name it went through.
    """
    reuse = reuse or ReusePlan()
    wrapper = ExportRoot(module)
    fqns, threaded = _kept_signatures(module, stubs, calls, by_name=by_name)
    tools = _Instruments(module, stubs, calls, reuse=reuse, root_watch=root_watch)
    narrow = narrowing({sibling: rebinding.index for sibling, rebinding in reuse.caches.items()}) \
        if reuse.caches else None
    try:
        attempts = [True, False] if dynamic else [False]
        last: BaseException | None = None
        states: dict[str, list[list[Key]]] = {}
        for use_dynamic in attempts:
            tools.clear()
            if watch_reads is not None:
                watch_reads.clear()
            if untouched is not None:
                untouched.clear()
            # size-1 dimensions are specialised by export anyway (0/1 specialisation); leaving them
            # out of the spec shortens the export
            shapes = dynamic_shapes(args, kwargs, dims) if use_dynamic else None
            watch = CaptureWatch(list(named_real_modules(module)), tools.active,
                                 known=set(stubs) | traced | set(reuse.siblings))
            wrapper.returned = watch.registries_put_back
            try:
                # non-strict export runs the module's Python code, which mutates a cache passed in
                # (with fake tensors): every attempt traces a fresh copy of the inputs
                # (a container's repeated entry: its owner is stubbed, see .module_tree)
                inputs = copy_inputs((args, kwargs))
                with cache_layers.layer_touches(), states_returned(threaded, untouched, narrow=narrow) as states, \
                        watch.watching(frozen), op_points_hidden(module), \
                        calls_unlocked(wrapper.modules()) if by_name else aliases_hidden(module, in_containers=True), \
                        reads_watched(tools.watched, tools.indices) as reads, tools.cache_updates():
                    exported = export(wrapper, inputs, dynamic_shapes=shapes, preserve_module_call_signature=fqns,
                                      grad_enabled=grad_enabled, duck_sized=custom_pytree_leaves(*inputs))
                reads += tools.trace.uses
                _keep_reads(reads, watching=root_watch is not None and not reuse.siblings, watch_reads=watch_reads)
            except ReuseFallback:
                raise
            except Exception as error:  # noqa: BLE001 - any export failure means fallback
                cause = cause_of(error, ReuseFallback)
                if cause is not None:
                    raise cause from error
                last = error
                capturing = cause_of(error, CapturingOutputs)
                if capturing is not None:  # trying static shapes would not help
                    raise ModuleFailure(capturing.fqn, capturing, states) from error
                failing = tools.active[-1] if tools.active else ""
                continue
            faults = watch.faults(exported)  # traced, but a graph would differ from the eager code
            if faults:
                faults = [_writer(module, args, kwargs, fqn=fqn, error=error, grad_enabled=grad_enabled)
                          for fqn, error in faults]
                raise ModuleFailure(faults[0][0], faults[0][1], states, more=faults[1:])
            return exported, use_dynamic, states
        assert last is not None  # every attempt failed: each set ``last``
        raise ModuleFailure(failing, last, states)
    finally:
        tools.remove()


def _kept_signatures(module: torch.nn.Module, stubs: dict[str, str], calls: dict[str, list], *, by_name: bool = False
                     ) -> tuple[tuple[str, ...], dict[str, torch.nn.Module]]:
    """The paths under :class:`ExportRoot` of the modules whose call signatures the export keeps
    (all but containers, and stubs called with a stateful argument), and ``{path: module}`` of
    those of them that thread the state of stateful arguments (the ones not stubbed). ``by_name``:
    every name of every module, none threading."""
    if by_name:
        names = [n for n, m in named_registrations(module) if not isinstance(m, CONTAINERS)]
        return tuple(f"model.{n}" if n else "model" for n in names), {}
    flat = {fqn for fqn in stubs if any(state_keys(a, k) for a, k, _ in calls.get(fqn, []))}
    preserved = {n: m for n, m in named_real_modules(module) if not isinstance(m, CONTAINERS) and n not in flat}
    fqns = tuple(f"model.{n}" if n else "model" for n in preserved)
    return fqns, {n: m for n, m in preserved.items() if n not in stubs}


def _keep_reads(reads: list[str], *, watching: bool, watch_reads: list[str] | None) -> None:
    """Put the reads export made of attributes that differ between siblings (see :mod:`.reuse_plan`) in
    ``watch_reads`` when the export is ``watching`` them (a representative root without reuse
    siblings of its own, see :mod:`.sibling_roots`). Raises :class:`~.reuse_plan.ReuseFallback` for any
    read otherwise."""
    if reads and watching and watch_reads is not None:
        watch_reads[:] = sorted(set(reads))
    elif reads:
        raise ReuseFallback(f"export read attributes that differ between siblings: {sorted(set(reads))}")


def _dim_spec(leaf: Any) -> Any:
    # size-1 dimensions are specialised by export anyway (0/1 specialisation); leaving them
    # out of the spec shortens the export
    if isinstance(leaf, torch.Tensor):
        return {i: torch.export.Dim.AUTO for i in range(leaf.dim()) if leaf.shape[i] > 1}
    return None


def _fitting(dims: tuple[tuple[int, ...] | None, ...], args: tuple[Any, ...]) -> tuple[tuple[int, ...] | None, ...]:
    if len(dims) != len(args):
        raise ExtractionError(f"ExtractionOptions.dynamic_dims has {len(dims)} entries but the call has {len(args)}"
                              " positional arguments: give one entry per positional argument (None for a non-tensor).")
    return dims


def _given_dims(arg: Any, entry: tuple[int, ...] | None, position: int) -> Any:
    """The spec of positional argument ``position`` with dynamic dimensions ``entry``."""
    if entry is None:
        return None if not isinstance(arg, torch.Tensor) else {}
    if not isinstance(arg, torch.Tensor):
        raise ExtractionError(f"ExtractionOptions.dynamic_dims[{position}] is {entry!r} but positional argument"
                              f" {position} is a {type(arg).__name__}, not a tensor: give None for it.")
    if any(dim >= arg.dim() for dim in entry):
        raise ExtractionError(f"ExtractionOptions.dynamic_dims[{position}] is {entry!r} but positional argument"
                              f" {position} has {arg.dim()} dimensions: give indices below {arg.dim()}.")
    # (size-1 dimensions are specialised by export anyway, see _dim_spec)
    return {dim: torch.export.Dim.AUTO for dim in entry if arg.shape[dim] > 1}


def custom_pytree_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors inside the call's custom pytree arguments (transformers ``Cache`` objects):
    exported with duck-sized dimensions (see :mod:`nnbridge.compat.torch.duck_sizing`: a cache of many
    layers otherwise brings two tensors' worth of symbols per layer into every export)."""
    return [leaf for value in (*args, *kwargs.values()) if not plain_container(value)
            for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def dynamic_shapes(args: tuple[Any, ...], kwargs: dict[str, Any],
                   dims: tuple[tuple[int, ...] | None, ...] | None = None) -> Any:
    """``Dim.AUTO`` for every dimension of every tensor; a custom pytree argument (a transformers
    ``Cache``) gets the flat list of its leaves' specs, the form export expects for such nodes.
    ``dims`` (:attr:`ExtractionOptions.dynamic_dims`), when given, names the dynamic dimensions of
    each positional argument instead (the others static).

    Raises:
        ExtractionError: ``dims`` does not fit ``args`` (another length, dimensions for a
            non-tensor, an index past a tensor's rank).
    """
    if dims is not None:
        return tuple(_given_dims(arg, entry, position) for position, (arg, entry)
                     in enumerate(zip(args, _fitting(dims, args), strict=True))), \
            dynamic_shapes((), kwargs)[1]

    def spec(value: Any) -> Any:
        if pytree.is_namedtuple_instance(value):
            # a namedtuple, whose class may refuse dim specs as fields (``PackedSequence``): export
            # matches a plain tuple of its fields' specs
            return tuple(spec(item) for item in value)
        if type(value) in (list, tuple):
            return type(value)(spec(item) for item in value)
        if type(value) is dict:
            return {key: spec(item) for key, item in value.items()}
        if plain_container(value):
            return pytree.tree_map(_dim_spec, value)
        return [_dim_spec(leaf) for leaf in pytree.tree_leaves(value)]
    return tuple(spec(a) for a in args), {k: spec(v) for k, v in kwargs.items()}
