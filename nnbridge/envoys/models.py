"""Drop-in replacements for nnsight's model classes: ``from nnbridge import NNsight``.

``nnbridge.NNsight(module)`` is ``nnsight.NNsight(module)`` whose module is bridged in place
(:func:`nnbridge.bridge`, deferred): the first trace of a call structure extracts its graphs,
from that trace's own inputs, and mirrors the new op points as envoys before the trace body
runs, so ``model.transformer.h[0].attn.softmax.output`` works in that same trace. Later traces
with the same call structure reuse the extraction. ``model.extract(*inputs)`` does it up front.

A trace whose workers read no op envoy (only module inputs and outputs: see :mod:`.op_reads`) runs
the model's own code, as nnsight would, and extracts nothing. A trace whose op reads are all read
off modules its code names (:func:`.op_reads.op_owners`) extracts those modules alone
(:meth:`~nnbridge.inplace.bridging.Bridge.lazily`, after one warm-up call that leaves buffers and
random state as they were); the rest of the model runs its own code.

Generation: the first ``generate`` trace of a call structure runs generation once beforehand
(no grad, random state and buffers restored) so the prefill and decode steps are extracted before the trace
body asks for their ops; a module's op envoys serve every step (``tracer.iter``).
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Self

import nnsight
import torch
from nnsight.modeling.language import LanguageModel as _NNsightLanguageModel
from nnsight.modeling.transformers import TransformersModel as _NNsightTransformersModel

from ..inplace.bridging import Bridge, bridge, bridge_of, state_restored
from ..extract.recording import copy_inputs
from ..errors import NNBridgeError
from ..compat.torch.module_dicts import modules_of
from ..compat.nnsight.loading import PreprocessorSources
from ..compat.nnsight.interleaving import (
    OutOfOrderError,
    dispatch_if_lazy,
    mirror_envoys,
    pending_workers,
    repoint_envoys,
    scalar_safe_batcher,
    wrapped_modules,
)
from ..compat.nnsight.models import ModelSlots, wrapped_module
from ..compat.nnsight.source import follow_classes, sourced
from ..graph.op_point import OpPoint, OpPointContainer
from .envoy import BridgeEnvoy, tree_repr
from .op_reads import op_owners
from .tracer import op_cache_tracer
from .remote import NNsightRequest, is_op_point

#: The default ``envoys=`` mapping: op points get BridgeEnvoys, modules nnsight's own Envoy.
OP_ENVOYS = {OpPoint: BridgeEnvoy, OpPointContainer: BridgeEnvoy}

if TYPE_CHECKING:  # the mixin only ever precedes an nnsight.Envoy subclass (nnsight ships no types: Any)
    from nnsight import Envoy as _EnvoyBase
else:
    _EnvoyBase = object


#: Added to an error raised in a trace run without graphs (what a runtime-built op name meets).
_EAGER_NOTE = ("nnbridge ran this trace on the model's own code, without its graphs, because the trace's code"
               " names no op envoy. If it reaches an op through a name built at run time, set"
               " `model.eager_module_traces = False` to run every trace on the graphs.")


_REQUESTED = re.compile(r"'([^']+)' was requested")


def note_source_and_ops(error: BaseException, model: torch.nn.Module) -> None:
    """Add a note to nnsight's ``OutOfOrderError`` when the location it names is an op of a module
    whose ``.source`` was touched, or a ``.source`` operation of a module that has op points: one
    call of a module runs either its graph (ops) or nnsight's instrumented forward (``.source``
    operations), so a trace asking both of one call gets the error for whichever came second."""
    found = _REQUESTED.search(str(error))
    if found is None:
        return
    location = found.group(1).removeprefix("model.")
    module_path, marker, _ = location.partition(".source.")
    kind = "a .source operation"
    if not marker:  # an op: <module>.<op>.<output|input|inputs>...
        module_path, kind = ".".join(location.split(".")[:-3]), "an op"
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        return
    if not (sourced(module) if kind == "an op"
            else any(m is not None and is_op_point(m) for m in modules_of(module).values())):
        return
    error.add_note(
        f"nnbridge: if this trace also reads {'ops' if kind != 'an op' else '.source operations'} of"
        f" '{module_path}' in the same call: each call of a module runs either its graph (ops) or"
        " nnsight's .source forward (.source operations), not both, so the one asked second is never"
        " reached. Read them in different calls (separate traces, invokes or generation steps).")


class _Bridged(ModelSlots, _EnvoyBase):
    """Mixin over an nnsight model class (``NNsight``, ``TransformersModel``...).

    Attributes:
        eager_module_traces: run a trace whose code names no op envoy (only module inputs and
            outputs: see :mod:`.op_reads`) on the model's own code, extracting nothing (default
            True; class-wide, or per wrapper). False runs every trace on the graphs. Also governs
            a plain call of the wrapper outside a trace (``model(input_ids)``): with no patch or
            torch hook on an op point it runs the model's own code, as nnsight does.
        lazy_op_traces: extract only the modules whose op envoys a trace reads, when the trace's
            code names them off known modules (``model.transformer.h[0].attn.softmax``; see
            :func:`.op_reads.op_owners`); the rest of the model runs its own code (default True;
            needs ``eager_module_traces``). False extracts the whole model for any op read.
    """

    #: marks nnbridge's front-ends for :func:`.envoy.bridged_hint` (which cannot import this module)
    NNBRIDGE_FRONT_END = True

    eager_module_traces: bool = True
    lazy_op_traces: bool = True

    # written through self.__dict__ (past nnsight.Envoy.__setattr__) in __init__:
    _nnbridge_warmed: set[Hashable]  # the non-forward calls already run once (see _nnbridge_prepare)

    # model: Any as nnsight takes it (a module, an nnsight envoy, a repo id for a lazy LanguageModel)
    def __init__(self, model: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(model, nnsight.Envoy):  # nnbridge.NNsight(nnsight.NNsight(m))
            model = wrapped_module(model)
        # nnsight's ``envoys=`` (a class, or a dict by module class / path suffix) and a subclass's
        # ``envoys`` class attribute are the user's choice and are used as given, for op envoys
        # too (``Envoy._resolve_envoy_class``). When neither is set, module envoys are plain
        # ``nnsight.Envoy`` as in nnsight (its tests check ``type(envoy) is Envoy``) and op envoys,
        # which nnsight does not have, are BridgeEnvoys (``node_path``). ``envoys=BridgeEnvoy``
        # makes every envoy one (op-aware errors on modules too).
        if "envoys" not in kwargs and getattr(type(self), "envoys", None) is None:
            kwargs["envoys"] = OP_ENVOYS
        elif "envoys" not in kwargs:
            kwargs["envoys"] = type(self).envoys
        # a model bridged before it is wrapped: nnsight takes each module's ``forward`` slot, which
        # holds the bridged body, as the module's own (a module-only trace would then recurse
        # between the two): it wraps the model as it was before bridging, and the bodies go back
        # in after
        state = bridge_of(model) if isinstance(model, torch.nn.Module) else None
        with state.detached() if state is not None else contextlib.nullcontext():
            super().__init__(model, *args, **kwargs)
        self.__dict__["_nnbridge_warmed"] = set()
        self._nnbridge_follow_classes()  # each module's calls run the forward of its class at the call
        # op values may be 0-d: served whole to every invoke (see compat.nnsight.interleaving.scalar_safe_batcher)
        self._nnbridge_use_batcher(scalar_safe_batcher)

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        """A copy of the wrapper and of its model, as nnsight copies its wrappers (the envoy's
        ``__getstate__``/``__setstate__``). The model's copy is bridged again and has no op points
        until its first trace (see :mod:`nnbridge.inplace.copies`), so the copied envoy tree is
        re-pointed at it: op envoys appear with the copy's own op points."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        repoint_envoys(copied, wrapped_module(copied))
        return copied

    def __repr__(self) -> str:
        """nnsight's printed tree, each module's ops on one line (see :func:`.envoy.tree_repr`)."""
        return tree_repr(self)

    def trace(self, *args: Any, tracer_cls: type | None = None, **kwargs: Any) -> Any:
        """nnsight's ``trace``; its tracer's ``cache()`` records module envoys only, as nnsight's
        does, unless asked for ops (``tracer.cache(ops=True)``: see :mod:`.tracer`)."""
        return super().trace(*args, tracer_cls=op_cache_tracer(tracer_cls), **kwargs)

    def __call__(self, *args: Any, hook: bool = False, **kwargs: Any) -> Any:
        # outside a trace nnsight calls the module: nothing can read an op, so unless a patch or a
        # torch hook listens on an op point the model's own code serves it (no extraction)
        self._nnbridge_follow_classes()
        state = bridge_of(wrapped_module(self))
        if (state is not None and self.eager_module_traces and not self.interleaver.interleaving
                and not state.listened()):
            with state.running_eagerly():
                return super().__call__(*args, hook=hook, **kwargs)
        return super().__call__(*args, hook=hook, **kwargs)

    def _nnbridge_follow_classes(self) -> None:
        """When built and before each run: every module nnsight wraps (new ones included) runs the
        forward of the class it has at each call (``module.__class__ = Sub``), as eager's call
        does, where nnsight 0.8.1 would keep running the class's it found (see
        :func:`.follow_classes`).

        Raises:
            NNBridgeError: nnsight's ``.source`` instrumented the old class's forward of such a
                module (named, with both classes).
        """
        follow_classes(wrapped_modules(self.interleaver, is_op_point))

    # -- extraction -----------------------------------------------------------------------------
    def _nnbridge_model(self) -> torch.nn.Module:
        module = wrapped_module(self)
        if bridge_of(module) is None and isinstance(module, torch.nn.Module) and list(module.parameters()):
            bridge(module)
        return module

    def extract(self, *args: Any, **kwargs: Any) -> Self:
        """Extract the model for this call (inputs as the model's forward takes them) so its op
        envoys exist before any trace. Returns ``self``.

        Raises:
            NNBridgeError: the model has no parameters: nnbridge leaves it unbridged (nnsight runs it
                as is), so there is nothing to extract.
        """
        module = self._nnbridge_model()
        state = bridge_of(module)
        if state is None:
            raise NNBridgeError(f"{type(module).__name__} has no parameters, so nnbridge does not bridge it and it has"
                                " no op envoys to extract; trace it as with nnsight (module envoys work), or wrap a"
                                " module with parameters.")
        state.dispatcher.lookup(tuple(args), dict(kwargs))
        mirror_envoys(self.interleaver, state.holders())
        return self

    def interleave(self, fn: Any, *args: Any, batcher: Any = None, **kwargs: Any) -> Any:
        # Assemble the call as nnsight will, extract its structure before the workers start
        # (they may ask for op envoys at once), then let nnsight run it unchanged. A lazily built
        # model is dispatched first (nnsight does it in its own interleave, which runs later).
        self._nnbridge_follow_classes()
        dispatch_if_lazy(self)
        if batcher is None:
            batcher = self._nnbridge_batcher(kwargs)
        batcher.add(*args, **kwargs)
        call_args, call_kwargs = batcher.assemble(fn)
        device = self.device
        if device is not None:
            call_args, call_kwargs = nnsight.util.apply(
                (call_args, call_kwargs), lambda tensor: tensor.to(device), torch.Tensor)
        state = bridge_of(self._nnbridge_model())
        owners = self._nnbridge_op_owners(state) if state is not None and self.eager_module_traces else None
        if state is not None and owners == {}:
            # no worker reads an op: nnsight's hooks on the modules serve the trace (see .op_reads)
            try:
                with state.running_eagerly():
                    return super().interleave(fn, batcher=batcher)
            except (AttributeError, OutOfOrderError) as error:
                error.add_note(_EAGER_NOTE)
                raise
        if state is not None and owners and self.lazy_op_traces and not self._nnbridge_extracted(state, fn, call_args,
                                                                                                 kwargs=call_kwargs):
            # workers read ops of known modules only: extract those modules alone
            modules = _outermost([wrapped_module(self).get_submodule(path) for path in owners])
            if state.lazy_allowed(modules):
                with state.lazily(modules):
                    if self._nnbridge_prepare(fn, call_args, call_kwargs, lazy=owners) and state.lazy_allowed(modules):
                        return self._nnbridge_interleave(fn, batcher)
            # a name read is no op of those modules (misspelt, or named only in a whole-model
            # extraction), or one is called several times per forward: the whole model's graphs
            # serve the trace (and its error names a missing op)
        self._nnbridge_prepare(fn, call_args, call_kwargs)
        return self._nnbridge_interleave(fn, batcher)

    def _nnbridge_interleave(self, fn: Any, batcher: Any) -> Any:
        """nnsight's interleave on the graphs; an ``OutOfOrderError`` gets :func:`note_source_and_ops`'s note."""
        try:
            return super().interleave(fn, batcher=batcher)
        except OutOfOrderError as error:
            note_source_and_ops(error, wrapped_module(self))
            raise

    def _nnbridge_remote(self, backend: Any) -> Any:
        """nnsight's backend for ``remote=`` (an NDIF server, or ``"local"``: nnsight's simulation of
        one), wrapped so the request travels as a plain nnsight model's (see :mod:`.remote`)."""
        module = wrapped_module(self)
        state = bridge_of(module) if isinstance(module, torch.nn.Module) else None
        known = [name for _, name in state.registered] if state is not None else []
        names = {name.rpartition(".")[2] for name, sub in module.named_modules() if not is_op_point(sub)} \
            if isinstance(module, torch.nn.Module) else set()
        return NNsightRequest(backend, module, known, module_names=names)

    def _nnbridge_op_owners(self, state: Bridge) -> dict[str, frozenset[str]] | None:
        """Where the run about to start may read op envoys (:func:`.op_reads.op_owners`): ``{}``
        none (the model's own code serves it), ``{module path: op names}`` only there, None
        anywhere (or a patch or torch hook is on an op point: the whole model's graphs run)."""
        if state.listened():
            return None
        codes, resolve = pending_workers(self)
        if codes is None:
            return None
        return op_owners(codes, resolve, wrapped_module(self), known_ops=state.registered_names)

    def _nnbridge_forward_like(self, fn: Any) -> bool:
        """Whether nnsight runs the module for this trace: the module, its forward, or the envoy's
        own ``_call`` (TransformersModel tokenizes there, then calls the module with the same
        kwargs); else a method such as ``generate``."""
        module = wrapped_module(self)
        target = getattr(module, fn) if isinstance(fn, str) else fn
        return (target is self or target is module
                or getattr(target, "__func__", None) in (type(module).__call__, type(module).forward)
                or (getattr(target, "__self__", None) is self and getattr(target, "__name__", "") == "_call"))

    def _nnbridge_extracted(self, state: Bridge, fn: Any, args: tuple[Any, ...], *, kwargs: dict[str, Any]) -> bool:
        """Whether the whole model is already extracted for this call (then its graphs serve the
        trace, rather than extracting modules lazily): a forward of a call structure extracted
        before, or any other method once the model has a whole-model extraction."""
        if not self._nnbridge_forward_like(fn):
            return bool(state.dispatcher.history)
        return state.dispatcher.structure_key(tuple(args), dict(kwargs)) in state.dispatcher.extractions

    def _nnbridge_prepare(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                          *, lazy: dict[str, frozenset[str]] | None = None) -> bool:
        """Extract what the run about to start needs before its workers start (they may ask for
        op envoys at once), and mirror the new op points as envoys. ``lazy``: the modules (paths)
        extracted alone and the op names read off them (see :meth:`Bridge.lazily`). Returns
        whether every op name in ``lazy`` is then an op of its module."""
        module = self._nnbridge_model()
        state = bridge_of(module)
        if state is None:
            return True
        target = getattr(wrapped_module(self), fn) if isinstance(fn, str) else fn
        if self._nnbridge_forward_like(fn):
            if lazy is None:
                state.dispatcher.lookup(tuple(args), dict(kwargs))
            elif not _all_known(module, lazy):
                # an op read that is not an envoy yet: run the call up to the modules, once
                copied = copy_inputs((tuple(args), dict(kwargs)))  # a cache argument is updated by a run
                state.warm_up(lambda: module(*copied[0], **copied[1]))
        else:
            call_kwargs = {k: v for k, v in kwargs.items() if k != "streamer"}
            key: Hashable = (getattr(target, "__name__", repr(target)),
                             state.dispatcher.structure_key(tuple(args), call_kwargs),
                             None if lazy is None else tuple(sorted(lazy)))
            if key not in self._nnbridge_warmed:
                runner = getattr(module, getattr(target, "__name__", ""), None)
                if callable(runner):
                    with torch.no_grad(), state_restored(module):
                        runner(*args, **call_kwargs)
                self._nnbridge_warmed.add(key)
        mirror_envoys(self.interleaver, state.holders())
        return lazy is None or _all_known(module, lazy)


