"""``pg.save(path)`` and ``PatchableGraph.load(path, model)``.

A PatchableGraph's *archive* (a :mod:`.storage` bundle, written by :func:`write_archive`) holds
every exported program the PatchableGraph's construction made (the root's, and those of children
of opaque modules; not those of later calls with new call structures), nnbridge's metadata, the
example inputs and the shape summaries ``pg.graph`` shows; no weights and no pickled code.
``PatchableGraph.load`` builds the PatchableGraph again from an archive and the given model: the
same steps as a fresh extraction, except that each ``torch.export`` is replaced by the saved
program and the recording run that describes shapes by the saved summaries, so outputs, patches,
``pg.graph`` and NodePaths are those of a fresh extraction, in less time
(``benchmarks/bench_disk_cache.py`` measures it). The loaded PatchableGraph takes later
extractions from the file too when it holds their program; a call structure the file does not
hold is extracted (exported) as usual, as it would be by a fresh one.

``pg.save`` writes one ``torch.save`` file holding the model (pickled, weights included, as
graphpatch's ``pg.save`` did) and the archive (:mod:`.torch_file`): ``torch.load(f,
weights_only=False)`` returns the PatchableGraph (by ``PatchableGraph.load`` over the unpickled
model); ``torch.load(f)`` (weights_only) refuses without running pickled code, naming both loads;
``PatchableGraph.load(f, model)`` reads only the archive. It also reads a bare archive file.
``torch.save(pg)`` / ``pickle.dumps(pg)`` raise ``ValueError`` naming ``pg.save``.

Version policy: a bundle of another format version, or one made for another model class, config
or module tree, or with other extraction options, is refused with
:class:`~nnbridge.errors.SaveLoadError`. A bundle written by other torch, transformers or nnbridge
versions, or for a model whose source files changed since, loads with an
:class:`~nnbridge.errors.NNBridgeWarning` naming the difference: its graphs follow the code as it
was when saved.

Example::

    pg.save("gpt2.nnbridge")
    pg2 = PatchableGraph.load("gpt2.nnbridge", model)
"""

from __future__ import annotations

import contextvars
import io
import os
from typing import IO, TYPE_CHECKING, Any

import torch

from ..compat.torch.pytree import pytree
from ..compat.torch.serialization import library_versions, spec_from_json, spec_to_json
from ..errors import SaveLoadError, warn
from ..graph.graph_module import CompiledGraphModule, GraphModuleBase, OpaqueGraphModule
from ..graph.hierarchy import walk
from ..graph.summaries import UNKNOWN as _UNKNOWN
from ..graph.summaries import Named as _Named
from ..extract.options import ExtractionOptions
from ..store.programs import (
    ExportRequest,
    ProgramRecord,
    Recorder,
    describe_difference,
    model_fingerprint,
    options_fingerprint,
    sources_active,
)
from ..store.storage import Bundle, read_bundle, write_bundle
from . import torch_file

if TYPE_CHECKING:
    from .patchable_graph import PatchableGraph

#: ``header["kind"]`` of a ``pg.save`` bundle (disk-cache entries have another kind).
KIND = "patchable_graph"
_LEAF_TYPES = (torch.Tensor, int, float, bool, str, type(None))


def save(pg: PatchableGraph, target: str | os.PathLike[str] | IO[bytes]) -> None:
    """Write ``pg`` to a path (atomically) or binary file as a ``torch.save`` file holding the model
    and the archive (see :mod:`.torch_file` and the module docstring).

    Raises:
        SaveLoadError: see :func:`write_archive`; or the model cannot be pickled (nothing is left
            at ``target``).
    """
    stream = io.BytesIO()
    write_archive(pg, stream)
    torch_file.write(target, type(pg), stream.getvalue(), model=pg._dispatcher.module,
                     options=pg._dispatcher.options)


