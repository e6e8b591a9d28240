"""The in-place bridge: ``nnbridge.bridge(model, *inputs)``.

The model's own modules run their graphs, and every graph node is a real submodule
(``model.get_submodule("transformer.h.0.attn.softmax")``), so plain torch hooks and nnsight reach
every op. :func:`~.bridging.unbridge` restores the model exactly; :mod:`.copies` makes
``copy.deepcopy``, ``pickle`` and ``torch.save`` of a bridged model behave as on the original.

This layer imports only the layers below it (dispatch, store, extract, guards, graph, compat, errors).
"""
