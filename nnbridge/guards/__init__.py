"""Guards: what an extraction assumed, checked before each call reuses it.

A *guard* is a check that a call still matches what an extraction read (as Dynamo's guards):

- the *call structure* (:mod:`.call_structure`): argument kinds, shapes that are not symbolic,
  dtypes, devices, which tensor arguments alias each other, and plain values baked in;
- *module state* (:mod:`.module_state`): attributes, parameters, buffers, hooks and training
  flags the graphs bake in;
- *code* (:mod:`.code_identity`): the code objects reached, the module globals and the held
  objects they read (:mod:`.global_state`);
- *plain values* (:mod:`.plain_values`): non-tensor values compared by value.

A guard that fails sends the call to a new extraction (see :mod:`nnbridge.dispatch`).
:mod:`.preservation` and :mod:`.data_writes` put back what extraction's own eager runs changed,
so extracting never alters the model.

This layer imports only :mod:`nnbridge.graph`, :mod:`nnbridge.compat` and :mod:`nnbridge.errors`.
"""
