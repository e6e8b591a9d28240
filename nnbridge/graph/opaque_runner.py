"""The opaque module's runner: one run of the original module's code, routed through op points.

:class:`OpaqueRunner` runs an :class:`~.graph_module.OpaqueGraphModule`'s original ``forward`` with
its arguments, own parameters and buffers passed through their op points (as the caller passed
each argument: positionally or by keyword) and its children swapped for the modules called in
their place (the children's graph dispatchers), all put back afterwards, also on error.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from ..compat.torch.module_dicts import buffers_of, modules_of, parameters_of
from ..errors import PatchError
from .kinds import CONTAINERS


_ABSENT = object()

#: the Python values an opaque module's attribute node may hold
_NODE_VALUES = (bool, int, float, complex, torch.Tensor)


def patchable_attributes(module: torch.nn.Module, *, taken: set[str]) -> list[str]:
    """The names of ``module``'s attributes that are nodes when it runs opaque, as graphpatch made
    an opaque module's attributes nodes: those its instance holds (``self.scale = 8`` in
    ``__init__``, in ``__dict__``) whose value is a number, bool or plain tensor, except private
    names (``_x``), ``training`` and the names in ``taken`` (arguments, parameters, buffers,
    ``output``). Class attributes (``bar = 5`` in the class body) are not: they are the class's,
    shared by its instances."""
    return [name for name, value in module.__dict__.items()
            if not name.startswith("_") and name != "training" and name not in taken
            and isinstance(value, _NODE_VALUES)]


class Router(Protocol):
    """A callee that counts its calls within one run of an opaque module (implemented by
    :class:`nnbridge.extract.opaque.InvocationRouter`)."""

    def restart(self) -> None:
        """Count from the first invocation again (called before each run)."""


class OpaqueRunner:
    """Runs a module's own ``forward`` with some of its values routed.

    Args:
        module: the original module (not copied).
        callees: ``{child name: module called in its place}`` while the original code runs.
        routers: the callees that count their calls per run (``restart()`` before each run).

    Attributes:
        signature: ``forward``'s signature without ``self``.
        tensor_names: the module's own parameter names, then its own buffer names.
        attribute_names: its :func:`patchable_attributes`.
    """

    def __init__(self, module: torch.nn.Module, callees: Mapping[str, torch.nn.Module | None],
                 routers: Sequence[Router] | None = None):
        self.module = module
        self.callees = dict(callees)
        self.routers = list(routers or [])
        #: ``(stand-in, original, {name: (entry, what it stands for)})`` per ModuleList/ModuleDict
        #: the code iterates in place of the module's own (see :meth:`_written_back`)
        self.stand_ins: list[tuple[torch.nn.Module, torch.nn.Module, dict[str, tuple[Any, Any]]]] = []
        self._pair(module, self.callees)
        signature = inspect.signature(type(module).forward)
        self.signature = signature.replace(parameters=list(signature.parameters.values())[1:])
        self.tensor_names = [n for n, _ in module.named_parameters(recurse=False)] + [
            n for n, _ in module.named_buffers(recurse=False)]
        self.attribute_names = patchable_attributes(
            module, taken=set(self.signature.parameters) | set(self.tensor_names) | {"output"})

    def _pair(self, original: torch.nn.Module, entries: Mapping[str, torch.nn.Module | None]) -> None:
        """Pair each container among ``entries`` (stand-ins for ``original``'s children) with the
        original container it stands for, nested ones included."""
        for name, entry in entries.items():
            own = modules_of(original).get(name)
            if isinstance(entry, CONTAINERS) and isinstance(own, CONTAINERS) and entry is not own:
                stood = modules_of(entry)
                pairs = {key: (value, modules_of(own).get(key)) for key, value in stood.items()}
                self.stand_ins.append((entry, own, pairs))
                self._pair(own, stood)

    def _written_back(self, saved: dict[str, Any]) -> None:
        """Put the module's own children (``saved``: ``{name: child}`` before the run) back in place
        of their callees, give each original container the entries its stand-in's registry holds
        after a run that changed it (``self.blocks.append(block)`` in the module's code), and put
        the stand-in back as it was. A module the code bound (``self.head = spare``,
        ``self.blocks[1] = spare``) stays, as in eager; a callee or stand-in entry it bound becomes
        the child it stands for. The guard on the registries then extracts again."""
        callee_for = {id(self.callees[name]): child for name, child in saved.items()}
        entry_for: dict[int, Any] | None = None  # {id(stand-in entry): its child}, built when first needed
        registry = modules_of(self.module)
        for name in self.callees:
            if name in registry:  # (else the code deleted it: eager's module has it deleted too)
                value = registry[name]
                child = callee_for.get(id(value), _ABSENT)
                if child is _ABSENT and self.stand_ins:
                    entry_for = self._entry_children() if entry_for is None else entry_for
                    child = entry_for.get(id(value), _ABSENT)
                registry[name] = value if child is _ABSENT else child
        stood_for: dict[int, Any] | None = None
        for stand_in, original, entries in self.stand_ins:
            now = modules_of(stand_in)
            if now.keys() == entries.keys() and all(now[key] is entry for key, (entry, _) in entries.items()):
                continue
            if stood_for is None:
                stood_for = {**callee_for, **(self._entry_children() if entry_for is None else entry_for)}
            registry = modules_of(original)
            kept = {key: value for key, value in registry.items() if key not in entries}  # (op points)
            registry.clear()
            registry.update({key: stood_for.get(id(value), value) for key, value in now.items()})
            registry.update({key: value for key, value in kept.items() if key not in registry})
            now.clear()
            now.update({key: entry for key, (entry, _) in entries.items()})

    def _entry_children(self) -> dict[int, Any]:
        """``{id(stand-in entry): the child it stands for}``, from :attr:`stand_ins`."""
        return {id(entry): child for _, _, entries in self.stand_ins for entry, child in entries.values()}

    def call_original_children(self) -> None:
        """Let the original code call the module's own children (nothing swapped in)."""
        self.callees = {}
        self.routers = []
        self.stand_ins = []

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, routed: frozenset[str],
            call: Callable[[str, Any], Any]) -> Any:
        """The module's output for ``module(*args, **kwargs)``, each value named in ``routed`` (an
        argument name, a parameter or buffer name, an attribute name, ``output``) replaced by
        ``call(name, value)``. A routed attribute holds the value ``call`` handed on while the
        forward runs (set on the instance, shadowing a class attribute), and its own value after,
        unless the forward assigned it another one (kept, as eager keeps it)."""
        module = self.module
        if routed:
            args, kwargs = self.route_arguments(args, kwargs, routed=routed, call=call)
        saved_modules = {name: modules_of(module)[name] for name in self.callees}
        saved_tensors: dict[str, tuple[dict[str, Any], Any, Any]] = {}
        saved_attributes: dict[str, tuple[Any, Any]] = {}
        for router in self.routers:
            router.restart()
        try:
            modules_of(module).update(self.callees)
            for name in self.tensor_names:
                if name in routed:
                    store = parameters_of(module) if name in parameters_of(module) else buffers_of(module)
                    value = call(name, store[name])
                    saved_tensors[name] = (store, store[name], value)
                    store[name] = value
            for name in self.attribute_names:
                if name in routed:
                    value = call(name, getattr(module, name))
                    saved_attributes[name] = (module.__dict__.get(name, _ABSENT), value)
                    module.__dict__[name] = value
            output = type(module).forward(module, *args, **kwargs)
        finally:
            self._written_back(saved_modules)
            for name, (store, tensor, value) in saved_tensors.items():
                if store.get(name) is value:  # else the forward re-assigned it (an EMA buffer): keep that
                    store[name] = tensor
            for name, (own, value) in saved_attributes.items():
                if module.__dict__.get(name, _ABSENT) is value:  # else the forward assigned it: keep that
                    if own is _ABSENT:
                        del module.__dict__[name]  # the class attribute shows again
                    else:
                        module.__dict__[name] = own
        if "output" in routed:
            output = call("output", output)
        return output

    def route_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, routed: frozenset[str],
                        call: Callable[[str, Any], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Route each argument through its op point, passing it as the caller did: positionally or
        by keyword (re-binding keywords positionally makes transformers 5's forward decorators,
        which fill ``use_cache`` and the like into ``kwargs``, see them twice). An argument the call
        left at its default passes its default through its op point (graphpatch's opaque placeholder
        held the default) and is passed, by keyword, only when a patch handed on another value.

        Raises:
            PatchError: a patch replaced the default of a positional-only argument the call left out
                (it cannot be passed by keyword).
        """
        positional, kwargs = list(args), dict(kwargs)
        bound = self.signature.bind(*positional, **kwargs)  # raises TypeError as the forward would
        position = 0
        for parameter in self.signature.parameters.values():
            name, kind = parameter.name, parameter.kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                if name in routed and name in bound.arguments:
                    positional[position:] = list(call(name, tuple(positional[position:])))
                position = len(positional)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                if name in routed and name in bound.arguments:
                    extra = {k: v for k, v in kwargs.items() if k not in self.signature.parameters}
                    kwargs.update(call(name, extra))
            elif kind is not inspect.Parameter.KEYWORD_ONLY and position < len(positional):
                if name in routed:
                    positional[position] = call(name, positional[position])
                position += 1
            elif name in kwargs and name in routed:
                kwargs[name] = call(name, kwargs[name])
            elif name in routed and name not in bound.arguments and parameter.default is not parameter.empty:
                # left at its default: the node's value is the default (graphpatch's placeholder held
                # it); passed, by keyword, only when a patch handed on another value
                value = call(name, parameter.default)
                if value is not parameter.default:
                    if kind is inspect.Parameter.POSITIONAL_ONLY:
                        raise PatchError(
                            f"Cannot patch argument {name!r} of {type(self.module).__qualname__}.forward: it is"
                            " positional-only and the call left it at its default. Pass it in the call to patch it.")
                    kwargs[name] = value
        return tuple(positional), kwargs

