"""graphpatch's API: :class:`~.patchable_graph.PatchableGraph`, patches and inspection.

``PatchableGraph(model, *inputs)`` extracts the model and is callable like it; ``pg.patch({path:
patch})`` applies :mod:`.patches` (``ZeroPatch``, ``AddPatch``, ``ProbePatch``...) at NodePaths;
``pg.graph`` (:mod:`.inspection`) browses the hierarchy in a REPL; :mod:`.saving` is
``pg.save``/``PatchableGraph.load``; :mod:`.explain` reports which modules are graphs and why the
others run eagerly.

This layer imports only the layers below it.
"""
