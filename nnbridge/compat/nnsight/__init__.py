"""nnsight 0.8 internals: interleaving, ``.source``, remote requests, loading and the envoy repr.

Every run-time patch here is declared in :mod:`nnbridge.compat.registry`."""
