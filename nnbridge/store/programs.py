"""Program sources: where extraction gets a ``torch.export`` result without exporting.

Vocabulary. A *program record* (:class:`ProgramRecord`) is everything extraction keeps from one
``torch.export`` run of one module for one call: the exported program, the submodules stubbed
while exporting (and why), the state keys threaded through calls, whether shapes are dynamic and
the resulting :class:`~.call_structure.ShapeGuard`. Everything else extraction needs (the recorded
calls of stubbed modules, the input spec, constant outputs) is recomputed from the module and the
call, which is cheap. An *export request* (:class:`ExportRequest`) names the module, its NodePath
and the call. A *program source* answers requests with records (:meth:`ProgramSource.lookup`) and
is told about every record extraction makes (:meth:`ProgramSource.store`): a file loaded by
``PatchableGraph.load``, the recorder a PatchableGraph keeps for ``pg.save``, and the disk cache
(:mod:`.disk_cache`).

Example::

    with sources_active(recorder):
        PatchableGraph(model, input_ids)     # recorder.records: one record per export
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import inspect
import json
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..compat.transformers.output_capturing import MODEL_STATE_ATTRIBUTES
from ..compat.torch.module_dicts import MODULE_SLOTS
from ..compat.torch.pytree import pytree
from ..guards.call_structure import ShapeGuard, structure_key
from ..guards.code_digest import code_digest
from ..extract.options import ExtractionOptions
from ..graph.state import Key, UntouchedLayers
from ..guards.module_state import config_values
from ..guards.plain_values import config_like
from ..guards.plain_values import canonical_repr, class_values, plain_value
from ..graph.module_tree import named_real_modules


@dataclass
class ProgramRecord:
    """One ``torch.export`` result, as extraction's build step needs it (see module docstring).

    Attributes:
        path: NodePath of the exported module (``""`` for the root; a child of an opaque module
            is exported on its own).
        call: :meth:`ExportRequest.call_fingerprint` of the exported call.
        exported: the program (its parameters and buffers are the module's own tensors).
        dynamic: whether it was exported with dynamic shapes.
        states: ``{submodule path: [state keys per invocation]}`` threaded through calls.
        stubs: ``{submodule path: StubKind value or failure reason}`` stubbed while exporting.
        guard: the tensor sizes the program accepts.
        reuse: ``{sibling: representative}`` of the layers the export stubbed because their
            graphs are built from their representative's (see :mod:`~nnbridge.extract.reuse_plan`);
            ``{}`` for an export of every layer. Extraction derives the plan again and uses the record only
            when it is the same.
        untouched: ``{submodule path: [per invocation: the cache layers its code never
            touched, or None]}`` (see :func:`~.state.states_returned`); ``{}`` when unknown (a
            record read from disk): every layer's state is then checked before each call.
        watched: for a module exported as the representative of its siblings (see
            :mod:`.sibling_roots`): the reads of attributes that differ between them (and touches of
            other cache layers) the export saw, ``[]`` when none (its siblings may then build their
            graphs from this program); None when not watched.
        grad_reads: paths of the modules whose code read grad mode in the eager run before the
            export (see :mod:`nnbridge.compat.torch.grad_reads`); None when unknown (the run raised).
    """

    path: str
    call: str
    exported: torch.export.ExportedProgram
    dynamic: bool
    states: dict[str, list[list[Key]]]
    stubs: dict[str, str]
    guard: ShapeGuard
    reuse: dict[str, str] = field(default_factory=dict)
    untouched: dict[str, list[UntouchedLayers | None]] = field(default_factory=dict)
    watched: list[str] | None = None
    grad_reads: list[str] | None = None


@dataclass
class ExportRequest:
    """A module about to be exported for one call (the key under which sources look records up)."""

    module: torch.nn.Module
    path: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    options: ExtractionOptions
    grad_enabled: bool
    _fingerprint: str | None = field(default=None, repr=False)
    cache_key: str | None = field(default=None, repr=False)  # set by the disk cache

    def call_fingerprint(self) -> str:
        """A hex digest of the call: its structure (:func:`~.call_structure.structure_key`:
        argument tree, non-tensor values, tensor dtypes/devices/ranks/memory layouts, train/eval flags, autocast),
        tensor sizes, grad mode, and the options that change what is exported."""
        if self._fingerprint is None:
            sizes = [list(leaf.shape) for leaf in pytree.tree_leaves((self.args, self.kwargs))
                     if isinstance(leaf, torch.Tensor)]
            with torch.set_grad_enabled(self.grad_enabled):
                structure = structure_key(list(self.module.modules()), self.args, self.kwargs)
            text = json.dumps([repr(structure), sizes, self.grad_enabled, options_fingerprint(self.options)])
            self._fingerprint = hashlib.sha256(text.encode()).hexdigest()
        return self._fingerprint


def options_fingerprint(options: ExtractionOptions) -> dict[str, Any]:
    """The :class:`ExtractionOptions` that decide what is exported, as JSON-able values (classes by
    qualified name): which modules are stubbed and whether shapes are dynamic."""
    return {
        "classes_to_skip_compiling": sorted(_qualname(c) for c in options.classes_to_skip_compiling),
        "custom_extraction_functions": sorted(_qualname(c) for c in options.custom_extraction_functions),
        "skip_compilation": options.skip_compilation,
        "dynamic_shapes": options.dynamic_shapes,
        # (only when on: with it off, a key equals that of an entry that does not record the option)
        **({"reuse_layers": True} if options.reuse_layers else {}),
        **({"dynamic_dims": options.dynamic_dims} if options.dynamic_dims is not None else {}),
    }


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def model_fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    """What a saved program depends on in the model, as JSON-able values.

    ``class``: the model's qualified class name. ``config``: sha256 of the transformers config
    (``config.to_json_string()``), or None. ``structure``: sha256 of every module's path, class (op
    points a bridge registered left out), train flag and plain attribute values (numbers, strings,
    dtypes, and lists, tuples, sets and dicts of them: :func:`~.plain_values.plain_value`) and plain
    class attributes (:func:`~.plain_values.class_values`), every plain value of the config-like
    objects it holds (private ones such as
    ``_attn_implementation_internal`` included: :func:`~.guards.config_values`), and every
    parameter's and buffer's name, shape, dtype and requires_grad, and which of them are one tensor
    (tied weights). Weights' values are not part of it; nor are the flags transformers sets on
    first use (``MODEL_STATE_ATTRIBUTES``: a model saved after an ``output_attentions`` call loads
    into a fresh one).
    ``source``: sha256 of the source files defining every module class in the tree; a class whose
    source file cannot be read (defined in a notebook cell or by ``exec``) gives
    ``"unavailable:<class>"`` (see :func:`source_known`). ``code``: sha256 of the code the modules
    reach, which sees methods and helper functions replaced at run time, that the source files do
    not show (:func:`~nnbridge.guards.code_digest.code_digest`).
    """
    config = getattr(model, "config", None)
    config_hash = None
    if config is not None and hasattr(config, "to_json_string"):
        config_hash = _digest(config.to_json_string(use_diff=False))
    entries: list[Any] = []
    classes: dict[str, type] = {}
    owners: dict[int, str] = {}  # id of each parameter and buffer -> the first path holding it
    for name, module in named_real_modules(model):  # a bridge's op points are not part of it
        classes[_qualname(type(module))] = type(module)
        plain = sorted((k, canonical_repr(v)) for k, v in vars(module).items()
                       if plain_value(v, tensors=True) and not k.startswith("__") and k not in MODEL_STATE_ATTRIBUTES
                       and (k not in MODULE_SLOTS or k == "training"))
        # config objects (transformers' or look-alikes) with every plain value, private ones included:
        # ``to_json_string`` leaves out the attention implementation, and a module's own config
        # (``self.config = SimpleNamespace(...)``) is not the model's
        configs = sorted((k, config_values(v)) for k, v in vars(module).items() if config_like(k, v))
        tensors = [_tensor_entry(owners, f"{name}.{k}" if name else k, k, tensor=t)
                   for k, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]]
        entries.append([name, _qualname(type(module)), module.training, plain, configs, tensors])
    for cls in sorted(classes.values(), key=_qualname):  # plain class attributes (``Cls.gain = 3.0``)
        entries.append([_qualname(cls), [(k, canonical_repr(v)) for k, v in class_values(cls).items()]])
    return {"class": _qualname(type(model)), "config": config_hash, "structure": _digest(json.dumps(entries)),
            "source": _digest(json.dumps(sorted(_source_digest(c) for c in classes.values()))),
            "code": code_digest(model)}


def _tensor_entry(owners: dict[int, str], path: str, name: str, *, tensor: torch.Tensor) -> list[Any]:
    """A parameter's or buffer's part of :func:`model_fingerprint`: name, shape, dtype and
    requires_grad, and for a tensor an earlier path already holds (tied weights:
    ``lm_head.weight is transformer.wte.weight``) that path. ``torch.export`` gives tied tensors
    one placeholder, so a program exported with ``lm_head`` tied, bound to a model whose
    ``lm_head.weight`` is its own, would compute with the embedding: found as a memory-cache hit
    whose logits differed from eager without an error."""
    entry: list[Any] = [name, list(tensor.shape), str(tensor.dtype), tensor.requires_grad]
    first = owners.setdefault(id(tensor), path)
    if first != path:
        entry.append(first)
    return entry


def describe_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Which part of two :func:`model_fingerprint` values differs ("class GPT2LMHeadModel vs
    LlamaForCausalLM"), or None when class, config and structure agree (``source`` is compared
    separately: a changed source is a warning for an explicit load)."""
    if saved.get("class") != current.get("class"):
        return f"the model class differs (saved {saved.get('class')}, given {current.get('class')})"
    if saved.get("config") != current.get("config"):
        return "the model's config differs from the saved model's"
    if saved.get("structure") != current.get("structure"):
        return ("the module tree differs (a module, train/eval flag, attribute value, a parameter's or buffer's"
                " name, shape, dtype or requires_grad, or which of them are one tensor, as tied weights are)")
    return None


