"""One lock for every bridged call and every extraction in the process.

Extraction changes shared state for its duration: it clears the model's hooks and instance
``forward`` overrides, registers its own hooks on the model's modules and, while tracing, replaces
process-wide torch entry points (``torch.autograd.Function.apply``, grad-mode setting; see
:mod:`nnbridge.compat.capture`). A forward running in another thread at that moment would see
that state (measured on milestone 1: ``IndexError: pop from empty list`` in extraction, fake-mode
errors, or wrong numbers). So bridged calls (``nnbridge.bridge``'d models, ``PatchableGraph``,
the nnsight classes) and extractions hold :data:`CALL_LOCK`: calls from several threads run one at
a time; a thread's nested calls re-enter it.

Patch contexts are per thread / per asyncio task (see :mod:`.patch_state`), so serialising calls
does not mix patches.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

#: Re-entrant: a bridged forward extracting its children, or calling other bridged models, holds it
#: already.
CALL_LOCK = threading.RLock()


def locked_call(run: Any, *args: Any, **kwargs: Any) -> Any:
    """A bridged model's ``__call__`` (installed with :func:`nnbridge.compat.call_overridden`, so it
    sits outside every hook): the whole call, hooks included, holds :data:`CALL_LOCK`. While another
    thread extracts, the model's hooks and forwards are not the user's, so waiting must start here."""
    if torch.compiler.is_dynamo_compiling():  # torch.compile traces through: Dynamo cannot enter a lock
        return run(*args, **kwargs)
    with CALL_LOCK:
        return run(*args, **kwargs)
