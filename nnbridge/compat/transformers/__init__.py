"""transformers internals: cache layers, sdpa mask skips and hook-based output capturing.

Every run-time patch here is declared in :mod:`nnbridge.compat.registry`."""