_SOURCE_DIGESTS: dict[str, str] = {}


def _source_digest(cls: type) -> str:
    """sha256 of the file defining ``cls`` (``"builtin"`` when it has none), memoised per file."""
    try:
        filename = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        filename = None
    if filename is None or filename.startswith("<"):
        # a Python class without a source file (``exec``, an interactive session) is unavailable;
        # a class implemented in C has no Python source to change
        python_class = any(isinstance(v, types.FunctionType) for v in vars(cls).values())
        return f"{UNAVAILABLE}{_qualname(cls)}" if python_class else f"builtin:{_qualname(cls)}"
    if filename not in _SOURCE_DIGESTS:
        try:
            with open(filename, "rb") as handle:
                _SOURCE_DIGESTS[filename] = hashlib.sha256(handle.read()).hexdigest()
        except OSError:
            _SOURCE_DIGESTS[filename] = f"{UNAVAILABLE}{filename}"
    return _SOURCE_DIGESTS[filename]


#: Prefix of a class's source digest when its source cannot be read.
UNAVAILABLE = "unavailable:"


def source_known(model: torch.nn.Module) -> bool:
    """Whether every module class in ``model`` has a readable source file (else a program of it
    cannot be keyed by its code: the disk cache does not serve or store it)."""
    return not any(_source_digest(type(m)).startswith(UNAVAILABLE) for _, m in named_real_modules(model))


