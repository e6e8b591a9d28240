"""Extraction: ``torch.export`` of a module, turned into a hierarchy of named graphs.

The steps, in order:

1. *capture checks*: eager *recording* runs (:mod:`.recording`, :mod:`.eager_checks`) and a watch
   on each export (:mod:`.capture_watch`) notice what ``torch.export`` would drop (in-place writes
   to module state, hooks, ``.data`` writes);
2. *export* (:mod:`.exporting`): non-strict ``torch.export`` with every submodule's call
   signature kept, failures attributed to the module that caused them;
3. *clean and name* (:mod:`.cleanup`, :mod:`.naming`): per-invocation graphs, one NodePath per
   node;
4. *build and assemble* (:mod:`.building`, :mod:`.assembly`): graph modules in the module
   hierarchy's shape;
5. *opaque fallback* (:mod:`.opaque`): a module that cannot be exported runs its own code, and each
   child it calls is extracted on its own;
6. *layer reuse* (:mod:`.reuse_plan` and the modules it names, :mod:`.sibling_roots`): one
   *representative* of identical *sibling* layers is exported; the siblings get copies of its
   graphs with their own weights.

:class:`~.options.ExtractionOptions` holds every setting. This layer imports only
:mod:`nnbridge.guards`, :mod:`nnbridge.graph`, :mod:`nnbridge.compat` and :mod:`nnbridge.errors`.
"""
