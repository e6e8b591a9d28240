"""Version- and library-specific shims: the only place private torch, transformers, nnsight and
accelerate attributes are used.

One folder per library (:mod:`.torch`, :mod:`.transformers`, :mod:`.nnsight`; :mod:`.accelerate`
and :mod:`.libc` are single modules; :mod:`.output` reads the standard library's ``warnings`` and
``logging`` internals). Every run-time patch of another library is declared in
:mod:`.registry` with what it replaces, why, the versions it was verified on and whether it
exists for correctness or only for speed. This layer imports nothing of nnbridge but
:mod:`nnbridge.errors`.
"""