def _all_known(model: torch.nn.Module, ops: dict[str, frozenset[str]]) -> bool:
    """Whether every name of ``ops`` (``{module path: op names}``) is an op point of its module."""
    return all(name in modules_of(model.get_submodule(path)) for path, names in ops.items() for name in names)


def _outermost(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """``modules`` without those inside another of them (each module once)."""
    if len(modules) == 1:  # the usual trace reads the ops of one module: no walk of its op points
        return modules
    inside = {id(sub) for module in modules for sub in module.modules() if sub is not module}
    result: dict[int, torch.nn.Module] = {}
    for module in modules:
        if id(module) not in inside:
            result.setdefault(id(module), module)
    return list(result.values())


class NNsight(_Bridged, nnsight.NNsight):
    """``nnsight.NNsight`` whose trace contexts reach every op (see the module docstring)."""


class TransformersModel(_Bridged, PreprocessorSources, _NNsightTransformersModel):
    """``nnsight.TransformersModel`` whose trace contexts reach every op."""


class LanguageModel(_Bridged, PreprocessorSources, _NNsightLanguageModel):
    """``nnsight.LanguageModel`` whose trace contexts reach every op (nnsight deprecates the class
    in favour of ``TransformersModel(..., task="text-generation")``; both are provided)."""
