"""Layer reuse (``ExtractionOptions.reuse_layers``): export one representative of identical sibling
layers and build every sibling's graph from the representative's.

Entries of one ``ModuleList`` (decoder layers) of the same classes, parameter and buffer shapes and
non-tensor attributes give the same graph up to parameter binding, provided they are called the
same way. This module decides which entries qualify (:func:`plan`, :func:`confirm`), stubs the
siblings while exporting (:func:`sibling_stub`: only the representative is traced), and makes sure
the trace could not depend on what differs between them: an attribute whose value differs between
entries of one class (``layer_idx``) is watched while exporting (:func:`reads_watched`) and any
read of it on a representative makes the extraction start again without reuse
(:class:`ReuseFallback`). A sibling's graph is then a copy of its representative's unflattened
graph, built by :class:`~.building.GraphBuilder` over the sibling's own module (its parameters,
buffers, op points), so its node names and NodePaths are those a full extraction gives.

Covered: siblings called once each, with the same call structure (equal non-tensor values, tensor
leaves of equal shape, dtype, device and ``requires_grad``, the same symbolic shapes while
exporting) and no stateful argument (a ``DynamicCache``: ``use_cache=False``); any doubt means
per-layer export. Example::

    extract(model, (ids,), {"use_cache": False}, ExtractionOptions(reuse_layers=True), ...)
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, Node

from .module_tree import named_real_modules
from .state import state_keys
from ..compat.pytree import pytree

_PRIMITIVES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
#: nn.Module's own bookkeeping, and the call wrapper extraction installs on every module while it
#: runs (``_call_impl``, see :mod:`.locking`)
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) | {"_call_impl"}
_MISSING = object()


class ReuseFallback(Exception):
    """Reuse turned out unsafe for this call: extraction starts again with per-layer export."""


@dataclass
class ReusePlan:
    """Siblings and their representatives.

    Attributes:
        siblings: ``{sibling path: representative path}`` (paths from the extracted module).
        watched: ``[(module, attribute)]`` of the representatives' subtrees whose values differ
            between siblings: export must not read them.
    """

    siblings: dict[str, str] = field(default_factory=dict)
    watched: list[tuple[torch.nn.Module, str]] = field(default_factory=list)

    def representatives(self) -> set[str]:
        return set(self.siblings.values())

    def source(self, fqn: str) -> str:
        """The path whose graph ``fqn``'s is built from (``fqn`` itself outside siblings)."""
        for sibling, rep in self.siblings.items():
            if fqn == sibling or fqn.startswith(f"{sibling}."):
                return rep + fqn[len(sibling):]
        return fqn

    def covers(self, fqn: str) -> bool:
        """Whether ``fqn`` is in (or is) a representative's or a sibling's subtree."""
        return any(fqn == root or fqn.startswith(f"{root}.")
                   for root in (*self.siblings, *self.siblings.values()))


