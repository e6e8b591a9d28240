"""The kinds the graph layer distinguishes: the container modules, and enums instead of free strings.

The enums are ``enum.StrEnum``s: a member equals its value (``StubKind.SKIPPED == "skipped"``) and prints
as it, so reasons recorded as ``"skipped"`` (``OpaqueGraphModule.reason``, ``Extraction.opaque``)
read the same as the plain strings.
"""

from __future__ import annotations

import enum

import torch

#: the modules that only hold others: a ModuleList or ModuleDict's entries are, for extraction, the
#: children of the module that holds it (their NodePaths join the names: ``layers_0``)
CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


class StubKind(enum.StrEnum):
    """Why a submodule is replaced by a stub while the module around it is exported (any other
    stub holds the failure that made it opaque, as free text: ``"GuardOnDataDependentSymNode: ..."``).

    CUSTOM: its class has a custom extraction function (``ExtractionOptions.custom_extraction_functions``);
        its graph comes from that function.
    SKIPPED: its class is in ``ExtractionOptions.classes_to_skip_compiling`` (or
        ``skip_compilation`` is set): it stays opaque; this is also its recorded reason.
    PASSTHROUGH: export recorded no operation for its call (``nn.Identity``, ``return x``), and
        torch's unflatten makes no graph for such a call (see
        :func:`nnbridge.compat.torch.export.empty_module_calls`): it runs as itself, called from its
        caller's graph. Its value is its recorded reason.
    """

    CUSTOM = "custom"
    SKIPPED = "skipped"
    PASSTHROUGH = ("export records no operation for its call (it returns its inputs), and torch.export.unflatten makes"
                   " no graph for such a call: it runs as itself")


class HookKind(enum.StrEnum):
    """Which torch hook an eager observation run registers: ``register_forward_pre_hook`` (PRE)
    or ``register_forward_hook`` (POST), both ``with_kwargs=True``."""

    PRE = "pre"
    POST = "post"


class ModuleKind(enum.StrEnum):
    """How an extraction runs a module (:class:`nnbridge.Explanation`'s ``ModuleReport.kind``).

    GRAPH: its extracted graph's generated code. OPAQUE: its own forward, eagerly.
    """

    GRAPH = "graph"
    OPAQUE = "opaque"
