"""NodePaths: graphpatch's dotted path to a node, with ``|`` to dig into a container value.

``transformer.h_0.attn.softmax`` names the ``softmax`` node in the graph of ``transformer.h[0].attn``;
``linear_1.output`` the output of the second invocation of ``linear``; ``output|sub_0.sub_1`` the
second element of the first element of a tuple output; ``output|logits`` a dict (or ModelOutput)
key. nnsight's spelling ``transformer.h.0.attn.softmax`` is accepted too. This is the one parser.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

from ..errors import NodePathError

_SUB = re.compile(r"sub_(\d+)")

#: The text of a NodePath as users write it and graphs name their nodes (``"transformer.h_0.attn.softmax"``,
#: ``"output|sub_0"``); :class:`NodePath` is its parsed form. A ``str`` at run time.
NodePathStr = NewType("NodePathStr", str)

#: A module's name as ``named_modules()`` gives it (``"transformer.h.0.attn"``; ``""`` is the root),
#: relative to the module an extraction starts from unless a parameter says otherwise; a child that
#: an opaque module calls several times has one dispatcher per call, named with ``_<i>`` appended
#: (``"model.rotary_emb_0"``). A ``str`` at run time; the ``fqn`` and ``path`` parameters of the
#: extraction and dispatch layers hold one.
ModulePath = NewType("ModulePath", str)

#: The :data:`ModulePath` of the module an extraction starts from (``named_modules()`` names it ``""``).
ROOT_PATH = ModulePath("")


@dataclass(frozen=True)
class NodePath:
    """A parsed NodePath.

    Attributes:
        nodes: the dotted node segments (``("linear_0", "output")``).
        dig: the segments after ``|`` (``("sub_0", "sub_1")``), empty when there is none.
    """

    nodes: tuple[str, ...]
    dig: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> NodePath:
        """Parse ``"a.b.c|d.e"``. Raises :class:`NodePathError` for an empty segment or extra ``|``."""
        if not isinstance(text, str):
            raise NodePathError(f"A NodePath must be a string or a pg.graph node, got {type(text).__name__}: {text!r}.")
        node_part, bar, dig_part = text.partition("|")
        nodes = tuple(node_part.split(".")) if node_part else ()
        dig = tuple(dig_part.split(".")) if bar else ()
        if not nodes or any(not s for s in nodes + dig) or "|" in dig_part:
            raise NodePathError(
                f"Malformed NodePath {text!r}: use dot-separated node names, optionally followed by one"
                " '|' and a dot-separated dig path, e.g. 'linear_0.output' or 'output|sub_0'.")
        return cls(nodes, dig)

    def __str__(self) -> str:
        return ".".join(self.nodes) + ("|" + ".".join(self.dig) if self.dig else "")


def dig_key(segment: str) -> int | str:
    """The container key a dig segment stands for: ``sub_3`` -> ``3``; other names are dict keys."""
    match = _SUB.fullmatch(segment)
    return int(match.group(1)) if match else segment


#: Node names that ``pg.graph``'s own attributes would shadow (``pg.graph._shape`` is the root's shape tree,
#: ``pg.graph._code`` its code). As in graphpatch (its ``meta/graph_meta.py``), such a node is known by
#: ``sub`` + its name (``_shape`` -> ``sub_shape``), numbered when that is taken (``sub_shape_1``).
PROTECTED_NAMES = frozenset({"_code", "_shape"})


def unprotected_names(names: Sequence[str]) -> list[str]:
    """``names`` (one graph's node names, unique) with each of :data:`PROTECTED_NAMES` renamed to a
    free ``sub_...`` name, the others unchanged: ``["_shape", "_code", "sub_shape"]`` ->
    ``["sub_shape_1", "sub_code", "sub_shape"]``."""
    taken = set(names)
    result = []
    for name in names:
        if name in PROTECTED_NAMES:
            base = candidate = f"sub{name}"
            number = 0
            while candidate in taken:
                number += 1
                candidate = f"{base}_{number}"
            taken.add(candidate)
            name = candidate
        result.append(name)
    return result


_INDEX = re.compile(r"(?<=[^.])\.(\d+)(?=\.|$)")


def from_module_path(path: str) -> str:
    """The NodePath of a module path as ``named_modules`` spells it: each container index joins the
    name before it (``transformer.h.0.attn`` -> ``transformer.h_0.attn``); a NodePath is unchanged."""
    return _INDEX.sub(r"_\1", path)
