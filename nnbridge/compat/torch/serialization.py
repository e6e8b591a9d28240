"""Serialising call structures and reading library versions for nnbridge's on-disk format.

``torch.utils._pytree.treespec_dumps`` / ``treespec_loads`` (torch 2.1 - 2.13) turn a pytree
``TreeSpec`` into JSON text and back; only specs of built-in containers (tuple, list, dict,
namedtuple) and of types registered with a serialized name round-trip.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import threading
from types import ModuleType
from typing import IO, TYPE_CHECKING, Any

from .. import registry
from .pytree import pytree

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


class _ModuleStandIn:
    """Stands in for a module: every name the subclass does not define is the module's own, kept
    on the instance after its first look-up (the deserializer reads ``typing.get_origin`` and the
    like for every JSON node)."""

    def __init__(self, module: ModuleType):
        self._module = module

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        setattr(self, name, value)
        return value


class _MemoTyping(_ModuleStandIn):
    """``typing`` with ``get_type_hints`` memoised per class."""

    def __init__(self, typing_module: ModuleType):
        super().__init__(typing_module)
        self._hints: dict[object, dict[str, Any]] = {}

    def get_type_hints(self, cls: object, globalns: dict[str, Any] | None = None, *args: Any, **kwargs: Any
                       ) -> dict[str, Any]:
        if args or kwargs:
            return self._module.get_type_hints(cls, globalns, *args, **kwargs)
        if cls not in self._hints:
            self._hints[cls] = self._module.get_type_hints(cls, globalns)
        return self._hints[cls]


class _MemoSympy(_ModuleStandIn):
    """``sympy`` with ``sympify(text, locals=...)`` memoised on the text and the locals (sympy
    expressions are immutable, so a shared result is safe)."""

    def __init__(self, sympy_module: ModuleType):
        super().__init__(sympy_module)
        self._parsed: dict[Any, Any] = {}

    def sympify(self, text: Any, *args: Any, locals: Any = None, **kwargs: Any) -> Any:  # noqa: A002
        if args or kwargs or not isinstance(text, str):
            return self._module.sympify(text, *args, locals=locals, **kwargs)
        try:
            key = (text, tuple(sorted((locals or {}).items(), key=lambda item: item[0])))
            hash(key)
        except TypeError:
            return self._module.sympify(text, locals=locals)
        if key not in self._parsed:
            self._parsed[key] = self._module.sympify(text, locals=locals)
        return self._parsed[key]


class _MemoDataclasses(_ModuleStandIn):
    """``dataclasses`` with ``fields`` memoised per class (an instance's are its class's): the
    deserializer asks for the fields of a schema class for every JSON node it converts."""

    def __init__(self, dataclasses_module: ModuleType):
        super().__init__(dataclasses_module)
        self._fields: dict[type, tuple[Any, ...]] = {}

    def fields(self, class_or_instance: Any) -> tuple[Any, ...]:
        cls = class_or_instance if isinstance(class_or_instance, type) else type(class_or_instance)
        found = self._fields.get(cls)
        if found is None:  # (a class that is no dataclass raises here, as dataclasses.fields does)
            found = self._fields[cls] = self._module.fields(class_or_instance)
        return found


class _SchemaReader:
    """Stands in for ``torch._export.serde.serialize._dict_to_dataclass(cls, data)`` (JSON data to
    the schema's dataclasses) while :func:`load_program` loads: the same objects, with what torch
    2.13's function decides from ``cls`` alone (``Annotated``/``Optional`` unwrapped, a schema
    union's or dataclass's type hints and fields, a container's item type) worked out once per
    ``cls`` instead of for each of the ~49,000 JSON nodes of SmolLM2-135M's program. The decisions
    that depend on ``data`` (``None``, a list, a dict, a float) are made per node as torch makes
    them; any ``cls`` or ``data`` torch rejects is handed to torch's own function, which raises."""

    def __init__(self, original: Any, serialize_module: ModuleType, union_module: ModuleType):
        self._original, self._serialize, self._union = original, serialize_module, union_module
        self._plans: dict[Any, tuple[Any, ...]] = {}

    def __call__(self, cls: Any, data: Any) -> Any:
        try:
            plan = self._plans.get(cls)
        except TypeError:  # an unhashable cls: torch's own function decides
            return self._original(cls, data)
        if plan is None:
            plan = self._plans[cls] = self._plan(cls)
        kind = plan[0]
        if kind == "dataclass":
            _, made, hints = plan
            return made(**{name: self(hint, data[name]) for name, hint in hints if name in data})
        if kind == "other":
            _, resolved, args = plan
            if isinstance(data, list):
                return data if len(data) == 0 else [self(args[0], item) for item in data]
            if isinstance(data, dict):
                return {key: self(args[1], value) for key, value in data.items()}
            return float(data) if resolved is float else data
        if kind == "union" and isinstance(data, dict) and len(data) == 1:
            _, made, hints = plan
            ((tag, value),) = data.items()
            if isinstance(tag, str):
                return made.create(**{tag: self(hints[tag], value)})
        elif kind == "alias":
            return self(plan[1], data)
        elif kind == "optional":
            if data is None:
                return None
            if len(plan[1]) == 2:
                return self(plan[1][0], data)
        return self._original(cls, data)  # ("torch": a case torch's function rejects, and raises for)

    def _plan(self, cls: Any) -> tuple[Any, ...]:
        import dataclasses
        import types
        import typing

        resolved = self._serialize._resolve_schema_cls(cls)
        if isinstance(resolved, str):
            return ("torch",)
        origin = typing.get_origin(resolved)
        if origin is typing.Annotated:
            return ("alias", resolved.__origin__)
        if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(resolved):
            return ("optional", typing.get_args(resolved))
        schema = self._serialize.schema
        if isinstance(resolved, type) and issubclass(resolved, self._union._Union):
            return ("union", resolved, typing.get_type_hints(resolved, globalns=vars(schema)))
        if dataclasses.is_dataclass(resolved):
            hints = typing.get_type_hints(resolved, globalns=vars(schema))
            return ("dataclass", resolved, [(field.name, hints[field.name]) for field in dataclasses.fields(resolved)])
        return ("other", resolved, typing.get_args(resolved))


_MEMO: dict[str, Any] = {}
#: Held while :func:`save_program` has a program's example inputs set aside or :func:`load_program` has torch's globals swapped.
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
    """``torch.export.load(stream)``, without the deserializer's repeated work.

    torch 2.13's deserializer (``torch._export.serde.serialize``) calls ``typing.get_type_hints``
    for every node of the JSON schema and ``sympy.sympify`` for every symbolic size, again for the
    same classes and texts; for the duration the module's ``typing`` and ``sympy`` globals are
    wrappers that memoise both (results are identical: type hints of a class and parsed sympy
    expressions do not change); the memos live for the process, so a second load in a process
    skips that work. Likewise ``dataclasses.fields`` (``serialize``'s ``dataclasses`` global and
    ``torch._export.serde.union``'s ``fields``), asked for every JSON node: a schema class's
    fields do not change.

    Each symbolic size's range that the deserializer constrains makes ``ShapeEnv._get_sloc`` walk
    the stack for the first frame outside torch's "uninteresting files", and the first such walk
    imports every module on that list (``torch.export._trace``, ``torch._inductor.sizevars``, the
    Dynamo frontend, networkx: 344 modules) in a process that loads without exporting.
    For the duration, ``ShapeEnv._get_sloc`` returns :data:`LOAD_LOCATION` instead: the source
    location torch keeps for those ranges, shown only in its messages about them (the walk found a
    frame of torch's deserializer, ``_process_sym_expr``). Another thread's ``ShapeEnv`` records
    that location too meanwhile.

    Two of the deserializer's methods are swapped too (see :func:`_fake_tensor_meta` and
    :func:`_shared_sym_int`): each node's fake tensor is made by the fake mode's own constructor
    path, not dispatched through the mode, and each distinct symbolic size is made once per
    deserializer. And the module's ``_dict_to_dataclass`` (JSON to the schema's dataclasses) is a
    :class:`_SchemaReader`, which decides what it can from the class once per class, not once per
    JSON node.
    """
    import torch
    from torch._export.serde import serialize, union
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    deserializer = serialize.GraphModuleDeserializer
    with _SWAPPING, contextlib.ExitStack() as stack:  # (two threads loading at once would restore each other's stand-ins)
        original_reader = serialize._dict_to_dataclass
        if "typing" not in _MEMO:
            _MEMO["typing"], _MEMO["sympy"] = _MemoTyping(serialize.typing), _MemoSympy(serialize.sympy)
            _MEMO["dataclasses"] = _MemoDataclasses(serialize.dataclasses)
        if getattr(_MEMO.get("reader"), "_original", None) is not original_reader:
            _MEMO["reader"] = _SchemaReader(original_reader, serialize, union)
        swaps = [("load_schema_reader", serialize, "_dict_to_dataclass", _MEMO["reader"]),
                 *(("load_memoized_schema", serialize, name, _MEMO[name]) for name in ("typing", "sympy", "dataclasses")),
                 ("load_memoized_schema", union, "fields", _MEMO["dataclasses"].fields),
                 ("load_location", ShapeEnv, "_get_sloc", _load_location),
                 ("load_fake_tensor_meta", deserializer, "deserialize_tensor_meta", _fake_tensor_meta),
                 ("load_shared_sym_ints", deserializer, "deserialize_sym_int",
                  _shared_sym_int(deserializer.__dict__["deserialize_sym_int"]))]
        for name, owner, attribute, value in swaps:
            stack.enter_context(registry.replaced(name, owner, attribute, value=value))
        return torch.export.load(stream)


#: The source location :func:`load_program` gives the symbolic-size ranges of a loaded program.
LOAD_LOCATION = "torch.export.load of a program nnbridge saved (nnbridge.compat.torch.serialization.load_program)"


def _load_location(shape_env: Any, framework_loc: str | None = None) -> Any:
    """Stands in for ``ShapeEnv._get_sloc`` while :func:`load_program` loads: no stack walk."""
    from torch.fx.experimental.symbolic_shapes import SLoc

    return SLoc(framework_loc or LOAD_LOCATION, None)


def _fake_tensor_meta(deserializer: Any, tensor_meta: Any) -> Any:
    """Stands in for ``GraphModuleDeserializer.deserialize_tensor_meta`` while :func:`load_program`
    loads: the same fake tensor (sizes, strides, dtype, device, ``requires_grad``, the
    deserializer's fake mode) made as torch 2.13's fake mode makes a tensor constructor's output
    (``torch._subclasses.fake_impls.constructors``: the meta-device op under
    ``in_kernel_invocation_manager``, wrapped in a ``FakeTensor``), instead of dispatching
    ``torch.empty_strided`` through the mode, whose cache-key and cache-entry work
    (``_cached_dispatch_impl``) is most of what making a fake tensor that way costs."""
    import torch
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE, deserialize_device
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    sizes = tuple(deserializer.deserialize_sym_int(size) for size in tensor_meta.sizes)
    strides = tuple(deserializer.deserialize_sym_int(stride) for stride in tensor_meta.strides)
    mode = deserializer.fake_tensor_mode
    with in_kernel_invocation_manager(mode):
        meta = torch.ops.aten.empty_strided.default(sizes, strides, dtype=_SERIALIZE_TO_TORCH_DTYPE[tensor_meta.dtype],
                                                    device=torch.device("meta"))
    fake = FakeTensor(mode, meta, deserialize_device(tensor_meta.device))
    if tensor_meta.requires_grad:  # (as torch.empty_strided(..., requires_grad=True) sets it on the result)
        fake.requires_grad_(True)
    return fake


def _shared_sym_int(original: Any) -> Any:
    """A stand-in for ``GraphModuleDeserializer.deserialize_sym_int`` (``original``) that makes
    each symbolic size (expression and hint) once per deserializer and shape env and returns that
    ``SymInt`` again: a traced graph's tensors share their size ``SymInt`` objects likewise, and
    the parse that repeats for each tensor (a stack capture per symbol, the symbol's range
    constrained again) only repeats what the first made. Plain sizes are ``original``'s."""

    def deserialize_sym_int(deserializer: Any, sym_int: Any) -> Any:
        if sym_int.type != "as_expr":
            return original(deserializer, sym_int)
        value, shape_env = sym_int.value, deserializer.shape_env
        hint = value.hint
        key = (value.expr_str, None if hint is None else (hint.type, hint.value))
        shared = deserializer.__dict__.setdefault("_nnbridge_sym_ints", {})
        found = shared.get(key)
        if found is None or found[0] is not shape_env:
            found = shared[key] = (shape_env, original(deserializer, sym_int))
        return found[1]
    return deserialize_sym_int