def same(a: Any, b: Any) -> bool:
    """Whether two attribute values are certainly interchangeable (conservative: unknown types are
    the same only when they are the same object)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, _PRIMITIVES):
        return bool(a == b)
    if isinstance(a, _OwnMethod):
        return a[0] is b[0]
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, functools.partial):  # transformers' activations: partial(gelu, approximate=...)
        return same(a.func, b.func) and same(a.args, b.args) and same(a.keywords, b.keywords)
    to_dict = getattr(a, "to_dict", None)  # a transformers config
    if callable(to_dict) and type(a).__module__.startswith("transformers."):
        return same(to_dict(), b.to_dict())
    return False


def _structure(entry: torch.nn.Module) -> tuple[Any, ...] | None:
    """Module classes, parameters and buffers of ``entry``'s subtree; None when it holds a plain
    tensor attribute (export would bake it in)."""
    parts: list[Any] = []
    for path, sub in named_real_modules(entry):
        params = tuple((n, tuple(p.shape), p.dtype, p.device, p.requires_grad, type(p))
                       for n, p in sub.named_parameters(recurse=False))
        buffers = tuple((n, tuple(b.shape), b.dtype, b.device, type(b)) for n, b in sub.named_buffers(recurse=False))
        names = tuple(sorted(k for k in vars(sub) if k not in _MODULE_INTERNALS))
        if any(isinstance(vars(sub)[k], torch.Tensor) for k in names):
            return None
        parts.append((path, type(sub), params, buffers, names, tuple(sub.__dict__.get("_non_persistent_buffers_set", ()))))
    return tuple(parts)


class _OwnMethod(tuple):
    """A method bound to the module that holds it (torch's per-instance ``_call_impl``): the same
    for siblings whose functions are the same."""


def _value(sub: torch.nn.Module, value: Any) -> Any:
    if getattr(value, "__self__", None) is sub and hasattr(value, "__func__"):
        return _OwnMethod((value.__func__,))
    return value


def _attributes(entry: torch.nn.Module) -> dict[tuple[str, str], Any]:
    return {(path, k): _value(sub, v) for path, sub in named_real_modules(entry) for k, v in vars(sub).items()
            if k not in _MODULE_INTERNALS}


def plan(module: torch.nn.Module, excluded: set[str]) -> ReusePlan:
    """Candidate siblings: entries of one ``ModuleList`` with the same structure and the same
    attributes, except attributes whose values differ between all of them (``layer_idx``), which
    are watched. Entries containing or inside an ``excluded`` path (skipped, custom, shared) are
    left out."""
    result = ReusePlan()
    for fqn, container in named_real_modules(module):
        if not isinstance(container, torch.nn.ModuleList) or len(container) < 2:
            continue
        entries = [(f"{fqn}.{name}" if fqn else name, child) for name, child in container.named_children()]
        entries = [(path, child) for path, child in entries
                   if not any(e == path or e.startswith(f"{path}.") or path.startswith(f"{e}.") for e in excluded)]
        by_structure: dict[Any, list[tuple[str, torch.nn.Module]]] = {}
        ids = [id(child) for _, child in entries]
        for path, child in entries:
            if ids.count(id(child)) > 1:
                continue  # a shared entry
            key = _structure(child)
            if key is not None:
                by_structure.setdefault(key, []).append((path, child))
        for group in by_structure.values():
            if len(group) < 2:
                continue
            values = [_attributes(child) for _, child in group]
            distinct = {k for k in values[0]
                        if all(not same(values[i][k], values[j][k])
                               for i in range(len(group)) for j in range(i + 1, len(group)))}
            classes: list[list[int]] = []
            for i in range(len(group)):
                for members in classes:
                    if all(same(values[i][k], values[members[0]][k]) for k in values[i] if k not in distinct):
                        members.append(i)
                        break
                else:
                    classes.append([i])
            for members in classes:
                if len(members) < 2:
                    continue
                rep_path, rep = group[members[0]]
                for i in members[1:]:
                    result.siblings[group[i][0]] = rep_path
                for path, name in sorted(distinct):
                    result.watched.append((rep.get_submodule(path) if path else rep, name))
    return result


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad, leaf.layout)
    return ("value", leaf)


def _same_call(a: Any, b: Any) -> bool:
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    if spec_a != spec_b or len(leaves_a) != len(leaves_b):
        return False
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if _leaf_key(x) != _leaf_key(y):
                return False
        elif not same(x, y):
            return False
    return True


def confirm(module: torch.nn.Module, candidates: ReusePlan, calls: dict[str, list]) -> ReusePlan:
    """The candidates whose recorded calls allow reuse: the representative and the sibling called
    once each, with the same call structure and output structure, and no stateful argument."""
    result = ReusePlan()
    for sibling, rep in candidates.siblings.items():
        mine, theirs = calls.get(sibling, []), calls.get(rep, [])
        if len(mine) != 1 or len(theirs) != 1:
            continue
        (a, k, out), (ra, rk, rout) = mine[0], theirs[0]
        if state_keys(a, k) or state_keys(ra, rk):
            continue
        if _same_call((a, k), (ra, rk)) and _same_call(out, rout):
            result.siblings[sibling] = rep
    kept = [id(sub) for rep in result.representatives() for _, sub in named_real_modules(module.get_submodule(rep))]
    result.watched = [(m, n) for m, n in candidates.watched if id(m) in kept]
    return result


class _Watched:
    """A class attribute standing in for instance attribute ``name`` while exporting: values are
    the instances' own; a read or write on a watched instance is recorded."""

    def __init__(self, name: str, original: Any, watched: set[int], reads: list[str]):
        self.name, self.original, self.watched, self.reads = name, original, watched, reads

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            if self.original is _MISSING:
                raise AttributeError(self.name)
            return self.original
        if id(obj) in self.watched:
            self.reads.append(f"{type(obj).__name__}.{self.name}")
        values = obj.__dict__
        if self.name in values:
            return values[self.name]
        if self.original is not _MISSING:
            getter = getattr(type(self.original), "__get__", None)
            return getter(self.original, obj, type(obj)) if getter is not None else self.original
        return type(obj).__getattr__(obj, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        if id(obj) in self.watched:
            self.reads.append(f"{type(obj).__name__}.{self.name} (written)")
        obj.__dict__[self.name] = value


@contextlib.contextmanager
def reads_watched(watched: list[tuple[torch.nn.Module, str]]) -> Iterator[list[str]]:
    """Record reads of the watched instance attributes for the body's duration (their classes get
    a stand-in class attribute, removed after; values read are unchanged)."""
    reads: list[str] = []
    by_class: dict[tuple[type, str], set[int]] = {}
    for sub, name in watched:
        by_class.setdefault((type(sub), name), set()).add(id(sub))
    installed: list[tuple[type, str, Any]] = []
    try:
        for (cls, name), ids in by_class.items():
            original = cls.__dict__.get(name, _MISSING)
            if original is not _MISSING and hasattr(type(original), "__set__"):
                raise ReuseFallback(f"{cls.__name__}.{name} is a data descriptor")
            inherited = _MISSING
            for base in cls.__mro__[1:]:
                if name in base.__dict__:
                    inherited = base.__dict__[name]
                    break
            setattr(cls, name, _Watched(name, original if original is not _MISSING else inherited, ids, reads))
            installed.append((cls, name, original))
        yield reads
    finally:
        for cls, name, original in reversed(installed):
            if original is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, original)


def sibling_stub(sibling: str, rep: str, seen: dict[str, tuple[Any, Any]]) -> Callable[..., Any]:
    """What a sibling's ``forward`` is while exporting: outputs shaped as the representative's
    (traced just before, in ``seen``), as zeros depending on the sibling's inputs. Raises
    :class:`ReuseFallback` when the sibling's inputs differ from the representative's (symbolic
    shapes, dtypes, values) or an output's shape cannot be taken from an input."""
    def stub(*args: Any, **kwargs: Any) -> Any:
        if rep not in seen:
            raise ReuseFallback(f"'{sibling}' ran before '{rep}'")
        (rep_inputs, rep_output) = seen[rep]
        leaves, spec = pytree.tree_flatten((args, kwargs))
        rep_leaves, rep_spec = pytree.tree_flatten(rep_inputs)
        if spec != rep_spec or len(leaves) != len(rep_leaves):
            raise ReuseFallback(f"'{sibling}' is called with another structure than '{rep}'")
        for mine, theirs in zip(leaves, rep_leaves):
            if isinstance(mine, torch.Tensor) != isinstance(theirs, torch.Tensor):
                raise ReuseFallback(f"'{sibling}' is called with other values than '{rep}'")
            if isinstance(mine, torch.Tensor):
                if (str(tuple(mine.shape)) != str(tuple(theirs.shape)) or mine.dtype != theirs.dtype
                        or mine.device != theirs.device):
                    raise ReuseFallback(f"'{sibling}' is called with other shapes than '{rep}'")
            elif not same(mine, theirs):
                raise ReuseFallback(f"'{sibling}' is called with other values than '{rep}'")
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        rep_tensors = [t for t in rep_leaves if isinstance(t, torch.Tensor)]
        floats = [t for t in tensors if t.is_floating_point()]
        dep = sum((0 * t.sum() for t in floats[1:]), 0 * floats[0].sum()) if floats else None

        def like(out: torch.Tensor) -> torch.Tensor:
            shape = str(tuple(out.shape))
            for mine, theirs in zip(tensors, rep_tensors):
                if str(tuple(theirs.shape)) == shape:
                    zeros = torch.zeros_like(mine, dtype=out.dtype)
                    return zeros + dep.to(out.dtype) if dep is not None and out.is_floating_point() else zeros
            raise ReuseFallback(f"an output of '{rep}' has no input's shape")
        return pytree.tree_map_only(torch.Tensor, like, rep_output)
    return stub


def copy_graph(graph: Graph, numbers: dict[Node, int]) -> tuple[Graph, dict[Node, int]]:
    """A copy of ``graph`` (node meta copied shallowly, as fx does) and the invocation numbers of
    its ``call_module`` nodes, carried over from ``numbers``."""
    memo: dict[Any, Any] = {None: None}  # fx's __deepcopy__ replaces an empty memo by its own
    copied = copy.deepcopy(graph, memo)
    return copied, {memo[n]: numbers[n] for n in graph.nodes if n in numbers}


class ReusedHolder:
    """Stands in for a sibling's unflattened invocation module: its own copy of the
    representative's graph; attributes (lifted constants, specs) looked up on the representative's."""

    def __init__(self, graph: Graph, source: Any):
        self.graph, self._source = graph, source

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_source"], name)


def placeholder_signature(graph: Graph) -> list[tuple[str, str]]:
    """Placeholder targets and the (symbolic) shapes export gave them."""
    result = []
    for node in graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            result.append((str(node.target), str(tuple(val.shape)) if isinstance(val, torch.Tensor) else type(val).__name__))
    return result


def check_reused_export(plan: ReusePlan, exported: torch.export.ExportedProgram, stubs: dict[str, str],
                        states: dict[str, list[list[Any]]]) -> None:
    """Raise :class:`ReuseFallback` unless the export kept the siblings interchangeable: no module
    of a representative's or sibling's subtree was stubbed or threads state, and every sibling's
    preserved call signature has its representative's input and output structure."""
    for fqn in stubs:
        if plan.covers(fqn):
            raise ReuseFallback(f"'{fqn}' is opaque")
    for fqn, keys in states.items():
        if plan.covers(fqn) and any(keys):
            raise ReuseFallback(f"'{fqn}' threads state")
    signatures = {entry.fqn: entry.signature for entry in exported.module_call_graph}
    for sibling, rep in plan.siblings.items():
        mine, theirs = signatures.get(f"model.{sibling}"), signatures.get(f"model.{rep}")
        if mine is None or theirs is None or mine.in_spec != theirs.in_spec or mine.out_spec != theirs.out_spec:
            raise ReuseFallback(f"'{sibling}' has another call signature than '{rep}'")
