"""The file ``pg.save`` writes: one ``torch.save`` pickle holding the model and nnbridge's archive.

The pickle's top object is rebuilt by :func:`_rebuild` from three arguments, in this order:

1. ``_archive(tensor)``: the :mod:`.saving` archive (exported programs, metadata, example inputs;
   no pickled code) as a ``uint8`` tensor, so ``torch.save`` writes it as a storage record;
2. the model, pickled as ``torch.save(model)`` pickles it (its class by reference, its weights),
   except that accelerate's hooks are added again on unpickling and disk-offloaded weights are
   written into the file (:mod:`~nnbridge.compat.pickling`);
3. the :class:`~nnbridge.extract.options.ExtractionOptions`;
4. the PatchableGraph class (by reference).

``torch.load(f, weights_only=False)`` (a trusted file) calls :func:`_rebuild`, which builds the
PatchableGraph with ``PatchableGraph.load`` from the archive and the unpickled model (no
``torch.export``). ``torch.load(f)`` (``weights_only=True``, torch's default) runs no pickled code:
both function names above are registered with ``torch.serialization.add_safe_globals`` under
:func:`_weights_only`, which raises :class:`~nnbridge.errors.SaveLoadError` naming the two ways to
load when the unpickler reaches the first argument's call, before the model's class is looked up.
``PatchableGraph.load(f, model)`` reads the archive the same way (``torch.load`` with
``weights_only=True``), taking the tensor at that point; the model's pickle is never unpickled.
(``torch.serialization.clear_safe_globals()`` removes the registration: ``torch.load(f)`` then
refuses with torch's own message at the first global, and ``PatchableGraph.load`` registers again.)

Example::

    write(path, PatchableGraph, archive_bytes, model=model, options=options)
    archive = read_archive(path)        # bytes, or None for a torch file not written by pg.save
"""

from __future__ import annotations

import contextvars
import io
import os
import pickle
import zipfile
from typing import IO, TYPE_CHECKING, Any

import torch

from ..compat.pickling import PICKLE_MODULE
from ..errors import SaveLoadError, warn
from ..extract.options import ExtractionOptions
from ..store.storage import write_atomically

if TYPE_CHECKING:
    from .patchable_graph import PatchableGraph

#: What ``torch.load(f)`` (weights_only) of a pg.save file raises.
REFUSAL = ("this file was written by nnbridge's pg.save(): it holds the model pickled with its code, which"
           " torch.load(f) (weights_only=True) does not run. For a file you trust, torch.load(f, weights_only=False)"
           " returns the PatchableGraph; or, without unpickling anything, nnbridge.PatchableGraph.load(f, model)"
           " builds it over a model you made (same class, config and modules).")


class _ArchiveFound(Exception):  # noqa: N818 - control flow: stops a weights-only read at the archive
    def __init__(self, tensor: torch.Tensor):
        super().__init__("pg.save archive")
        self.tensor = tensor


#: True while :func:`read_archive` reads: :func:`_weights_only` then hands the archive over.
_READING: contextvars.ContextVar[bool] = contextvars.ContextVar("nnbridge_reading_archive", default=False)


class _Saved:
    """What ``pg.save`` pickles (see module docstring)."""

    def __init__(self, cls: type[PatchableGraph], archive: bytes, model: torch.nn.Module | None, *,
                 options: ExtractionOptions):
        self.cls, self.archive, self.model, self.options = cls, archive, model, options

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (_ArchiveArgument(self.archive), self.model, self.options, self.cls)


class _ArchiveArgument:
    def __init__(self, archive: bytes):
        self.archive = archive

    def __reduce__(self) -> tuple[Any, ...]:
        return _archive, (torch.frombuffer(bytearray(self.archive), dtype=torch.uint8),)


def _bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.detach().cpu().numpy().tobytes())


def _archive(tensor: torch.Tensor) -> bytes:
    """Unpickling (``weights_only=False``): the archive's bytes."""
    return _bytes(tensor)


def _rebuild(archive: bytes, model: torch.nn.Module | None, options: ExtractionOptions,
             cls: type[PatchableGraph]) -> PatchableGraph:
    """Unpickling (``weights_only=False``): ``cls.load`` (``PatchableGraph.load``) of the archive
    over the model.

    Raises:
        SaveLoadError: the file holds no model (it could not be pickled when saved)."""
    if model is None:
        raise SaveLoadError("this pg.save file holds no model (the model could not be pickled when it was saved):"
                            " nnbridge.PatchableGraph.load(f, model) loads it over a model you make.")
    return cls.load(io.BytesIO(archive), model, options)