def write_archive(pg: PatchableGraph, target: str | os.PathLike[str] | IO[bytes]) -> None:
    """Write ``pg``'s archive (see module docstring; no weights, no pickled code) to a path
    (atomically) or binary file: what :func:`load` reads, alone or inside a :func:`save` file.

    Raises:
        SaveLoadError: ``pg`` was made over a bridged model (save the bridge's model instead:
            ``PatchableGraph`` of the unbridged model), or its example inputs hold something other
            than tensors, numbers, strings, None, tuples, lists and dicts (a transformers cache).
    """
    recorder: Recorder | None = pg.__dict__.get("_programs")
    if recorder is None:
        raise SaveLoadError("pg.save(): this PatchableGraph shares the graphs of a bridged model, which it does not"
                            " own; save a PatchableGraph of the unbridged model instead (PatchableGraph(model, *inputs)"
                            " before nnbridge.bridge, or after nnbridge.unbridge).")
    args, kwargs = pg.__dict__["_example"]
    leaves, spec = pytree.tree_flatten((args, kwargs))
    bad = [type(leaf).__name__ for leaf in leaves if not isinstance(leaf, _LEAF_TYPES)]
    try:
        spec_text = spec_to_json(spec)
    except Exception as error:  # noqa: BLE001 - a custom pytree node (a transformers Cache)
        bad.append(f"{error}")
    if bad:
        raise SaveLoadError(
            f"pg.save() stores the example inputs, which must be tensors, numbers, strings, None, tuples, lists and"
            f" dicts; they hold {bad[0]}. Extract from plain inputs (e.g. without past_key_values) to save.")
    header = {"kind": KIND, "model": model_fingerprint(pg._dispatcher.module),
              "options": options_fingerprint(pg._dispatcher.options), "inputs": spec_text,
              "examples": examples_of(pg._graph_module)}
    inputs = [leaf.detach() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    write_bundle(target, header, list(recorder.records), inputs=inputs)


class BundleSource:
    """The records of a bundle, as a program source (see :mod:`.programs`): a request is served
    by the record of the same NodePath and call fingerprint.

    Attributes:
        missed: the NodePaths (``"<root>"`` for the root) that found no record here and were then
            exported anew; a miss whose module then runs eagerly as a whole (an opaque root, such
            as a ``torch.no_grad``-decorated rotary embedding) has no program to save or load, and
            is not one.
    """

    def __init__(self, bundle: Bundle):
        self.bundle = bundle
        self.index = {(e["path"], e["call"]): i for i, e in enumerate(bundle.header["records"])}
        self.missed: list[str] = []
        self._looked_up: set[tuple[str, str]] = set()  # (path, call fingerprint) of misses

    def lookup(self, request: ExportRequest) -> ProgramRecord | None:
        key = (request.path, request.call_fingerprint())
        index = self.index.get(key)
        if index is None:
            self._looked_up.add(key)
            return None
        return self.bundle.record(index, request.module)

    def store(self, request: ExportRequest, record: ProgramRecord) -> None:
        """A record extraction just exported: a miss here if this source was asked for it."""
        if (request.path, request.call_fingerprint()) in self._looked_up:
            self.missed.append(request.path or "<root>")


def load(cls: type[PatchableGraph], source: str | os.PathLike[str] | IO[bytes], model: torch.nn.Module,
         options: ExtractionOptions | None = None) -> PatchableGraph:
    """A PatchableGraph of ``model`` from a bundle written by :func:`save` (see module docstring).

    Raises:
        SaveLoadError: the file is corrupt, partial, not a ``pg.save`` file or of another format
            version; ``model`` differs in class, config or module tree from the saved model; or
            ``options`` differ from the saved ones in what decides the export.
        FileNotFoundError: no file at ``source``.
    """
    name = str(source) if isinstance(source, (str, os.PathLike)) else getattr(source, "name", "<file object>")
    archive = torch_file.read_archive(source, name)
    bundle = read_bundle(source if archive is None else io.BytesIO(archive), name=name)
    header = bundle.header
    if header.get("kind") != KIND:
        raise SaveLoadError(f"{bundle.source} is a {header.get('kind')!r} file, not one written by pg.save().")
    current = model_fingerprint(model)
    difference = describe_difference(header["model"], current)
    if difference is not None:
        raise SaveLoadError(f"PatchableGraph.load({bundle.source!r}): {difference}; load with the model the file was"
                            " saved from (same class, config and modules).")
    given = options_fingerprint(options or ExtractionOptions())
    changed = sorted(k for k in given if given[k] != header["options"].get(k))
    if changed:
        raise SaveLoadError(f"PatchableGraph.load({bundle.source!r}): ExtractionOptions differ from the saved ones in"
                            f" {changed} (saved: {[header['options'].get(k) for k in changed]}); pass the options"
                            " the PatchableGraph was made with.")
    versions = library_versions()
    stale = [f"{k} {header['versions'].get(k)} (now {v})" for k, v in versions.items() if header["versions"].get(k) != v]
    if header["model"].get("source") != current["source"]:
        stale.append("the model's source files changed")
    elif header["model"].get("code", current["code"]) != current["code"]:  # a file that does not record it has none
        stale.append("functions the model runs were replaced at run time (a method or helper function assigned)")
    if stale:
        warn(f"PatchableGraph.load({bundle.source!r}): saved with {', '.join(stale)}; its graphs follow the code as it"
             " was when saved. Extract again (PatchableGraph(model, *inputs)) and save anew to follow the current code.")
    leaves = bundle.inputs or []
    args, kwargs = pytree.tree_unflatten(leaves, spec_from_json(header["inputs"]))
    files = BundleSource(bundle)
    token = _SAVED_EXAMPLES.set(header.get("examples"))
    try:
        with sources_active(files):
            pg = cls(model, *args, options=options, **kwargs)
    finally:
        _SAVED_EXAMPLES.reset(token)
    pg.__dict__.setdefault("_sources", []).insert(0, files)  # later calls' extractions come from the file too
    if files.missed:
        warn(f"PatchableGraph.load({bundle.source!r}): no saved program matched the call of {files.missed[:3]} (grad"
             " mode or train/eval mode differs from when it was saved?); those were extracted anew.")
    return pg


def _restore(cls: type[PatchableGraph], data: bytes, model: torch.nn.Module,
             options: ExtractionOptions) -> PatchableGraph:
    """Unpickling, with ``weights_only=False``, a file whose pickle calls this function (a
    PatchableGraph pickled with its archive as bytes): :func:`load` from the archive."""
    return load(cls, io.BytesIO(data), model, options)


# -- example summaries (what pg.graph shows), saved so a load skips the recording run ------------
_SAVED_EXAMPLES: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "nnbridge_saved_examples", default=None)


