"""The opaque fallback: run a module's own code, and extract each child it calls.

An :class:`~.graph_module.OpaqueGraphModule` keeps the module's inputs, output, parameters and
buffers patchable; each child its code calls is extracted from its first call and called through
a dispatcher (:attr:`ExtractionContext.child_dispatcher`) that extracts it per call structure.
Example::

    graph = opaque_module(ctx, "transformer.h.0", block, args=args, kwargs=kwargs, reason="skipped")
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import wrapt

from .assembly import attach, renamed_template
from .context import ChildDispatcher, ExtractionContext
from ..graph.graph_module import MultiplyInvokedModule, OpaqueGraphModule
from ..graph.metadata import ExtractionHolder
from ..graph.module_tree import direct_callees, safe_name
from ..graph.node_path import ModulePath
from .recording import copy_inputs, observed_run
from .sibling_roots import SiblingLink, SiblingPlan, plan_siblings
from .unused import unused_module
from ..compat.torch.module_dicts import modules_of

class ChildCall(wrapt.ObjectProxy):
    """What an opaque module's code finds in a child's place while it runs: the child itself for
    every attribute read, write and delete (``self.child.scale``, ``self.child.lin.weight``,
    ``self.child.calls += 1`` reach the child, as in eager), and ``isinstance`` checks; a call goes
    to ``call`` (the child's dispatcher, or an :class:`InvocationRouter`), which runs its graphs.
    A ``wrapt.ObjectProxy``: a dispatcher in the child's place did not have the child's attributes.
    """

    def __init__(self, child: torch.nn.Module, call: torch.nn.Module):
        super().__init__(child)
        self._self_call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._self_call(*args, **kwargs)

    @property
    def forward(self) -> torch.nn.Module:
        """``self.child.forward(...)`` in the opaque code (peft's ``return self.model.forward(...)``)
        goes to ``call`` too: its graphs run, with their patches. (Eager code skips the child's own
        torch hooks there; a PatchableGraph refuses a plain model with hooks, and a bridged opaque
        module calls the bridged child itself, not this proxy.)"""
        return self._self_call


def _in_place_of(child: torch.nn.Module, call: torch.nn.Module) -> torch.nn.Module:
    """A :class:`ChildCall`, typed as the module it stands for (``isinstance`` sees the child's class)."""
    return cast(torch.nn.Module, ChildCall(child, call))


class InvocationRouter(torch.nn.Module):
    """Called in place of a child the opaque module's code calls several times: its ``k``-th call
    in one run of the module goes to invocation ``k``'s dispatcher (NodePath ``<child>_k``), as a
    compiled graph numbers them; calls past the last extracted invocation go to the last one.

    The opaque module calls :meth:`restart` before each run.
    """

    dispatchers: list[torch.nn.Module]
    calls: int

    def __init__(self, dispatchers: list[torch.nn.Module]):
        super().__init__()
        self.__dict__["dispatchers"] = dispatchers  # not registered: shown through the invocations
        self.__dict__["calls"] = 0

    def restart(self) -> None:
        self.__dict__["calls"] = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        index = min(self.calls, len(self.dispatchers) - 1)
        self.__dict__["calls"] = self.calls + 1
        return self.dispatchers[index](*args, **kwargs)


class _Recorder(torch.nn.Module):
    """Called in a child's place (through a :class:`ChildCall`) while the opaque code is observed:
    reports each call as ``record(name, args, kwargs)``, then calls the child."""

    label: str
    callee: torch.nn.Module
    report: Callable[[str, tuple[Any, ...], dict[str, Any]], None]

    def __init__(self, name: str, child: torch.nn.Module, record: Callable[[str, tuple[Any, ...], dict[str, Any]], None]):
        super().__init__()
        self.__dict__["label"], self.__dict__["callee"], self.__dict__["report"] = name, child, record

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.report(self.label, args, kwargs)
        return self.callee(*args, **kwargs)

    def direct(self, *args: Any, **kwargs: Any) -> Any:
        """``self.child.forward(...)`` in the observed code: reported, then the child's forward
        without its torch hooks, as eager runs it."""
        self.report(self.label, args, kwargs)
        return self.callee.forward(*args, **kwargs)


class _RecordingCall(ChildCall):
    """A :class:`ChildCall` for the observed run: ``.forward`` reports, then runs the child's
    forward directly (:meth:`_Recorder.direct`)."""

    @property
    def forward(self) -> Callable[..., Any]:  # type: ignore[override]
        return cast(_Recorder, self._self_call).direct


@contextlib.contextmanager
def _recorders_in_place(module: torch.nn.Module, callees: list[tuple[str, torch.nn.Module]],
                        record: Callable[[str, tuple[Any, ...], dict[str, Any]], None], *,
                        renamed: dict[str, str]) -> Iterator[None]:
    """For the body's duration, each of ``module``'s registrations ``name`` (through containers:
    ``blocks.0``) holds a :class:`ChildCall` reporting the calls made through that name, as the
    opaque module later swaps in its dispatchers (:class:`~nnbridge.graph.opaque_runner.OpaqueRunner`). So a call
    is counted under the name the code reached the child by: one object held under several names
    (``self.linear`` and ``self.blocks[1]``) gets each name's own calls, and a call made inside
    another child (a Sequential holding the same object) is that child's, not this module's. A
    child under a reserved name (``renamed``: ``{safe name: original}``, see
    :func:`~nnbridge.graph.module_tree.reserved_names_renamed`) is reached through its instance attribute, which
    holds the recorder too. Put back after, also on error."""
    swapped = torch.nn.Module()
    for name, child in callees:
        recording = cast(torch.nn.Module, _RecordingCall(child, _Recorder(name, child, record)))
        attach(swapped, name, recording, template=module, stand_in=True)
    saved = {name: modules_of(module)[name] for name in modules_of(swapped)}
    attributes = {renamed[name]: module.__dict__[renamed[name]] for name in saved
                  if name in renamed and renamed[name] in module.__dict__}
    try:
        modules_of(module).update(modules_of(swapped))
        module.__dict__.update({original: modules_of(swapped)[safe] for safe, original in renamed.items()
                                if original in attributes})
        yield
    finally:
        modules_of(module).update(saved)
        module.__dict__.update(attributes)


def _captured_calls(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                    callees: list[tuple[str, torch.nn.Module]], renamed: dict[str, str]
                    ) -> tuple[dict[int, int], dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]]]:
    """The calls made through each of ``callees`` (``(name, child)``) in one observed run of
    ``module(*args, **kwargs)``: ``({id(child): how many names it is registered under}, {name:
    [(args, kwargs) copies]})``, counted per name (see :func:`_recorders_in_place`)."""
    names_of: dict[int, int] = {}
    for _, child in callees:
        names_of[id(child)] = names_of.get(id(child), 0) + 1
    captured: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}

    def record(name: str, a: tuple[Any, ...], k: dict[str, Any]) -> None:
        captured.setdefault(name, []).append((copy_inputs(a), copy_inputs(k)))
    # in the caller's grad mode: each child's first extraction then has the call structure
    # (``requires_grad`` of its inputs) of the real calls, which reuse it instead of extracting again
    observed_run(module, args, kwargs, hooks=[], grad=torch.is_grad_enabled(),
                 around=lambda: _recorders_in_place(module, callees, record, renamed=renamed))
    return names_of, captured


