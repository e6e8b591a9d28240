"""nnsight 0.8.x internals: whether a trace wants a value, and mirroring new submodules as envoys.

- ``module.__dict__["__nnsight__"]`` is the module's ``State``; ``State.active()`` returns
  ``(interleaver, path, (input, skip, output locations))`` while a trace with workers runs.
- ``Interleaver.parked`` (set of locations a worker waits at) and ``Interleaver.observers``
  (locations ``tracer.cache()`` records) decide whether a location is served; nnsight's own fast
  path in ``Interleaver.handle`` asks the same question.
- ``Interleaver.mediators`` (the workers of the trace about to run, each with its compiled block
  ``Mediator.code`` and its ``Scope`` ``Mediator.lcls``) and ``Envoy._edits`` (stored edits, replayed
  on every trace) are what a trace will run.
- ``Envoy._wrap_envoy(name, module)`` mirrors a submodule added after the tree was built;
  ``Interleaver.envoys`` maps ``id(module)`` to its envoy.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import nnsight
import torch
from nnsight.intervention.interleaver import OutOfOrderError as OutOfOrderError  # re-exported for envoys
from nnsight.intervention.tracer import InterleavingTracer as InterleavingTracer  # re-exported for envoys

from .. import registry
from .models import wrapped_module
from .source import NNSIGHT_STATE
from .source import count_routes, wanted_below


def wanted_inside(module: torch.nn.Module) -> bool:
    """Whether the running nnsight trace parks at, or caches, any location below ``module`` (its
    op points' and children's ``input``/``output``/``skip``), by path prefix.

    ``Interleaver.parked`` is complete at a module's entry: nnsight re-indexes it after serving
    anyone, and a worker can only move on (and park deeper in this module) when it is served a
    location below this module, so a module nothing below is wanted from runs its plain code.
    """
    return wanted_below(module)


def trace_wants(point: torch.nn.Module) -> bool:
    """Whether the running nnsight trace parks at, skips or caches one of the locations of the op
    envoy over ``point`` (an op point, wrapped by nnsight like any module). Asked once per graph
    node while a trace runs: kept to a few dict and set look-ups (``State.routes``,
    ``Interleaver.interleaving/parked/observers``)."""
    state = point.__dict__.get(NNSIGHT_STATE)
    if state is not None:
        for ref, _, locations in state.routes:
            interleaver = ref()
            if interleaver is not None and interleaver.interleaving:
                parked, observers = interleaver.parked, interleaver.observers
                for location in locations:
                    if location in parked or location in observers:
                        return True
        count_routes(state)  # not served: counted as visited all the same (see count_visits)
    return False


def mirror_envoys(interleaver: Any, holders: Iterable[tuple[torch.nn.Module, dict[str, None]]]) -> None:
    """Give every newly registered submodule ``holder.<name>`` an envoy under ``holder``'s envoy.

    ``holders``: ``[(holder, {name: None})]`` in order of registration, a holder before the holders
    registered inside it (:meth:`~nnbridge.inplace.bridging.Bridge.holders`). Runs before every
    trace, so a holder whose names all have envoys costs two look-ups, not one per op point."""
    for holder, names in holders:
        envoy = interleaver.envoys.get(id(holder))
        if envoy is None:
            continue
        children = envoy._child_map
        if names.keys() <= children.keys():
            continue
        for name in names:
            if name not in children:
                envoy._wrap_envoy(name, holder._modules[name])


def pending_workers(envoy: Any) -> tuple[list[types.CodeType] | None, Callable[[str], object]]:
    """The code of every worker the next run of ``envoy``'s interleaver starts (each invoke's
    block, and the envoy's stored edits), with a resolver of names in their scopes (a global or
    local of a block, or None). The codes are None when a worker has no code object to read."""
    mediators = list(envoy.interleaver.mediators) + list(getattr(envoy, "_edits", ()))
    codes = [getattr(m, "code", None) for m in mediators]
    scopes = [m.lcls for m in mediators]

    def resolve(name: str) -> object:
        for scope in scopes:
            try:
                return scope[name]
            except (KeyError, NameError):
                continue
        return None
    if not all(isinstance(code, types.CodeType) for code in codes):
        return None, resolve
    return [code for code in codes if isinstance(code, types.CodeType)], resolve


@functools.cache
def envoy_api() -> frozenset[str]:
    """The attribute names of nnsight 0.8's envoy, trace and invoke classes (``output``, ``save``,
    ``iter``, ``cache``...), and the envoy's ``input``/``inputs``/``output`` properties."""
    from nnsight.intervention.tracer import InterleavingTracer, Invoker

    names = set(dir(nnsight.Envoy)) | set(dir(InterleavingTracer)) | set(dir(Invoker))
    return frozenset(names | {"input", "inputs", "output"})


#: per nnsight interleaver: the number of its envoys when last walked, and what
#: :func:`wrapped_modules` found then
_WALKS: weakref.WeakKeyDictionary[Any, tuple[int, list[tuple[str, torch.nn.Module]]]] = weakref.WeakKeyDictionary()


def wrapped_modules(interleaver: Any, skip: Callable[[torch.nn.Module], bool]) -> list[tuple[str, torch.nn.Module]]:
    """``(path, module)`` of every module an nnsight 0.8 interleaver's envoys wrap
    (``Interleaver.envoys``; ``Envoy.path``) but those ``skip`` names (op points), walked again
    only when the interleaver's number of envoys changed (or :func:`repoint_envoys` re-pointed it)."""
    envoys = interleaver.envoys
    walk = _WALKS.get(interleaver)
    if walk is None or walk[0] != len(envoys):
        found = []
        for envoy in list(envoys.values()):
            module = wrapped_module(envoy)
            if isinstance(module, torch.nn.Module) and not skip(module):
                found.append((envoy.path, module))
        walk = (len(envoys), found)
        _WALKS[interleaver] = walk
    return walk[1]