def _weights_only(*args: Any) -> Any:
    """What ``_archive`` and ``_rebuild`` are under ``torch.load(..., weights_only=True)``."""
    if _READING.get() and len(args) == 1 and isinstance(args[0], torch.Tensor):
        raise _ArchiveFound(args[0])
    raise SaveLoadError(REFUSAL)


def register() -> None:
    """Map the names of ``_archive`` and ``_rebuild`` to :func:`_weights_only` for torch's
    weights-only unpickler (``torch.serialization.add_safe_globals``; adding again is a no-op)."""
    torch.serialization.add_safe_globals([(_weights_only, f"{f.__module__}.{f.__qualname__}")
                                          for f in (_archive, _rebuild)])


register()


def write(target: str | os.PathLike[str] | IO[bytes], cls: type[PatchableGraph], archive: bytes,
          *, model: torch.nn.Module, options: ExtractionOptions) -> None:
    """``torch.save`` the file to a path (atomically: temporary file, then rename) or binary file
    (on failure, a seekable file is cut back to where it was).

    A model that cannot be pickled is left out (the file then holds the archive alone, which
    ``PatchableGraph.load(f, model)`` reads and ``torch.load`` refuses), with an
    :class:`~nnbridge.errors.NNBridgeWarning` naming the cause.

    Raises:
        OSError: writing failed; nothing is left at a path ``target``, a seekable file is cut back.
        SaveLoadError: the model cannot be pickled and ``target`` is a file that cannot be cut back.
    """
    if isinstance(target, (str, os.PathLike)):
        write_atomically(target, lambda stream: write(stream, cls, archive, model=model, options=options))
        return
    start = target.tell() if target.seekable() else None
    try:
        torch.save(_Saved(cls, archive, model, options=options), target, pickle_module=PICKLE_MODULE)
    except Exception as error:
        if start is not None:
            target.seek(start)
            target.truncate()
        if isinstance(error, OSError):
            raise
        if start is None:
            raise SaveLoadError(f"pg.save(): torch.save cannot pickle the model {type(model).__name__}"
                                f" ({type(error).__name__}: {error}) and the file cannot be cut back to write the"
                                " archive alone; save to a path or a seekable file.") from error
        warn(f"pg.save(): torch.save cannot pickle the model {type(model).__name__} ({type(error).__name__}:"
             f" {str(error)[:200]}), so the file holds nnbridge's archive without it:"
             " nnbridge.PatchableGraph.load(f, model) loads it over a model you make, torch.load(f) cannot."
             " To save the model too, make it picklable (no lambdas, locks or open files in its attributes).")
        torch.save(_Saved(cls, archive, None, options=options), target, pickle_module=PICKLE_MODULE)


def read_archive(source: str | os.PathLike[str] | IO[bytes], name: str) -> bytes | None:
    """The archive of a file :func:`write` wrote, read with ``torch.load(weights_only=True)`` up to
    the archive (the model is not unpickled); None when ``source`` is not a torch.save file (a file
    object is then at its start again).

    Raises:
        SaveLoadError: a torch.save file not written by ``pg.save``, or a damaged one (names the file).
        FileNotFoundError: no file at ``source``.
    """
    start = None if isinstance(source, (str, os.PathLike)) else source.tell()
    try:
        with zipfile.ZipFile(source) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile:
        names = []
    finally:
        if start is not None:
            source.seek(start)  # type: ignore[union-attr]  # start is set for file objects only
    if not any(n.endswith("/data.pkl") for n in names):
        return None
    register()
    token = _READING.set(True)
    try:
        torch.load(source, weights_only=True, map_location="cpu")
    except _ArchiveFound as found:
        return _bytes(found.tensor)
    except pickle.UnpicklingError as error:
        raise _not_pg_save(name, error) from None
    except Exception as error:  # noqa: BLE001 - torch's reader errors: one message
        raise SaveLoadError(f"{name} is not a readable pg.save file (corrupt or partial: {type(error).__name__}:"
                            f" {error}). Save it again.") from error
    finally:
        _READING.reset(token)
    raise _not_pg_save(name, None)


def _not_pg_save(name: str, error: Exception | None) -> SaveLoadError:
    cause = f" ({str(error).splitlines()[-1][:300]})" if error is not None else ""
    return SaveLoadError(f"{name} is a torch.save file, not one written by pg.save(){cause}. If it is an object you"
                         " pickled and you trust the file, torch.load(f, weights_only=False) loads it.")
