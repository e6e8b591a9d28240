"""Reading torch.export's JSON schema into its dataclasses, with each schema type's reader built once.

:class:`SchemaReader` stands in for ``torch._export.serde.serialize._dict_to_dataclass`` (torch
2.13, 2.14) while :func:`~.serialization.load_program` loads a program: the same objects from the
same JSON, read as torch reads them. torch's function works out, for every object of a program's
JSON (tens of thousands in a decoder), what its schema type is (``_resolve_schema_cls``,
``typing.get_origin``, ``typing.get_args``, ``dataclasses.fields``, ``typing.get_type_hints``),
although a program has a few dozen types; the reader does that once per type and load.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any

Read = Callable[[Any], Any]


class SchemaReader:
    """``_dict_to_dataclass(cls, data)`` of torch 2.13/2.14, with a reader per schema type made once.

    Each reader follows torch's function branch by branch: a schema class named by a string or a
    ``ForwardRef`` is resolved (torch's own ``_resolve_schema_cls``), ``Annotated[T, ...]`` reads
    ``T``, ``Optional[T]`` reads None as None, a schema union (``_Union``) reads its one tagged
    field and is made with ``cls.create``, a dataclass is made from the fields present in the data
    (others are ignored, as torch's forward compatibility asks), a list or dict reads its items, a
    ``float`` is converted with ``float``, anything else is returned as it is. The errors are
    torch's (``AssertionError`` with torch's messages for malformed unions and unresolved names;
    the ``KeyError``/``IndexError`` torch's code would raise elsewhere).

    One instance serves one load: the readers refer to the schema types and hints of the torch that
    is loading.
    """

    def __init__(self) -> None:
        from torch._export.serde import schema, serialize
        from torch._export.serde.union import _Union

        self._schema_names = vars(schema)
        self._resolve: Callable[[Any], Any] = serialize._resolve_schema_cls
        self._union = _Union
        #: ``{schema type: its reader}`` (types are hashable; a reader is made once per type)
        self.readers: dict[Any, Read] = {}

    def __call__(self, cls: Any, data: Any) -> Any:
        return self.reader(cls)(data)

    def reader(self, cls: Any) -> Read:
        """The reader of objects of schema type ``cls``."""
        try:
            return self.readers[cls]
        except KeyError:
            read = self.readers[cls] = self._make(cls)
            return read
        except TypeError:  # an unhashable type annotation: a reader each time
            return self._make(cls)

    def _make(self, cls: Any) -> Read:
        resolved = self._resolve(cls)
        if isinstance(resolved, str):
            raise AssertionError(f"Unresolved class type: '{resolved}'.")
        origin = typing.get_origin(resolved)
        if origin is Annotated:
            return self.reader(resolved.__origin__)
        arguments = typing.get_args(resolved)
        if origin in (typing.Union, types.UnionType) and type(None) in arguments:
            return self._optional(arguments)
        if isinstance(resolved, type) and issubclass(resolved, self._union):
            return self._tagged(resolved)
        if dataclasses.is_dataclass(resolved):
            return self._dataclass(resolved)
        return self._container(resolved, arguments)

    def _optional(self, arguments: tuple[Any, ...]) -> Read:
        def read_optional(data: Any) -> Any:
            if data is None:
                return None
            if len(arguments) != 2:
                raise AssertionError(f"expected 2 type args, got {len(arguments)}")
            return self.reader(arguments[0])(data)
        return read_optional

    def _tagged(self, cls: Any) -> Read:
        hints: dict[str, Any] = {}  # resolved at the first read, after the data's checks, as torch does

        def read_tagged(data: Any) -> Any:
            if not isinstance(data, dict):
                raise AssertionError(f"expected dict, got {type(data).__name__}")
            if len(data) != 1:
                raise AssertionError(f"expected dict with 1 key, got {len(data)}")
            tag, value = next(iter(data.items()))
            if not isinstance(tag, str):
                raise AssertionError(f"expected str key, got {type(tag).__name__}")
            if not hints:
                hints.update(typing.get_type_hints(cls, globalns=self._schema_names))
            return cls.create(**{tag: self.reader(hints[tag])(value)})
        return read_tagged

    def _dataclass(self, cls: Any) -> Read:
        names = [field.name for field in dataclasses.fields(cls)]
        hints: dict[str, Any] = {}  # resolved at the first read, as torch does
        readers: dict[str, Read] = {}  # a field's reader, made when the field is first present

        def read_dataclass(data: Any) -> Any:
            if not hints:
                hints.update(typing.get_type_hints(cls, globalns=self._schema_names))
            fields = {}
            for name in names:
                if name not in data:
                    continue
                read = readers.get(name)
                if read is None:
                    read = readers[name] = self.reader(hints[name])
                fields[name] = read(data[name])
            return cls(**fields)
        return read_dataclass

    def _container(self, cls: Any, arguments: tuple[Any, ...]) -> Read:
        def read_other(data: Any) -> Any:
            if isinstance(data, list):
                if len(data) == 0:
                    return data
                read = self.reader(arguments[0])
                return [read(item) for item in data]
            if isinstance(data, dict):
                read = self.reader(arguments[1])
                return {key: read(value) for key, value in data.items()}
            if cls is float:
                return float(data)
            return data
        return read_other
