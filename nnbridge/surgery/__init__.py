"""Graph surgery: changing the computation of extracted graphs.

``apply_passes(target, passes, scope=...)`` runs torch fx / ATen-IR passes over the compiled
graphs of a PatchableGraph or bridged model (:mod:`.passes`); :class:`PassEdit` is the same work
as a reusable edit.

This layer imports only the layers below it.
"""

from .passes import AppliedPasses as AppliedPasses
from .passes import PassEdit as PassEdit
from .passes import apply_passes as apply_passes
