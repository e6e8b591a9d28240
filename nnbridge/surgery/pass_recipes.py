"""Passes kept as recipes: :func:`~nnbridge.surgery.apply_passes` edits the graphs extracted so
far, and a :class:`PassRecipe` on each edited module applies the same passes to every later
extraction of it (another call structure, ``.train()``, another sequence length), before its code
is generated, as an inserted module's recipe is (:mod:`nnbridge.graph.recipes`).

Example::

    applied = apply_passes(model, [replace_add_with_mul], scope="model.layers_*")
    model(other_ids)          # a new extraction: its layers' graphs get the passes too
    applied.remove()          # later calls run unedited graphs (extracted again)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import PassCheckError, SurgeryError
from ..graph.graph_module import CompiledGraphModule
from ..graph.recipes import Callers

if TYPE_CHECKING:
    from .passes import AppliedPasses, PassEdit


class PassRecipe:
    """The passes of one :func:`apply_passes` call, kept on one module whose graphs they edited.

    Attributes:
        node_path: the scope the passes were asked for (for messages).
        owner: the module whose later extractions get the passes.
        child: None (passes insert no module of their own).
        edit: the :class:`PassEdit` applied.
        applied: the :class:`~nnbridge.surgery.passes.AppliedPasses` it belongs to (set by
            :func:`apply_passes`).
    """

    child: str | None = None

    def __init__(self, edit: PassEdit, owner: torch.nn.Module):
        self.edit, self.owner = edit, owner
        self.node_path = edit.scope
        self.applied: AppliedPasses | None = None

    def __repr__(self) -> str:
        return f"PassRecipe({self.edit!r}, owner={type(self.owner).__name__})"

    def apply(self, graph: CompiledGraphModule, *, options: Any, reason: str, callers: Callers | None = None
              ) -> None:
        """Run the passes on ``graph`` when it is in scope.

        Raises:
            SurgeryError: a pass or check fails on this extraction (the graph is unchanged); the
                message names the passes, the graph, why it was extracted, and the fix.
        """
        try:
            self.edit.apply(graph, callers)
        except PassCheckError as error:
            raise SurgeryError(
                f"{self.edit!r} no longer applies to a new extraction of {type(self.owner).__name__} (extracted for:"
                f" {reason}): {error} Remove the passes (the AppliedPasses' .remove(), or surgery.clear(target)) or"
                " make them handle this extraction.") from error

    def withdraw(self) -> None:
        """Nothing to undo on the model itself (passes change graphs only)."""