def opaque_module(ctx: ExtractionContext, fqn: ModulePath, module: torch.nn.Module, *, args: tuple[Any, ...],
                  kwargs: dict[str, Any], reason: str) -> OpaqueGraphModule:
    """Opaque fallback: run the original code, extract each called child from its calls.

    A child called several times in the observed run gets one extraction per invocation
    (``linear_0``, ``linear_1``, graphpatch's numbering), routed by an :class:`InvocationRouter`.
    Calls are counted per name the code reaches the child by (:func:`_recorders_in_place`): one
    module object held under several names has each name's own invocations, as in graphpatch.
    """
    callees = list(direct_callees(module))
    names_of, captured = _captured_calls(module, args, kwargs, callees=callees,
                                         renamed=ctx.renamed.get(id(module), {}))
    shown = torch.nn.Module()
    swapped = torch.nn.Module()
    dispatchers: dict[str, ChildDispatcher] = {}
    # ModuleList entries called once each: siblings build their graphs from their representative's
    # export (see .sibling_roots)
    callee = dict(callees)
    pairing = plan_siblings(module, {name for name, calls in captured.items() if len(calls) == 1
                                     and names_of[id(callee[name])] == 1}) \
        if ctx.options.reuse_layers else SiblingPlan()
    by_name: dict[str, ChildDispatcher] = {}
    routers: list[InvocationRouter] = []
    template = renamed_template(module)
    for name, child in callees:
        child_path = ctx.full(ModulePath(f"{fqn}.{name}" if fqn else name))
        first, *rest = name.split(".")
        safe = ".".join([safe_name(first), *rest])
        original_name = ".".join([ctx.renamed.get(id(module), {}).get(first, first), *rest])
        if name not in captured:
            attach(shown, safe, unused_module(ctx, ModulePath(f"{fqn}.{name}" if fqn else name), child),
                   template=template)
            attach(swapped, original_name, child, template=module, stand_in=True)
            continue
        invocations: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        for index, (a, k) in enumerate(captured[name]):
            several = len(captured[name]) > 1
            dispatcher = ctx.child_dispatcher(child, ModulePath(f"{child_path}_{index}") if several else child_path)
            # a GraphDispatcher (see ChildDispatcher): the original code calls it in the child's place
            assert isinstance(dispatcher, torch.nn.Module), type(dispatcher)
            # (every time: a dispatcher kept from an earlier extraction may have been paired otherwise)
            rep_name, sibling_index, distinct = pairing.siblings.get(name, (None, None, frozenset())) \
                if not several else (None, None, frozenset())
            dispatcher.pair(pairing.watches.get(name) if not several else None,
                            SiblingLink(by_name[rep_name], sibling_index, distinct) if rep_name in by_name else None)
            if not several:
                by_name[name] = dispatcher
            # (a dispatcher kept from an earlier extraction serves a call alike with what it has)
            extraction = dispatcher.lookup(a, k)
            ctx.opaque.update(extraction.opaque)
            ctx.fallbacks.update(extraction.fallbacks)
            invocations.append((dispatcher, extraction.root))
            dispatchers[f"{safe.replace('.', '_')}_{index}" if several else safe.replace(".", "_")] = dispatcher
        if len(invocations) == 1:
            attach(shown, safe, invocations[0][1], template=template)
            attach(swapped, original_name, _in_place_of(child, invocations[0][0]), template=module, stand_in=True)
        else:
            attach(shown, safe, MultiplyInvokedModule([root for _, root in invocations]), template=template)
            router = InvocationRouter([dispatcher for dispatcher, _ in invocations])
            routers.append(router)
            attach(swapped, original_name, _in_place_of(child, router), template=module, stand_in=True)
    # each child called, once: the children's dispatchers guard their graphs' sizes, so a call of
    # other sizes is served alike. A child called several times has a graph per invocation, and an
    # uncalled one runs as itself (a patch on its nodes would not apply): another size could call
    # them another number of times
    any_size = not routers and all(name in captured for name, _ in callees)
    opaque = OpaqueGraphModule(module, reason, dict(modules_of(shown)), callees=dict(modules_of(swapped)),
                               routers=routers, serves_any_size=any_size)
    # the dispatcher layer's factory makes GraphDispatchers (see ChildDispatcherFactory)
    opaque.graph_meta.child_dispatchers = cast("dict[str, ExtractionHolder]", dispatchers)
    return opaque