def forget_source_digests() -> None:
    """Drop memoised source digests (a test that edits a model's source file)."""
    _SOURCE_DIGESTS.clear()


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class ProgramSource(Protocol):
    """Gives extraction program records instead of exporting (see module docstring)."""

    def lookup(self, request: ExportRequest) -> ProgramRecord | None: ...

    def store(self, request: ExportRequest, record: ProgramRecord) -> None: ...


class Recorder:
    """Keeps every record extraction makes or gets while active (for ``pg.save``)."""

    def __init__(self) -> None:
        self.records: list[ProgramRecord] = []

    def lookup(self, request: ExportRequest) -> ProgramRecord | None:
        return None

    def store(self, request: ExportRequest, record: ProgramRecord) -> None:
        self.records.append(record)


_ACTIVE: contextvars.ContextVar[tuple[ProgramSource, ...]] = contextvars.ContextVar("nnbridge_program_sources",
                                                                                      default=())


@contextlib.contextmanager
def sources_active(*sources: ProgramSource) -> Iterator[None]:
    """Consult ``sources`` (before any active already) for the body's duration."""
    token = _ACTIVE.set(sources + _ACTIVE.get())
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _all_sources(fallback: ProgramSource | None) -> tuple[ProgramSource, ...]:
    return _ACTIVE.get() + ((fallback,) if fallback is not None else ())


def lookup(request: ExportRequest, fallback: ProgramSource | None = None) -> ProgramRecord | None:
    """The first active source's record for ``request``, then ``fallback``'s (the disk cache, which
    the caller passes: this module does not know it); every source is told about a hit (a
    recorder keeps it, the disk cache writes it if it came from a file)."""
    sources = _all_sources(fallback)
    for i, source in enumerate(sources):
        record = source.lookup(request)
        if record is not None:
            for other in sources[:i] + sources[i + 1:]:
                other.store(request, record)
            return record
    return None


def store(request: ExportRequest, record: ProgramRecord, fallback: ProgramSource | None = None) -> None:
    """Tell every active source, and ``fallback``, about a record extraction just made."""
    for source in _all_sources(fallback):
        source.store(request, record)


class RecordedFailure(Exception):
    """Stands for the export failure that made a submodule opaque when its program record comes
    from a file: only the recorded reason is known (the message)."""