def repoint_envoys(envoy: Any, module: torch.nn.Module) -> None:
    """Re-point an envoy tree at ``module`` (nnsight 0.8's ``Envoy._update``): envoys of modules
    missing from ``module`` are dropped, new ones mirrored, and the interleaver's per-module
    registry re-keyed."""
    envoy._update(module)
    _WALKS.pop(envoy.interleaver, None)


@functools.cache
def scalar_safe_batcher(batcher_class: type) -> type:
    """``batcher_class`` (an nnsight 0.8 ``Batcher``) serving 0-d tensors whole to every invoke.

    nnsight narrows a served tensor to an invoke's rows when its leading dim equals the combined
    batch size (``Batcher._narrow_tensor`` / ``_widen_tensor``, nnsight 0.8.1) and serves any other
    tensor whole; a 0-d tensor has no leading dim and raised ``IndexError``. Module outputs are
    rarely 0-d, op values often are (a ``sym_size``, a ``new_ones`` scalar): they carry no batch
    dimension, so they are served whole like nnsight's other non-batched values.
    """

    class ScalarSafeBatcher(batcher_class):
        def _narrow_tensor(self, tensor: torch.Tensor, group: Any) -> torch.Tensor:
            if tensor.dim() == 0:
                return tensor
            return super()._narrow_tensor(tensor, group)

        def _widen_tensor(self, full: torch.Tensor, group: Any, edited: torch.Tensor) -> torch.Tensor:
            if full.dim() == 0:
                return edited
            return super()._widen_tensor(full, group, edited)

    ScalarSafeBatcher.__name__ = ScalarSafeBatcher.__qualname__ = f"ScalarSafe{batcher_class.__name__}"
    return ScalarSafeBatcher


#: Attributes nnsight 0.8 sets on the modules it wraps (its per-module state).
NNSIGHT_MODULE_ATTRIBUTES = frozenset({NNSIGHT_STATE})


def dispatch_if_lazy(model: Any) -> None:
    """Load the real weights of a lazily built nnsight model (``LanguageModel(repo)`` without
    ``dispatch=True``: built on the meta device) before nnbridge extracts it, as nnsight 0.8.1's
    ``MetaMixin.interleave`` does on the first real trace (``model.dispatch()``). Not under a fake
    tensor mode (``model.scan``), where nnsight keeps the meta weights too."""
    if getattr(model, "dispatched", True) is False:
        from torch._guards import detect_fake_mode  # private torch: nnsight's own test (2.13)

        if detect_fake_mode() is None:
            model.dispatch()


def envoy_module(value: object) -> torch.nn.Module | None:
    """The module an nnsight envoy wraps (nnsight 0.8's ``Envoy._module``), or None when ``value``
    is not an envoy."""
    if not isinstance(value, nnsight.Envoy):
        return None
    module = wrapped_module(value)
    return module if isinstance(module, torch.nn.Module) else None


#: the message of nnsight 0.8.1's ``Envoy.__getattr__`` for a name neither the envoy nor its module has
def _nnsight_missing(envoy: Any, name: str) -> str:
    return f"{type(envoy).__name__!r} object (nor its module) has attribute {name!r}"


class MissingAttributeError(AttributeError):
    """nnsight's "no such attribute" ``AttributeError`` of an envoy, its text extended by a hint
    computed when the text is first read (``hasattr``/``getattr(envoy, name, default)`` never pay
    for it)."""

    def __init__(self, message: str, hint: Callable[[], str | None], name: str, *, obj: Any) -> None:
        super().__init__(message, name=name, obj=obj)
        self._hint: Callable[[], str | None] | None = hint
        self._text = message

    def __str__(self) -> str:
        if self._hint is not None:
            hint, self._hint = self._hint, None
            text = hint()
            if text:
                self._text = f"{self._text}. {text}"
        return self._text


def install_missing_attribute_hint(hint: Callable[[Any, str], str | None]) -> None:
    """Make nnsight 0.8's ``Envoy.__getattr__`` add ``hint(envoy, name)`` to the ``AttributeError``
    it raises for a name neither the envoy nor its module has (``'Envoy' object (nor its module)
    has attribute 'sofmax'``), when ``hint`` returns a text (nnbridge's closest op names on a
    bridged model's envoys); ``None`` keeps nnsight's text as it is (any model not bridged). The
    hint is computed when the error's text is first read.

    Only nnsight's own "no such attribute" error is extended: an ``AttributeError`` raised by a
    module's property, or one of a private name (``_x``, ``__x__``), passes unchanged. Idempotent:
    a later call replaces the hint.

    Raises:
        AttributeError: nnsight's (a :class:`MissingAttributeError`), with the hint appended.
    """
    original = nnsight.Envoy.__dict__["__getattr__"]
    original = getattr(original, "__nnbridge_original__", original)

    @functools.wraps(original)
    def __getattr__(self: Any, name: str) -> Any:
        try:
            return original(self, name)
        except AttributeError as error:
            message = str(error)
            if name.startswith("_") or message != _nnsight_missing(self, name):
                raise
            raise MissingAttributeError(message, lambda: hint(self, name), name, obj=self) from None

    __getattr__.__nnbridge_original__ = original  # type: ignore[attr-defined]
    registry.install("envoy_missing_attribute_hint", nnsight.Envoy, "__getattr__", value=__getattr__)
