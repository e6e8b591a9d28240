"""Stores of extractions: the in-process memory cache, the disk cache and the on-disk format.

A *program* (:mod:`.programs`) is what extraction needs instead of exporting: a saved
``torch.export`` result, keyed by the call structure, module state and code digest that
:mod:`nnbridge.guards` computes. :mod:`.storage` is the on-disk format shared by ``pg.save`` and
the disk cache (:mod:`.disk_cache`, ``$NNBRIDGE_CACHE``, LRU-bounded); :mod:`.memory_cache` shares
extractions between model instances of one process.

This layer imports only :mod:`nnbridge.guards`, :mod:`nnbridge.graph`, :mod:`nnbridge.compat` and
:mod:`nnbridge.errors`.
"""
