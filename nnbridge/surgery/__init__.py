"""Graph surgery: change what a bridged model computes, by inserting modules at graph nodes or
running passes over its extracted graphs.

Three verbs edit a model (bridged with :func:`nnbridge.bridge`, a :class:`~nnbridge.PatchableGraph`,
or an nnbridge NNsight model) at a *site*, a NodePath as ``pg.patch`` takes it:

- :func:`insert_after` — ``module(value)`` replaces the site's value for its users (an SAE on an
  MLP's output, a gate after an attention softmax);
- :func:`insert_before` — the module transforms one input of an op or module call;
- :func:`replace_node` — the module replaces a module's call (a transcoder for an MLP).

The inserted module becomes a child of the module whose graph holds the site, so its parameters
train with the model, and it is extracted itself: its ops have NodePaths below the new node
(``model.layers_1.mlp.sae.relu``). An edit is a *recipe* kept on that module
(:mod:`nnbridge.graph.recipes`), applied to every extraction of it, including those a failed guard
makes later (another call structure, ``.train()``, another sequence length); an edit that does not
apply to a new extraction raises :class:`~nnbridge.SurgeryError` saying why. Example::

    from nnbridge import surgery

    nnbridge.bridge(model, ids)
    with surgery.insert_after(model, "model.layers_1.mlp.output", sae) as edit:
        logits = model(ids).logits          # through the SAE
    surgery.edits(model)                    # [] again

``apply_passes(target, passes, scope=...)`` runs torch fx / ATen-IR passes over the compiled
graphs of a PatchableGraph or bridged model (:mod:`.passes`); :class:`PassEdit` is the same work
as a reusable edit.

``replace_pattern(target, pattern, replacement, scope=...)`` rewrites every match of a pattern
that may span module calls (arguments annotated with a module class match calls of that class),
with a match log by NodePath (:mod:`.patterns`); ``match`` only finds them. With
``replacement_module=factory`` it inserts a new module per match instead, as LoRA injection does
(:mod:`.pattern_modules`).
"""

from .insertion import Edit as Edit
from .insertion import clear as clear
from .insertion import edits as edits
from .insertion import insert_after as insert_after
from .insertion import insert_before as insert_before
from .insertion import replace_node as replace_node
from .passes import AppliedPasses as AppliedPasses
from .passes import PassEdit as PassEdit
from .passes import apply_passes as apply_passes
from .pattern_modules import ModuleRewrite as ModuleRewrite
from .pattern_modules import PatternMatch as PatternMatch
from .patterns import MatchResult as MatchResult
from .patterns import Rewrite as Rewrite
from .patterns import match as match
from .patterns import replace_pattern as replace_pattern

__all__ = ["AppliedPasses", "Edit", "MatchResult", "ModuleRewrite", "PassEdit", "PatternMatch", "Rewrite",
           "apply_passes", "clear", "edits", "insert_after", "insert_before", "match", "replace_node",
           "replace_pattern"]
