"""Stateful call arguments: objects a module mutates in place, such as transformers' ``Cache``.

A decoder layer called with ``past_key_values=cache`` (``cache=cache`` from transformers 5.24)
appends to ``cache`` and returns only its hidden states. ``torch.export`` with a preserved call
signature hands the module a *rebuilt* copy of each pytree argument, so the update would never
reach the caller, and
``torch.export.unflatten`` cannot thread it either. While exporting, each such call is therefore
rewritten (see :func:`states_returned`) so that the module returns ``(output, [new states])``
and its caller copies the new states into its own objects. The extracted graphs keep eager's
contract: a state module's graph takes the cache object, writes its new state into that same
object (an :func:`assign_state` node) and returns only the module's output; a parent graph reads
the state back from the object it passed in (the graph rewrites are in :mod:`.state_graphs`). Hooks and nnsight envoys thus see the module's real
signature (``hidden_states, attention_mask=..., past_key_values=cache, ...``) and real output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..compat.torch.pytree import node_class, pytree, registered_class
from ..compat.transformers import cache_layers
from ..compat.torch.forwards import call_overridden
from ..compat.torch.forwards import call_override, restore_call_override
from .locking import CALL_LOCK

#: A top-level argument of a call: its position, or its keyword.
Key = int | str


#: the containers a plain argument is built of (subclasses count when reading values out)
SIMPLE_CONTAINERS = (tuple, list, dict)


def simple_spec(spec: pytree.TreeSpec, *, subclasses: bool = False) -> bool:
    """Whether every container in ``spec`` is a tuple, list, dict or None (or a leaf).

    With ``subclasses`` (reading values out with ``[key]``), subclasses such as namedtuples and
    ``ModelOutput`` count too; building containers of fx nodes needs the exact types.
    """
    if spec.is_leaf() or spec.type is type(None):
        return True
    kind = node_class(spec)  # (a namedtuple's: an LSTM's PackedSequence input raised TypeError here)
    if kind is None:
        return False
    if not (issubclass(kind, SIMPLE_CONTAINERS) if subclasses else kind in SIMPLE_CONTAINERS):
        return False
    return all(simple_spec(child, subclasses=subclasses) for child in spec.children())


def plain_container(value: object) -> bool:
    """Whether a call argument is built only of tuples, lists, dicts (or subclasses), None and leaves.

    A leaf, or a value whose own class is a registered pytree node of another kind (a transformers
    ``DynamicCache``), is decided without flattening it: this is asked at each layer's call, so it
    must not flatten the cache (with transformers' cache pytrees registered, flattening walks every
    layer of the cache)."""
    if pytree.tree_is_leaf(value):
        return True
    kind = registered_class(value)
    if kind is not None and kind is not type(None) and not issubclass(kind, SIMPLE_CONTAINERS):
        return False
    return simple_spec(pytree.tree_flatten(value)[1], subclasses=True)


def state_keys(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Key]:
    """Positions and keywords of the call's arguments that are not plain pytrees of leaves (tuples,
    lists, dicts, None, tensors, scalars): the objects a module may mutate, in call order."""
    return [i for i, a in enumerate(args) if not plain_container(a)] + [k for k, v in kwargs.items() if not plain_container(v)]


def argument(args: tuple[Any, ...], kwargs: dict[str, Any], key: Key) -> Any:
    """The argument at ``key`` (a position or a keyword)."""
    return args[key] if isinstance(key, int) else kwargs[key]


def _fresh(value: Any) -> Any:
    """A new object with the same state (a pytree round trip; tensors are shared)."""
    leaves, spec = pytree.tree_flatten(value)
    return pytree.tree_unflatten(leaves, spec)


@torch.fx.node.has_side_effect
def assign_state(target: Any, source: Any) -> None:
    """Give ``target`` the state of ``source`` (same type), keeping ``target``'s identity and, where
    the structure matches, the identity of the objects it holds (a cache's layer objects).

    Raises:
        TypeError: ``target`` and ``source`` are of different types.
    """
    if type(target) is not type(source):
        raise TypeError(f"cannot copy the state of a {type(source).__name__} into a {type(target).__name__}")
    if isinstance(target, list):
        if len(target) == len(source):
            for i, (old, new) in enumerate(zip(target, source)):
                if _assignable(old, new):
                    assign_state(old, new)
                else:
                    target[i] = new
        else:
            target[:] = source
        return
    # a dict's items, or an object's attributes
    state, new_state = (target, source) if isinstance(target, dict) else (vars(target), vars(source))
    for name in [n for n in state if n not in new_state]:
        del state[name]
    for name, new in new_state.items():
        if name in state and _assignable(state[name], new):
            assign_state(state[name], new)
        else:
            state[name] = new


#: Plumbing, not an op: op points skip nodes calling it.
assign_state.nnbridge_plumbing = True  # type: ignore[attr-defined]


def _assignable(old: object, new: object) -> bool:
    if old is new or type(old) is not type(new) or isinstance(old, torch.Tensor):
        return False
    return isinstance(old, (list, dict)) or (hasattr(old, "__dict__") and not isinstance(old, type))


@dataclass(frozen=True)
class UntouchedLayers:
    """The cache layers of a call's state argument that its code never touched while exported.

    Attributes:
        paths: paths of the layers it never touched (:data:`Path`: ``("layers", (3,))``).
        by_index: paths of the layers it touched only inside a ``Cache.update`` whose layer its
            layer index selected (its own layer: a reused sibling's graph touches its own instead).
    """

    paths: frozenset[Path]
    by_index: frozenset[Path] = frozenset()


#: What a module's call may pass in place of its one state argument (see :func:`states_returned`):
#: ``narrow(path, state)`` gives ``(stand_in, write_back)``, or None to pass the state itself;
#: ``write_back(new)`` gives the state the stand-in's new state ``new``.
Narrowing = Callable[[str, Any], tuple[Any, Callable[[Any], None]] | None]


@contextlib.contextmanager
def states_returned(modules: dict[str, torch.nn.Module], untouched: dict[str, list[UntouchedLayers | None]] | None = None,
                    *, narrow: Narrowing | None = None) -> Iterator[dict[str, list[list[Key]]]]:
    """While exporting, make each call of ``modules`` with stateful arguments return its new states.

    Inside (after export's signature-preserving pre-hook rebuilt the arguments) the module's
    forward runs on fresh copies of its stateful arguments and returns ``(output, [copies])``, so
    the preserved signature records the arguments as they were before the call and an output that
    carries the new state. Outside (around the whole call, hooks included), the copies' state is
    assigned to the caller's objects and only ``output`` is returned, as the eager call would.
    Calls without stateful arguments are untouched.

    Args:
        modules: ``{path: module}``; each module's forward is the class's or an instance override.
        untouched: filled, when given, with ``{path: [per invocation: the cache layers of its one
            state argument that its code never touched (:class:`UntouchedLayers`), or None]}``
            (None: no state argument, several, or layers that cannot be watched; see
            :mod:`nnbridge.compat.transformers.cache_layers`, which must be on around the export).
        narrow: for a call with one state argument, a stand-in to pass in its place (a cache
            holding only the layer the module writes, so that export's preserved signature does
            not carry every layer's tensors in and out of every call), and how to give its new
            state back to the argument (see :data:`Narrowing`).

    Yields:
        ``{path: [state keys of each invocation, in call order]}`` (``[]`` for a call without
        stateful arguments), filled while the body runs.
    """
    calls: dict[str, list[list[Key]]] = {}
    installed: list[tuple[torch.nn.Module, Callable[..., Any] | None, Callable[..., Any] | None]] = []
    try:
        for path, module in modules.items():
            forward = _returning_states(path, module.forward, untouched)
            installed.append((module, module.__dict__.get("forward"), call_override(module)))
            module.__dict__["forward"] = forward
            call_overridden(module, _assigning_states(path, calls, untouched, narrow=narrow))
        yield calls
    finally:
        for module, previous, call_impl in installed:
            call_overridden(module, None)
            if call_impl is not None:  # a bridged model's locked call (see .locking)
                restore_call_override(module, call_impl)
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous


def _returning_states(path: str, inner: Callable[..., Any], untouched: dict[str, list[UntouchedLayers | None]] | None
                      ) -> Callable[..., Any]:
    """The ``forward`` :func:`states_returned` gives the module at ``path`` (whose forward was
    ``inner``): a call with stateful arguments runs ``inner`` on fresh copies of them and returns
    ``(output, [copies])``, recording in ``untouched[path]`` the cache layers it never touched."""
    def forward(*args: Any, **kwargs: Any) -> Any:
        keys = state_keys(args, kwargs)
        if not keys:
            return inner(*args, **kwargs)
        positional, keywords = list(args), dict(kwargs)
        copies = []
        for key in keys:
            copy = _fresh(argument(args, kwargs, key))
            if isinstance(key, int):
                positional[key] = copy
            else:
                keywords[key] = copy
            copies.append(copy)
        if untouched is None or len(copies) != 1:
            return inner(*positional, **keywords), copies
        with cache_layers.scope(copies, plumbing=(__name__,)) as watched:
            output = inner(*positional, **keywords)
        if watched is not None:
            by_index = {p for _, p in watched.by_index - watched.touched}
            untouched[path][-1] = UntouchedLayers(
                frozenset(p for i, p in watched.paths.values() if (i, p) not in watched.touched) - by_index,
                frozenset(by_index))
        return output, copies
    return forward


def _assigning_states(path: str, calls: dict[str, list[list[Key]]],
                      untouched: dict[str, list[UntouchedLayers | None]] | None,
                      *, narrow: Narrowing | None = None) -> Callable[..., Any]:
    """The call override :func:`states_returned` gives the module at ``path`` (around the whole
    call, hooks included): records the call's state keys in ``calls[path]`` (and a place for its
    untouched layers), then assigns the states the :func:`_returning_states` forward returned to
    the caller's objects (through ``narrow``'s write-back when it gave a stand-in) and returns only
    the output."""
    def call(run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with CALL_LOCK:  # replaces a locked call for the extraction's duration (see .locking)
            return threaded_call(run, *args, **kwargs)

    def threaded_call(run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        keys = state_keys(args, kwargs)
        calls.setdefault(path, []).append(keys)
        if untouched is not None:
            untouched.setdefault(path, []).append(None)  # set by forward when its layers are watched
        if not keys:
            return run(*args, **kwargs)
        stand_in = narrow(path, argument(args, kwargs, keys[0])) if narrow is not None and len(keys) == 1 else None
        if stand_in is not None:
            replacement, write_back = stand_in
            positional, keywords = list(args), dict(kwargs)
            if isinstance(keys[0], int):
                positional[keys[0]] = replacement
            else:
                keywords[keys[0]] = replacement
            output, copies = run(*positional, **keywords)
            write_back(copies[0])
            return output
        output, copies = run(*args, **kwargs)
        for key, copy in zip(keys, copies):
            assign_state(argument(args, kwargs, key), copy)
        return output
    return call


def _structure(value: Any, untouched: frozenset[Any] = frozenset(), path: tuple[Any, ...] = ()) -> Any:
    """``value``'s type and non-tensor state, recursively through lists, tuples, dicts and object
    attributes, with every tensor as ``torch.Tensor`` and the object at each path in ``untouched``
    as its type alone: two objects with equal structures flatten to equal pytree specs when their
    flatten reads only that state (as transformers' ``Cache`` pytree does: tensors become leaves,
    everything else the spec's context), outside ``untouched``."""
    if isinstance(value, torch.Tensor):
        return torch.Tensor
    kind = type(value)
    if path in untouched:
        return (kind,)
    if kind is list or kind is tuple:
        return (kind, *(_structure(v, untouched, (*path, (i,))) for i, v in enumerate(value)))
    if kind is dict:
        return (kind, *value, *(_structure(v, untouched, (*path, (k,))) for k, v in value.items()))
    state = getattr(value, "__dict__", None)
    if state is not None and not isinstance(value, type):
        return (kind, *state, *(_structure(v, untouched, (*path, k)) for k, v in state.items()))
    return (kind, value)


#: Marks, in an :func:`_untouched_trie`, an object compared by its type alone.
_BY_TYPE = object()


def _untouched_trie(untouched: frozenset[Any]) -> Any:
    """``untouched`` (paths, see :func:`_structure`) as nested dicts ``{step: {step: _BY_TYPE}}``
    for :func:`_matches`: :data:`_BY_TYPE` for the empty path, None for no path. A path below
    another one is left out (:func:`_structure` stops at the shorter one)."""
    if () in untouched:
        return _BY_TYPE
    root: dict[Any, Any] = {}
    for path in sorted(untouched, key=len):
        node: Any = root
        for step in path[:-1]:
            node = node.setdefault(step, {})
            if node is _BY_TYPE:
                break
        else:
            node[path[-1]] = _BY_TYPE
    return root or None


def _same(a: Any, b: Any) -> bool:
    return a is b or bool(a == b)


def _matches(value: Any, expected: Any, trie: Any) -> bool:
    """``_structure(value, untouched) == expected`` (tuple equality: lengths, then items in order,
    each by identity or ``==``), for the ``untouched`` paths ``trie`` holds
    (:func:`_untouched_trie` of them, or the part below this object), compared while walking:
    nothing is built, and the walk stops at the first difference (it runs in every decode step's
    cache check).

    Raises:
        what a value's ``==`` raises, and RecursionError for a cycle (:class:`SpecCheck` then
        checks in full).
    """
    if isinstance(value, torch.Tensor):
        return expected is torch.Tensor
    if type(expected) is not tuple:
        return False
    kind = type(value)
    if trie is _BY_TYPE:
        return len(expected) == 1 and _same(kind, expected[0])
    if kind is list or kind is tuple:
        return len(expected) == len(value) + 1 and _same(kind, expected[0]) and \
            _items_match(value, None, expected, start=1, trie=trie)
    mapping = value if kind is dict else getattr(value, "__dict__", None)
    if mapping is None or (kind is not dict and isinstance(value, type)):
        return len(expected) == 2 and _same(kind, expected[0]) and _same(value, expected[1])
    # (kind, *keys, *structures of the values): a dict's paths step by (key,), an object's by name
    n = len(mapping)
    if len(expected) != 1 + 2 * n or not _same(kind, expected[0]):
        return False
    for j, key in enumerate(mapping):
        other = expected[1 + j]
        if not (key is other or key == other):
            return False
    steps = None if trie is None else [(key,) for key in mapping] if kind is dict else list(mapping)
    return _items_match(mapping.values(), steps, expected, start=1 + n, trie=trie)


def _items_match(items: Any, steps: list[Any] | None, expected: tuple[Any, ...], *, start: int, trie: Any) -> bool:
    """:func:`_matches` of each of a container's ``items`` against ``expected[start:]``, with its
    path step (``steps[k]``, or ``(k,)`` for a list's). Tensors and objects compared by type (most
    of a cache) are decided here, without a call; anything else (and any mismatch) by
    :func:`_matches`. (The expected type of an object compared by type is never a tensor class:
    :func:`_structure` gives ``torch.Tensor`` for a tensor before it looks at ``untouched``.)"""
    for k, item in enumerate(items):
        other = expected[start + k]
        if type(item) is torch.Tensor:
            if other is not torch.Tensor:
                return False
            continue
        below = None if trie is None else trie.get((k,) if steps is None else steps[k])
        if below is _BY_TYPE and type(other) is tuple and len(other) == 1 and type(item) is other[0]:
            continue
        if not _matches(item, other, below):
            return False
    return True


class SpecCheck:
    """Whether a state argument (a ``Cache``) has the pytree spec a graph was extracted for.

    A full check flattens the object (every layer of a cache); the object's structure (its types
    and non-tensor state, tensors abstracted) is remembered when it holds, so a later call with an
    object of a remembered structure is checked by one walk that builds no spec. At most
    :attr:`REMEMBERED` structures are kept.

    With ``untouched`` (the paths of cache layers the graph's code never touched while it was
    exported, and that the graph neither reads nor writes), those layers are compared by type
    only: their state cannot have shaped the graph. So a layer an nnsight ``.skip()`` left
    unwritten (as in eager) does not fail the check of every later layer's graph, and a check
    costs one walk of the cache's top level plus the layers the graph depends on.

    Example::

        check = SpecCheck(pytree.tree_flatten(cache)[1])
        check(cache)    # True: flattens, remembers the structure
        check(cache)    # True: the structure is remembered
    """

    REMEMBERED = 16

    def __init__(self, spec: pytree.TreeSpec, untouched: frozenset[Path] = frozenset()):
        self.spec = spec
        self.held: set[Any] = set()
        self.untouched = untouched
        self.expected: Any = None
        if untouched:
            try:  # the narrowed structure of an object of the extracted spec (a round trip keeps it)
                self.expected = _structure(pytree.tree_unflatten([torch.empty(0)] * spec.num_leaves, spec), untouched)
            except Exception:  # noqa: BLE001 - an object that cannot be rebuilt: check in full
                self.untouched = frozenset()
        self._trie = _untouched_trie(self.untouched)

    def __call__(self, value: Any) -> bool:
        if self.untouched:
            try:
                return _matches(value, self.expected, self._trie)
            except Exception:  # noqa: BLE001 - a value whose == raises, or a cycle: check in full
                pass
        try:
            if any(_matches(value, held, None) for held in self.held):
                return True
        except Exception:  # noqa: BLE001 - likewise
            pass
        try:
            structure = _structure(value)
            if structure in self.held:
                return True
        except (TypeError, RecursionError):  # an unhashable value, or a cycle: check in full
            structure = None
        if pytree.tree_flatten(value)[1] != self.spec:
            return False
        if structure is not None:
            if len(self.held) >= self.REMEMBERED:
                self.held.clear()
            self.held.add(structure)
        return True


#: A path into a state object: each step an attribute name (``str``) or a one-element tuple holding
#: an item key (a list index or a dict key): ``("layers", (3,), "keys")`` is ``obj.layers[3].keys``.
Path = tuple[str | tuple[Any], ...]


def _slot(obj: Any, step: str | tuple[Any]) -> tuple[Any, Any]:
    """``(mapping or list, key)`` holding ``step`` of ``obj`` (an attribute lives in ``vars(obj)``,
    where :func:`assign_state` and transformers' cache pytree read and write it)."""
    return (vars(obj), step) if isinstance(step, str) else (obj, step[0])


def _at(obj: Any, path: Path) -> Any:
    for step in path:
        holder, key = _slot(obj, step)
        obj = holder[key]
    return obj


def read_state(target: Any, spec: pytree.TreeSpec, paths: tuple[Path, ...]) -> tuple[Any, ...]:
    """The values at ``paths`` in ``target``: the pytree leaves of a state object (a ``Cache``'s
    tensors) that a graph reads, without flattening the whole object.

    ``spec`` is the object's pytree spec the graph was extracted for; the bridge checks it before
    the call (see :func:`.in_place._state_specs_hold`), it is not used here.

    Returns:
        one value per path, in order.
    """
    return tuple(_at(target, path) for path in paths)


@torch.fx.node.has_side_effect
def write_state(target: Any, spec: pytree.TreeSpec, deleted: tuple[Path, ...], paths: tuple[Path, ...],
                values: list[Any]) -> None:
    """Write the parts of a state object a module call changed: delete the attributes or dict items
    at ``deleted``, then set ``values[i]`` at ``paths[i]``, in order. Every other part of ``target``
    (the other layers of a ``Cache``) is left untouched; the result is what :func:`assign_state`
    of the whole new state gives, in time proportional to the change.

    ``spec`` is the pytree spec ``target`` had when the call began, as the graph was extracted for
    it; the bridge checks it before the call (see :func:`.in_place._state_specs_hold`), it is not
    used here.

    Raises:
        AttributeError, KeyError, IndexError: a path does not exist in ``target`` (the object is
            not in the structure the graph was extracted for).
    """
    for path in deleted:
        holder, key = _slot(_at(target, path[:-1]), path[-1])
        del holder[key]
    for path, value in zip(paths, values):
        holder, key = _slot(_at(target, path[:-1]), path[-1])
        holder[key] = value


#: Plumbing, not ops: op points skip nodes calling them.
read_state.nnbridge_plumbing = True  # type: ignore[attr-defined]
write_state.nnbridge_plumbing = True  # type: ignore[attr-defined]
