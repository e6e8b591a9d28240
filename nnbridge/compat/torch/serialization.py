"""Serialising call structures and reading library versions for nnbridge's on-disk format.

``torch.utils._pytree.treespec_dumps`` / ``treespec_loads`` (torch 2.1 - 2.13) turn a pytree
``TreeSpec`` into JSON text and back; only specs of built-in containers (tuple, list, dict,
namedtuple) and of types registered with a serialized name round-trip.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import threading
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any

from .. import registry
from .pytree import pytree
from .schema_reader import SchemaReader

if TYPE_CHECKING:
    import torch


def spec_to_json(spec: pytree.TreeSpec) -> str:
    """``spec`` as JSON text (raises ``TypeError``/``NotImplementedError`` for unserialisable nodes)."""
    return pytree.treespec_dumps(spec)


def spec_from_json(text: str) -> pytree.TreeSpec:
    """The ``TreeSpec`` that :func:`spec_to_json` wrote."""
    return pytree.treespec_loads(text)


def library_versions() -> dict[str, str]:
    """``{"torch": ..., "transformers": ..., "nnbridge": ...}``: the versions a saved graph depends on
    (``"absent"`` for a library that is not installed)."""
    import torch

    versions: dict[str, str] = {"torch": torch.__version__}  # a TorchVersion: a str subclass
    for name in ("transformers", "nnbridge"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


#: Held while :func:`save_program` has a program's example inputs set aside or :func:`load_program`
#: has the deserializer's method swapped.
_SWAPPING = threading.Lock()


def save_program(exported: torch.export.ExportedProgram, stream: IO[bytes]) -> None:
    """``torch.export.save(exported, stream)``, without the program's example inputs.

    The program's example inputs are left out (``ExportedProgram.example_inputs`` is None while it
    is written, then restored): nothing that loads it needs them, and torch writes them with
    ``torch.save``, so a call's transformers ``Cache`` argument would be a pickled object that
    ``torch.load(weights_only=True)`` refuses. torch 2.13 then loads it with ``weights_only=False``
    and logs a malformed warning (``deserialize_torch_artifact``), which a logging handler that
    raises on errors (pytest's) turns into a failed load.
    """
    import torch

    with _SWAPPING:
        examples = exported._example_inputs
        exported.example_inputs = None
        try:
            torch.export.save(exported, stream)
        finally:
            exported._example_inputs = examples


def load_program(stream: IO[bytes]) -> torch.export.ExportedProgram:
    """``torch.export.load(stream)``, each node's fake tensor made without a dispatch through the
    fake mode (see :func:`_fake_tensor_meta`), the JSON read into torch's schema dataclasses by a
    reader built once per schema type (see :class:`~.schema_reader.SchemaReader`)."""
    import torch
    from torch._export.serde import serialize
    from torch.export.pt2_archive import _package

    deserializer = serialize.GraphModuleDeserializer
    with (_SWAPPING,  # (two threads loading at once would restore each other's stand-ins)
          registry.replaced("load_fake_tensor_meta", deserializer, "deserialize_tensor_meta", value=_fake_tensor_meta),
          _schema_reader_installed(serialize, _package)):
        try:
            return torch.export.load(stream)
        finally:
            _PARSED.clear()


@contextlib.contextmanager
def _schema_reader_installed(serialize: Any, package: Any) -> Iterator[None]:
    """Within: a :class:`~.schema_reader.SchemaReader` stands in for ``_dict_to_dataclass`` in both
    torch modules that call it while a program loads (patch ``load_schema_reader``; the reader is
    made only where the patch runs, as it reads torch 2.13/2.14's names)."""
    if not registry.enabled("load_schema_reader"):
        yield
        return
    reader = SchemaReader()
    with (registry.replaced("load_schema_reader", serialize, "_dict_to_dataclass", value=reader, gated=False),
          registry.replaced("load_schema_reader", package, "_dict_to_dataclass", value=reader, gated=False)):
        yield


def _fake_tensor_meta(deserializer: Any, tensor_meta: Any) -> Any:
    """Stands in for ``GraphModuleDeserializer.deserialize_tensor_meta`` while :func:`load_program`
    loads: the same fake tensor (sizes, strides, dtype, device, ``requires_grad``, the
    deserializer's fake mode) made as torch 2.13's fake mode makes a tensor constructor's output
    (``torch._subclasses.fake_impls.constructors``: the meta-device op under
    ``in_kernel_invocation_manager``, wrapped in a ``FakeTensor``), instead of dispatching
    ``torch.empty_strided`` through the mode, whose cache-key and cache-entry work
    (``_cached_dispatch_impl``) is most of what making a fake tensor that way costs. A symbolic
    size or stride is made as ``deserialize_sym_int`` makes it, with its expression parsed once
    per deserializer (:func:`_sym_int`)."""
    import torch
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE, deserialize_device
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    sizes = tuple(_sym_int(deserializer, size) for size in tensor_meta.sizes)
    strides = tuple(_sym_int(deserializer, stride) for stride in tensor_meta.strides)
    mode = deserializer.fake_tensor_mode
    with in_kernel_invocation_manager(mode):
        meta = torch.ops.aten.empty_strided.default(sizes, strides, dtype=_SERIALIZE_TO_TORCH_DTYPE[tensor_meta.dtype],
                                                    device=torch.device("meta"))
    fake = FakeTensor(mode, meta, deserialize_device(tensor_meta.device))
    if tensor_meta.requires_grad:  # (as torch.empty_strided(..., requires_grad=True) sets it on the result)
        fake.requires_grad_(True)
    return fake


#: ``{id(deserializer): (deserializer, its shape env, its symbol table, {(expression, hint): sympy expression})}``
#: while :func:`load_program` loads (under ``_SWAPPING``); emptied after each load
_PARSED: dict[int, tuple[Any, Any, Any, dict[tuple[str, int | None], Any]]] = {}


def _sym_int(deserializer: Any, serialized: Any) -> Any:
    """``deserializer.deserialize_sym_int(serialized)``, a symbolic one's expression parsed once
    per deserializer, shape env and symbol table: torch parses the text with ``sympy.sympify`` for
    every size and stride of every node (``_parse_sym_expr``), and a program's tensors share a few
    expressions (``s27``, ``32*s27``). Parsing the same text again registers nothing new (its
    symbols, hints and ranges are in the shape env after the first parse) and ends at the symbol
    table's entry of the first, so the parsed expression is reused; each call still makes its own
    ``SymInt`` (``shape_env.create_symintnode``), as torch's does."""
    value = serialized.value
    if serialized.type != "as_expr" or (value.hint is not None and value.hint.type != "as_int"):
        return deserializer.deserialize_sym_int(serialized)  # (an int, or torch's own error)
    hint = None if value.hint is None else value.hint.value
    entry = _PARSED.get(id(deserializer))
    if (entry is None or entry[0] is not deserializer or entry[1] is not deserializer.shape_env
            or entry[2] is not deserializer.symbol_name_to_symbol):
        entry = _PARSED[id(deserializer)] = (deserializer, deserializer.shape_env, deserializer.symbol_name_to_symbol, {})
    parsed = entry[3]
    key = (value.expr_str, hint)
    if key not in parsed:
        parsed[key] = deserializer._parse_sym_expr(value.expr_str, hint)
    return deserializer.shape_env.create_symintnode(parsed[key], hint=hint)
