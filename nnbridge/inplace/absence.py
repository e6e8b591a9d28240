"""Why a module of a bridged model has no op of a name: the facts :func:`~nnbridge.graph.absence.explain_absence`
needs, read off the model (its op points, the bridge's record of opaque modules, its config).

Used by ``get_submodule`` on a bridged model (:class:`SubmoduleLookup`, installed by
:func:`nnbridge.bridge`) and by the envoy layer's attribute errors. Example::

    nnbridge.bridge(model, ids)
    model.get_submodule("transformer.h.0.attn.sofmax")
    # AttributeError: GPT2Attention has no attribute `sofmax`; closest ops: ['softmax', ...].
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from ..graph.absence import AbsenceError, explain_absence
from ..graph.module_tree import ITERATED
from ..graph.op_point import OpPoint, OpPointContainer
from .own_code import registry

if TYPE_CHECKING:
    from .bridging import Bridge

#: Module containers: their entries are modules, indexed by position or key; never called.
CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def is_op(module: object) -> bool:
    """Whether a submodule is an op point (or the container of a later invocation's op points)."""
    return isinstance(module, (OpPoint, OpPointContainer))


def module_absence(subject: str, name: str, *, module: torch.nn.Module | None, path: str, where: str,
                   model: torch.nn.Module | None, bridge: Bridge | None, unknown: str,
                   entries: bool | None = None) -> str:
    """:func:`explain_absence` for ``name`` under ``module`` (at torch path ``path`` of ``model``,
    shown as ``where``): its op points are its ops; the bridge says whether it runs eagerly and
    whether anything was extracted yet (else its ops are not known: ``unknown`` says how they
    become known). ``entries``: whether ``name`` is sought among a module container's entries,
    which are then named (default: ``module`` is a ``ModuleList`` or ``ModuleDict``)."""
    children = registry(module) if module is not None else {}  # (with op points a run moved out)
    ops = [n for n, child in children.items() if is_op(child)]
    submodules = [n for n in children if n not in ops]
    opaque = bridge.opaque_reason(path) if bridge is not None else None
    extracted = bridge is not None and bridge.extracted()
    entries = isinstance(module, CONTAINERS) if entries is None else entries
    message = explain_absence(subject, name, where=where, ops=ops if ops or extracted else None, model=model,
                              opaque=opaque, submodules=submodules, entries=submodules if entries else None,
                              unknown=unknown)
    if (bridge is not None and isinstance(module, ITERATED) and not name.isdigit()
            and type(module).forward is not torch.nn.Module.forward):  # a container with a graph of its own
        message += (" A module container's ops are not attributes (its entries stay eager's: len, indices,"
                    f" iteration): PatchableGraph reaches them by NodePath ('{path + '.' if path else ''}{name}'"
                    " among pg.node_paths()).")
    return message


class SubmoduleLookup:
    """A bridged model's ``get_submodule`` (an instance attribute while it is bridged): torch's,
    whose ``AttributeError`` for a name the model does not have explains why it is no op
    (:func:`module_absence`; computed when the error's text is read). Holds the model weakly."""

    def __init__(self, model: torch.nn.Module, bridge: Bridge):
        self.model_ref = weakref.ref(model)
        self.bridge_ref = weakref.ref(bridge)

    def __call__(self, target: str) -> torch.nn.Module:
        model = self.model_ref()
        assert model is not None, "an instance attribute of the model: it is alive"
        try:
            return torch.nn.Module.get_submodule(model, target)
        except AttributeError as error:
            message = str(error)
            bridge = self.bridge_ref()
            raise AbsenceError(message, lambda: self.explain(model, bridge, target, message=message)) from None

    @staticmethod
    def explain(model: torch.nn.Module, bridge: Bridge | None, target: str, *, message: str) -> str:
        """``message`` (torch's), with why the first name of ``target`` that ``model`` lacks is no op."""
        module, path = model, list[str]()
        for name in target.split("."):
            child = registry(module).get(name)
            if child is None:
                if hasattr(module, name):  # an attribute that is no module: torch's message says so
                    return message
                where = f"{'.'.join(path) or '<root>'} ({type(module).__name__})"
                return module_absence(message, name, module=module, path=".".join(path), where=where, model=model,
                                      bridge=bridge, unknown="they appear when the model is first called (or bridge"
                                      " it with example inputs: nnbridge.bridge(model, *inputs)).")
            module, path = child, [*path, name]
        return message
