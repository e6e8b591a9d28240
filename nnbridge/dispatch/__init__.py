"""Dispatch: pick the extraction that fits a call, or extract anew.

:class:`~.dispatcher.GraphDispatcher` stands in for a module: on each call it checks the guards of
the extractions it holds and runs the first whose guards hold; when none does, it extracts
(:func:`~.extraction.extract`: stores first, then :mod:`nnbridge.extract`) and keeps the result.

This layer imports only the layers below it (store, extract, guards, graph, compat, errors).
"""
