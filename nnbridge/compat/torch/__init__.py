"""torch's private API: export, fx, pytree, functorch, hooks and tensor internals.

Every run-time patch here is declared in :mod:`nnbridge.compat.registry`."""
