"""Guards: what an extraction assumed, checked before each call reuses it.

A *guard* is a check that a call still matches what an extraction read (as Dynamo's guards):

- the *call structure* (:mod:`.call_structure`): argument kinds, shapes that are not symbolic,
  dtypes, devices, which tensor arguments alias each other, and plain values baked in;
- *module state* (:mod:`.module_state`): attributes, parameters, buffers, hooks and training
  flags the graphs bake in;
- *code* (:mod:`.code_check`): the lookups the code reached made (:mod:`.bindings`), found by the
  code walk (:mod:`.code_walk`, started from a model by :mod:`.model_code`), including the objects
  modules hold (:mod:`.held_objects`) and the module globals the code reads (:mod:`.global_state`);
- *plain values* (:mod:`.plain_values`): non-tensor values compared by value.

The same walk gives the disk extraction cache its key for code (:mod:`.code_digest`).
A guard that fails sends the call to a new extraction (see :mod:`nnbridge.dispatch`).
:mod:`.preservation` and :mod:`.data_writes` put back what extraction's own eager runs changed,
so extracting never alters the model.

*State* names several things here, and each module's docstring says which it means:

- *module state* (:mod:`.module_state`): what a graph bakes in from the module tree (plain
  attribute values and configs, children, parameters', buffers' and tensor attributes' identity
  and properties, hooks, training flags, and the code check's lookups);
- *global state* (:mod:`.global_state`): the values of the module globals (and of the attributes
  of global settings objects and named classes) the code reads;
- *torch's global state* (:mod:`.call_structure`): grad mode, autocast, the default dtype and
  other process-wide torch flags, part of a call's structure;
- a *held object's state* (:mod:`.held_objects`): the attributes of an object a module holds;
- *saved state* (:mod:`.preservation`, :mod:`.data_writes`): a snapshot of one module's
  parameters, buffers and attributes, and of the random number generators, taken to compare or
  put back around extraction's own eager runs.

This layer imports only :mod:`nnbridge.graph`, :mod:`nnbridge.compat` and :mod:`nnbridge.errors`.
"""
