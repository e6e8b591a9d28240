"""What a sibling layer's ``forward`` is while its representative is exported (layer reuse).

Its one job: :func:`sibling_stub`. Only the representative of identical sibling layers is traced
(see :mod:`.reuse_plan`); each sibling runs a stub that checks it is called as its representative
was and returns zeros shaped as the representative's output, which depend on the sibling's own
inputs (:func:`~nnbridge.compat.torch.sibling_zeros.sibling_zeros`), so the export still records
how every layer feeds the next. With a transformers ``Cache`` the stub also replays the
representative's cache updates on the sibling's own cache layer: a first update of an empty
layer runs the cache's own code out of the trace, and only the tensors it wrote enter the trace
(one node each); any other update is traced as it runs. Example::

    sibling.__dict__["forward"] = sibling_stub("layers.1", "layers.0", seen)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..graph.state import state_keys
from ..compat.torch.pytree import pytree
from ..compat.torch.sibling_zeros import sibling_zeros
from ..compat.torch.capture import tensor_version
from ..compat.torch.fake_tensors import untraced
from ..compat.transformers.cache_updates import CacheTrace
from .reuse_plan import CacheRebinding, ReuseFallback
from .sibling_compare import is_cache, same, same_traced_layer


def sibling_stub(sibling: str, rep: str, seen: dict[str, tuple[Any, Any]], *, rebinding: CacheRebinding | None = None,
                 trace: CacheTrace | None = None, rep_modules: frozenset[int] = frozenset()) -> Callable[..., Any]:
    """What a sibling's ``forward`` is while exporting: outputs shaped as the representative's
    (traced just before, in ``seen``), as zeros depending on the sibling's inputs. With a cache
    (``rebinding``) the stub also makes the cache updates the representative made
    (``trace.updates`` of the modules ``rep_modules``) on its own cache layer, with zeros of the
    same shapes (a first update of an empty layer out of the trace, see
    :meth:`_StubInputs.replay_updates`), so later layers and the model's output see the cache
    state the real layer would leave; a tensor an update takes besides keys and values (transformers 5.24 passes the
    attention's ``position_ids``) must be one of the representative's inputs, and the sibling's
    update takes its own input in its place. Raises :class:`~.reuse_plan.ReuseFallback` when the
    sibling's inputs differ from the representative's (symbolic shapes, dtypes, values, its cache
    layer's state), an update takes another tensor, or an output's shape cannot be taken from an
    input."""
    def stub(*args: Any, **kwargs: Any) -> Any:
        if rep not in seen:
            raise ReuseFallback(f"'{sibling}' ran before '{rep}'")
        (rep_inputs, rep_output) = seen[rep]
        keys, rep_keys = state_keys(args, kwargs), state_keys(*rep_inputs)
        if keys != rep_keys or (keys and (rebinding is None or len(keys) != 1)):
            raise ReuseFallback(f"'{sibling}' is called with other state arguments than '{rep}'")
        cache: Any = None
        if keys:
            assert rebinding is not None
            cache = _own_cache(sibling, rep, (args, kwargs), rep_call=rep_inputs, key=keys[0], rebinding=rebinding)
            rep_output = rep_output[0]  # a threaded call returns (output, [new states]), see .state
        inputs = _matched_inputs(sibling, rep, (args, kwargs), rep_call=rep_inputs, keys=keys)
        if keys:
            assert rebinding is not None and trace is not None
            inputs.replay_updates(cache, rebinding.index, [u for u in trace.updates if u[0] in rep_modules])
        return pytree.tree_map_only(torch.Tensor, inputs.like, rep_output)
    return stub


def _own_cache(sibling: str, rep: str, call: tuple[tuple[Any, ...], dict[str, Any]], *,
               rep_call: tuple[tuple[Any, ...], dict[str, Any]], key: Any, rebinding: CacheRebinding) -> Any:
    """The sibling's cache argument (at position or keyword ``key`` of ``call``); raises
    :class:`~.reuse_plan.ReuseFallback` unless it is a cache of the representative's type and
    number of layers whose layer ``rebinding.index`` is in the state the representative's layer
    ``rebinding.rep_index`` was in (:func:`~.sibling_compare.same_traced_layer`)."""
    args, kwargs = call
    cache = args[key] if isinstance(key, int) else kwargs[key]
    rep_cache = rep_call[0][key] if isinstance(key, int) else rep_call[1][key]
    if (type(cache) is not type(rep_cache) or not is_cache(cache)
            or len(cache.layers) != len(rep_cache.layers) or rebinding.index >= len(cache.layers)
            or not same_traced_layer(cache.layers[rebinding.index],
                                     rep_cache.layers[rebinding.rep_index])):
        raise ReuseFallback(f"'{sibling}''s cache layer is not in the state '{rep}''s was")
    return cache


def _tensors_of(obj: Any, *, skip: Any = None) -> dict[Any, torch.Tensor]:
    """The tensors an object holds: in its attributes and, below them, in lists, tuples, dicts and
    the attributes of objects other than ``skip``, keyed by path (compared by identity)."""
    found: dict[Any, torch.Tensor] = {}

    def walk(value: Any, path: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            found[path] = value
        elif depth > 8 or value is skip or isinstance(value, (str, bytes, int, float, type)):
            return
        elif isinstance(value, (list, tuple)):
            for k, item in enumerate(value):
                walk(item, (path, k), depth + 1)
        elif isinstance(value, dict):
            for k, item in value.items():
                walk(item, (path, k), depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
            for k, item in vars(value).items():
                walk(item, (path, k) if depth else k, depth + 1)
    walk(obj, (), 0)
    return found


def _same_tensors(a: dict[Any, torch.Tensor], b: dict[Any, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


def _without(args: tuple[Any, ...], kwargs: dict[str, Any], keys: list[Any]) -> tuple[Any, Any]:
    """The call with its state arguments (positions or keywords ``keys``) replaced by None."""
    positional, keywords = list(args), dict(kwargs)
    for key in keys:
        if isinstance(key, int):
            positional[key] = None
        else:
            keywords[key] = None
    return tuple(positional), keywords


def _matched_inputs(sibling: str, rep: str, call: tuple[tuple[Any, ...], dict[str, Any]], *,
                    rep_call: tuple[tuple[Any, ...], dict[str, Any]], keys: list[Any]) -> _StubInputs:
    """The sibling's tensor inputs next to the representative's; raises
    :class:`~.reuse_plan.ReuseFallback` unless, state arguments (``keys``) left out, the sibling is
    called with the representative's structure, tensors of its (symbolic) shapes, dtypes and
    devices, other values that are :func:`~.sibling_compare.same`, and at least one tensor."""
    leaves, spec = pytree.tree_flatten(_without(call[0], call[1], keys))
    rep_leaves, rep_spec = pytree.tree_flatten(_without(rep_call[0], rep_call[1], keys))
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
    if not tensors:
        raise ReuseFallback(f"'{sibling}' has no tensor input")
    return _StubInputs(rep, tensors, rep_tensors, list(tensors))


@dataclass
class _StubInputs:
    """A sibling stub's tensor inputs and the values it makes from them.

    Attributes:
        rep: the representative's path (for error messages).
        tensors, rep_tensors: the sibling's tensor inputs and the representative's, in the same order.
        depends_on: what every value the stub makes depends on (see
            :func:`~nnbridge.compat.torch.sibling_zeros.sibling_zeros`): the sibling's tensor
            inputs, then what each replayed cache update returned.
    """

    rep: str
    tensors: list[torch.Tensor]
    rep_tensors: list[torch.Tensor]
    depends_on: list[torch.Tensor]

    def sizes(self, out: torch.Tensor) -> list[Any]:
        """``out``'s sizes, each read off the sibling's input that has it in the representative's call."""
        found: list[Any] = []
        for size in out.shape:
            if not isinstance(size, torch.SymInt):
                found.append(int(size))
                continue
            for mine, theirs in zip(self.tensors, self.rep_tensors):
                dims = [d for d, s in enumerate(theirs.shape) if str(s) == str(size)]
                if dims:
                    found.append(mine.shape[dims[0]])
                    break
            else:
                raise ReuseFallback(f"a cache update of '{self.rep}' has a size no input has: {size}")
        return found

    def zeros(self, out: torch.Tensor) -> torch.Tensor:
        return sibling_zeros(self.depends_on, self.sizes(out), out.dtype)

    def replay_updates(self, cache: Any, index: int,
                       updates: list[tuple[int, Any, Any, tuple[Any, ...], dict[str, Any]]]) -> None:
        """Make the representative's cache ``updates`` (see
        :class:`~nnbridge.compat.transformers.cache_updates.CacheTrace`) on ``cache``'s layer
        ``index``, with zeros of the same shapes and the sibling's own inputs in place of the
        representative's: out of the trace where :meth:`_replayed_untraced` can, else traced."""
        own = {id(theirs): mine for mine, theirs in zip(self.tensors, self.rep_tensors)}

        def own_input(value: torch.Tensor) -> torch.Tensor:
            # transformers >= 5.24 passes the attention's kwargs (position_ids) to the update
            if id(value) not in own:
                raise ReuseFallback(f"a cache update of '{self.rep}' takes tensors besides keys, values and its inputs")
            return own[id(value)]
        for _, key_states, value_states, extra_args, extra_kwargs in updates:
            extra_args, extra_kwargs = pytree.tree_map_only(torch.Tensor, own_input, (extra_args, extra_kwargs))
            update = (key_states, value_states, extra_args, extra_kwargs)
            if not self._replayed_untraced(cache, index, update):
                written = cache.update(self.zeros(key_states), self.zeros(value_states), index,
                                       *extra_args, **extra_kwargs)
                # the output depends on what was written, as the real layer's does (else export drops
                # the writes when nothing after reads them, and the caller's cache would lose them)
                self.depends_on.extend(t for t in pytree.tree_leaves(written) if isinstance(t, torch.Tensor))

    def _replayed_untraced(self, cache: Any, index: int, update: tuple[Any, Any, tuple[Any, ...], dict[str, Any]]
                           ) -> bool:
        """Make one cache update on ``cache``'s layer ``index``, when that layer holds no tensor
        yet (a first call's), with the cache's own code run on fake tensors and out of the trace;
        then put each tensor it assigned to the layer into the trace as one
        :func:`~nnbridge.compat.torch.sibling_zeros.sibling_zeros` node of its shape, depending on
        the sibling's inputs and what earlier updates wrote (a cache layer's lazily made empty
        tensors and its ``cat`` leave no nodes: a deep model's export holds one node per written
        tensor). False, with the cache as it was, when the layer holds tensors or the update does
        anything else: replaces the layer, writes a tensor outside the layer's own attributes or
        in place, makes a tensor of a size no input has, or raises; the update is then traced as
        it runs."""
        key_states, value_states, extra_args, extra_kwargs = update
        layer = cache.layers[index]
        if _tensors_of(layer):  # a later update reads what the layer holds
            return False
        saved_layer, saved_cache = dict(vars(layer)), dict(vars(cache))
        # the cache's other layers are not looked at (cache narrowing records which ones a call reads)
        rest = _tensors_of(cache, skip=cache.layers)
        versions = [tensor_version(t) for t in rest.values()]
        try:
            with untraced():
                cache.update(key_states.new_zeros(self.sizes(key_states)),
                             value_states.new_zeros(self.sizes(value_states)), index, *extra_args, **extra_kwargs)
            written = _tensors_of(layer)
            if (cache.layers[index] is not layer or set(written) - set(vars(layer))
                    or not _same_tensors(_tensors_of(cache, skip=cache.layers), rest)
                    or versions != [tensor_version(t) for t in rest.values()]):
                raise ReuseFallback("not an assignment of the layer's own attributes")
            sizes = {name: self.sizes(value) for name, value in written.items()}
        except Exception:  # noqa: BLE001 - anything else is traced as it runs (see the docstring)
            if cache.layers[index] is not layer:
                cache.layers[index] = layer
            vars(layer).clear()
            vars(layer).update(saved_layer)
            vars(cache).clear()
            vars(cache).update(saved_cache)
            return False
        sources = list(self.depends_on)
        for name, value in written.items():
            vars(layer)[name] = made = sibling_zeros(sources, sizes[name], value.dtype)
            self.depends_on.append(made)
        return True

    def like(self, out: torch.Tensor) -> torch.Tensor:
        """Zeros in place of the representative's output ``out``, of the shape of the sibling's
        input whose representative's counterpart has ``out``'s shape."""
        shape = str(tuple(out.shape))
        for mine, theirs in zip(self.tensors, self.rep_tensors):
            if str(tuple(theirs.shape)) == shape:
                return sibling_zeros([mine, *self.depends_on], list(mine.shape), out.dtype)
        raise ReuseFallback(f"an output of '{self.rep}' has no input's shape")