class _Unencodable(Exception):
    pass


def _encode(summary: Any) -> Any:
    """A summary of :func:`~.hierarchy.summarize` as JSON (tagged lists)."""
    if isinstance(summary, torch.Size):
        return ["size", list(summary)]
    if isinstance(summary, _Named):
        return ["named", summary.type_name, [[k, _encode(v)] for k, v in summary.items()]]
    if isinstance(summary, dict) and type(summary) is dict:
        return ["dict", [[k, _encode(v)] for k, v in summary.items()]]
    if type(summary) in (tuple, list):
        return [type(summary).__name__, [_encode(v) for v in summary]]
    if isinstance(summary, str):
        return ["str", summary]
    if summary is _UNKNOWN:  # a value export kept no metadata for
        return ["unknown"]
    raise _Unencodable(type(summary).__name__)


def _decode(data: Any) -> Any:
    kind = data[0]
    if kind == "size":
        return torch.Size(data[1])
    if kind == "named":
        return _Named(data[1], {k: _decode(v) for k, v in data[2]})
    if kind == "dict":
        return {k: _decode(v) for k, v in data[1]}
    if kind in ("tuple", "list"):
        return (tuple if kind == "tuple" else list)(_decode(v) for v in data[1])
    if kind == "unknown":
        return _UNKNOWN
    return data[1]


def _graph_owners(root: CompiledGraphModule | OpaqueGraphModule) -> dict[str, GraphModuleBase]:
    owners: dict[str, GraphModuleBase] = {"": root}
    for path, _, _, sub in walk(root):
        if sub is not None:
            owners[path] = sub
    return owners


def examples_of(root: CompiledGraphModule | OpaqueGraphModule) -> dict[str, Any] | None:
    """``{graph path: {node name: encoded summary}}`` of every graph below ``root``, or None when a
    summary cannot be written as JSON (the load then makes the recording run)."""
    try:
        return {path: {name: _encode(v) for name, v in owner.recorded_examples().items()}
                for path, owner in _graph_owners(root).items() if owner.recorded_examples()}
    except _Unencodable:
        return None


def restore_examples(root: CompiledGraphModule | OpaqueGraphModule) -> bool:
    """While :func:`load` builds a PatchableGraph: put the saved summaries on ``root``'s graphs.
    False (nothing changed) outside a load, or when the saved graphs do not match ``root``'s."""
    saved = _SAVED_EXAMPLES.get()
    if saved is None:
        return False
    owners = _graph_owners(root)
    if any(path not in owners for path in saved):
        return False
    for path, examples in saved.items():
        owners[path].set_examples({name: _decode(v) for name, v in examples.items()})
    return True
