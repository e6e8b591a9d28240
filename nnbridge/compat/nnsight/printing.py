"""The printed envoy tree of nnsight 0.8.1 (``Envoy.__repr__``), with a module's ops on one line.

nnsight prints an envoy like ``torch.nn.Module``: ``Name(extra_repr, (child): ..., ...)``, labels a
child reached by a ``rename`` alias ``alias/name``, adds a line per described ``eproperty``, and
prints a ``ModuleList`` whose consecutive entries print alike as ``(0-29): 30 x LlamaDecoderLayer(...)``
(``Envoy._repr_modulelist``). A bridged module has one op envoy per graph node, dozens per layer:
here they are one line, ``(ops): 8 ops: x, bias_, weight_, ..., output_``, so layers with the same
ops print alike and collapse as nnsight collapses them. Reads nnsight's private ``_module``,
``_named_children()``, ``_child_map`` and ``_aliases``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from nnsight.intervention.eproperty import eproperty

#: at most this many op names are printed per module (the first and the last ones)
SHOWN_OPS = 8


def tree_repr(envoy: Any, is_op: Callable[[torch.nn.Module], bool]) -> str:
    """``envoy``'s subtree as nnsight prints it, the children ``is_op`` accepts summarized."""
    module = envoy._module
    named = envoy._named_children()
    modules = [(name, child) for name, child in named if not is_op(child._module)]
    ops = [name for name, child in named if is_op(child._module)]
    if isinstance(module, torch.nn.ModuleList) and modules and not ops:
        return _modulelist(module, [child for _, child in modules], is_op)
    extra = module.extra_repr()
    extra_lines = extra.split("\n") if extra else []
    direct: dict[str, list[str]] = {}
    mounts: list[str] = []
    for alias, path in envoy._aliases.items():
        if "." in path:
            mounts.append(alias)
        else:
            direct.setdefault(path, []).append(alias)
    child_lines = [f"({'/'.join([*direct.get(name, []), name])}): " + _indent(tree_repr(child, is_op))
                   for name, child in modules]
    child_lines += [f"({alias}): " + _indent(tree_repr(getattr(envoy, alias), is_op))
                    for alias in mounts if alias not in envoy._child_map]
    if ops:
        child_lines.append(f"(ops): {ops_summary(ops)}")
    lines = extra_lines + child_lines + _eproperty_lines(type(envoy))
    text = module._get_name() + "("
    if lines:
        if len(extra_lines) == 1 and len(lines) == 1:
            text += extra_lines[0]
        else:
            text += "\n  " + "\n  ".join(lines) + "\n"
    return text + ")"


def ops_summary(names: list[str]) -> str:
    """``"<n> ops: a, b, ..., z"``: the first and last op names when there are more than
    :data:`SHOWN_OPS`."""
    shown = names if len(names) <= SHOWN_OPS else [*names[:SHOWN_OPS - 2], "...", *names[-2:]]
    return f"{len(names)} op{'s' if len(names) != 1 else ''}: {', '.join(shown)}"


def _modulelist(module: torch.nn.Module, children: list[Any], is_op: Callable[[torch.nn.Module], bool]) -> str:
    # consecutive entries whose trees differ only in their op lines collapse too: ops numbered
    # across the model (``lifted_tensor_2``) or a call structure an entry has alone (the first
    # layer) would otherwise list every layer; the differing op lines then give counts only
    blocks: list[tuple[int, int, str]] = []
    for index, child in enumerate(children):
        text = tree_repr(child, is_op)
        if blocks and _same_modules(blocks[-1][2], text):
            blocks[-1] = (blocks[-1][0], index, _merge(blocks[-1][2], text))
        else:
            blocks.append((index, index, text))
    lines = [_indent(f"({start}): {text}" if start == end else f"({start}-{end}): {end - start + 1} x {text}")
             for start, end, text in blocks]
    return module._get_name() + "(\n  " + "\n  ".join(lines) + "\n)"


_OPS = "(ops): "


def _same_modules(first: str, second: str) -> bool:
    a, b = first.split("\n"), second.split("\n")
    return len(a) == len(b) and all(x == y or (x.lstrip().startswith(_OPS) and y.lstrip().startswith(_OPS))
                                    for x, y in zip(a, b))


def _merge(first: str, second: str) -> str:
    merged = []
    for x, y in zip(first.split("\n"), second.split("\n")):
        if x != y:
            indent = x[:len(x) - len(x.lstrip())]
            counts = sorted({*_counts(x), *_counts(y)})
            x = (f"{indent}{_OPS}{counts[0]}-{counts[-1]} ops, not the same in every entry"
                 " (print one entry to list them)")
        merged.append(x)
    return "\n".join(merged)


def _counts(line: str) -> list[int]:
    text = line.lstrip()[len(_OPS):]
    if text[0].isdigit() and "-" in text.split(" ")[0]:
        low, high = text.split(" ")[0].split("-")
        return [int(low), int(high)]
    return [int(text.split(" ")[0])]


def _eproperty_lines(envoy_class: type) -> list[str]:
    lines, seen = [], set()
    for cls in envoy_class.__mro__:
        for attribute in cls.__dict__.values():
            if isinstance(attribute, eproperty) and attribute.description is not None and attribute.name not in seen:
                seen.add(attribute.name)
                lines.append(str(attribute))
    return lines


def _indent(text: str) -> str:
    first, *rest = text.split("\n")
    return "\n".join([first, *("  " + line for line in rest)])
