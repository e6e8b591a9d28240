"""One lock for every bridged call and every extraction in the process.

Extraction changes shared state for its duration: it clears the model's hooks and instance
``forward`` overrides, registers its own hooks on the model's modules and, while tracing, replaces
process-wide torch entry points (``torch.autograd.Function.apply``, grad-mode setting; see
:mod:`nnbridge.compat.torch.capture`). A forward running in another thread at that moment would see
that state (``IndexError: pop from empty list`` in extraction, fake-mode
errors, or wrong numbers). So bridged calls (``nnbridge.bridge``'d models, ``PatchableGraph``,
the nnsight classes) and extractions hold :data:`CALL_LOCK`: calls from several threads run one at
a time; a thread's nested calls re-enter it. Waiting must start before any hook runs, so every
module of a bridged model, and for an extraction's duration every module of the extracted model,
takes the lock in its ``__call__`` (:func:`locked_calls`): a thread entering the model, or any of
its submodules directly, waits until the extraction has put everything back.

Not covered: a call of a *plain* (never bridged) model that was already running when another
thread started extracting that model (``PatchableGraph(model)`` while ``model`` runs elsewhere);
a call entering a module while torch.export traces a tree that holds one module object at several
container entries (:func:`calls_unlocked`: it waits in the module's body, a bridged one's, not in
its ``__call__``).

Patch contexts are per thread / per asyncio task (see :mod:`.patch_state`), so serialising calls
does not mix patches.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch

from ..compat.torch.forwards import call_override, call_overridden, restore_call_override

#: Re-entrant: a bridged forward extracting its children, or calling other bridged models, holds it
#: already.
CALL_LOCK = threading.RLock()


def locked_call(run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A bridged model's ``__call__`` (installed with :func:`nnbridge.compat.call_overridden`, so it
    sits outside every hook): the whole call, hooks included, holds :data:`CALL_LOCK`. While another
    thread extracts, the model's hooks and forwards are not the user's, so waiting must start here."""
    if torch.compiler.is_dynamo_compiling():  # torch.compile traces through: Dynamo cannot enter a lock
        return run(*args, **kwargs)
    with CALL_LOCK:
        return run(*args, **kwargs)


def lock_calls(modules: Iterable[torch.nn.Module]) -> list[tuple[torch.nn.Module, Callable[..., Any]]]:
    """Install :func:`locked_call` on every module that has no ``__call__`` override of its own.

    Returns:
        ``[(module, installed override)]``, for :func:`unlock_calls`.
    """
    installed = []
    for module in modules:
        if call_override(module) is None:
            call_overridden(module, locked_call)
            installed.append((module, cast(Callable[..., Any], call_override(module))))
    return installed


def unlock_calls(installed: list[tuple[torch.nn.Module, Callable[..., Any]]]) -> None:
    """Remove the overrides :func:`lock_calls` installed (those not replaced since)."""
    for module, override in installed:
        if call_override(module) is override:
            call_overridden(module, None)


@contextlib.contextmanager
def locked_calls(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """:func:`lock_calls` for the body's duration (an extraction's)."""
    installed = lock_calls(modules)
    try:
        yield
    finally:
        unlock_calls(installed)


@contextlib.contextmanager
def calls_unlocked(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Take the :func:`locked_call` overrides (an extraction's or a bridge's) off ``modules`` for the
    body's duration, putting each back on exit, also on error; the caller holds :data:`CALL_LOCK`.

    For a torch.export that must know each call of a shared module by the name the code reached it
    through: the override runs the call on the module object (its ``_call_impl`` bound to it), so
    the body runs outside export's attribute proxy of the module and the calls inside lose their
    path (see :mod:`nnbridge.extract.shared_names`)."""
    lifted: list[tuple[torch.nn.Module, Callable[..., Any]]] = []
    for module in modules:
        override = call_override(module)
        if override is not None and getattr(override, "func", None) is locked_call:
            lifted.append((module, override))
    try:
        for module, _ in lifted:
            call_overridden(module, None)
        yield
    finally:
        for module, override in lifted:
            restore_call_override(module, override)
