"""Patterns specialised per candidate, for :func:`~nnbridge.surgery.replace_pattern` and
:func:`~nnbridge.surgery.match`.

Borrowed from inductor's ``register_replacement``: a pattern is traced once (to know what to look
for) and again for each match from the match's own values, and the match stands only if that
specialised pattern matches too. The first trace is torch.fx's: symbolic, or with
``example_inputs=`` by a :class:`ValueTracer` whose proxies carry fake values: reading
``x.dtype``, ``x.shape[-1]`` or ``x.size(-1)`` gives the value's own dtype or size (a literal in
the pattern, as Dynamo specialises static sizes), so ``if x.dtype == torch.bfloat16:`` takes the
example's branch. Module slots stay ``call_module`` nodes; a slot's call has the value the matched
call node has. The specialised pattern is extracted by nnbridge's exporter
(:mod:`.pattern_export`), in the ATen normal form of the graphs it is matched in.

A search (:meth:`Specialiser.search`) over one graph:

1. *Generic patterns*: the symbolic trace; or the pattern extracted from the example inputs (the
   torch.fx trace when it cannot be), and from them cast to each other floating dtype the graph's
   recorded values have (a bfloat16 extraction gets the pattern's bfloat16 branch). They find a
   candidate's nodes from an anchor op of the same name, with literals, argument counts and the
   names of the ops inside not compared (a size or dtype in them is the example's, and torch.fx
   names ops as torch does: ``float``, not ``to``).
2. *Specialisation*: the values of the matched tensor inputs and module calls, by fake propagation
   of the graph (:class:`~.fake_values.FakeValues`), give the specialised pattern (cached by the
   inputs' and calls' dtypes, sizes and devices and the slots' classes: one extraction serves every
   layer alike), matched from the same anchor with every op (overload included) and literal
   compared. It must bind the tensor inputs to the nodes whose values it was made from. A
   candidate with an input without a value (an extraction's own input: propagation does not
   reach it) is traced by torch.fx without one and compared by op names: fine, unless the pattern
   reads its metadata, which rejects the candidate, saying so.

Example::

    specialiser = Specialiser(pattern, constants={}, name="pattern", example=(torch.randn(2, 8),))
    generic = specialiser.generic()          # a PatternGraph traced from the example
    search = specialiser.search(graph_module, where="blocks_0", recorded={})
    attempt, reason = search.attempt(node)   # reason None: a match
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch.fx import GraphModule, Node, Proxy
from torch.fx.node import map_aggregate

from ..compat.torch.fake_values import fake_from, fake_mode
from ..compat.torch.pytree import pytree
from ..errors import PatternError
from .fake_values import UNKNOWN, FakeValues
from .pattern_export import export_pattern, exportable
from .pattern_graphs import METADATA_METHODS, LeafTracer, PatternGraph, tensor_arguments, trace_pattern
from .pattern_match import _Attempt, _Failed, candidates


class _NoValue:
    def __repr__(self) -> str:
        return "NO_VALUE"


#: a traced value with no known value (a slot's call in a generic trace)
NO_VALUE: Any = _NoValue()


def _holds_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))


def describe(value: Any) -> str:
    """``bfloat16[2, 8]`` for a tensor; ``unknown`` for no value."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}[{', '.join(str(s) for s in value.shape)}]"
    return "unknown" if value is NO_VALUE else type(value).__name__


class _ValueProxy(Proxy):
    """A proxy whose tensor metadata (``dtype``, ``shape``, ``device``, ``ndim``...) reads its
    value's: a plain Python value, not a node."""

    def __getattr__(self, attr: str) -> Any:
        value = cast(ValueTracer, self.tracer).values.get(self.node, NO_VALUE)
        if isinstance(value, torch.Tensor) and not attr.startswith("__"):
            read = getattr(value, attr, NO_VALUE)
            if read is not NO_VALUE and not callable(read) and not _holds_tensor(read):
                return read
        return super().__getattr__(attr)


class ValueTracer(LeafTracer):
    """torch.fx's tracer (module calls kept) computing each node's value on fake tensors as it
    traces; a result holding no tensor (a size, a dtype, a flag) is returned as a plain value, with
    no node.

    Args:
        inputs: ``{tensor argument: value}`` (fake tensors of ``mode``, or :data:`NO_VALUE`).
        calls: ``{module slot: the value its (one) call gives}``.
        mode: the fake-tensor mode the values belong to.
        strict: an op failing on its fake values, or a metadata read of a value that is unknown,
            raises :class:`PatternError`; otherwise the value is unknown (a data-dependent op, as
            ``nonzero``, has no fake value without a shape environment) and the trace goes on
            symbolically from there (a read of its metadata becomes a node).
    """

    def __init__(self, inputs: Mapping[str, Any], *, calls: Mapping[str, Any], mode: Any, strict: bool = True):
        super().__init__()
        self.inputs, self.calls, self.mode, self.strict = dict(inputs), dict(calls), mode, strict
        self.values: dict[Node, Any] = {}
        self._called: set[str] = set()

    def proxy(self, node: Node) -> Proxy:
        return _ValueProxy(node, self)

    def create_proxy(self, kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     name: str | None = None, type_expr: Any | None = None, proxy_factory_fn: Any = None) -> Any:
        if kind in ("placeholder", "output", "get_attr"):
            proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
            self.values[proxy.node] = self.inputs.get(str(target), NO_VALUE) if kind == "placeholder" else NO_VALUE
            return proxy
        value = self._value(kind, target, args, kwargs=kwargs)
        if value is not NO_VALUE and not _holds_tensor(value):
            return value
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        self.values[proxy.node] = value
        return proxy

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        """torch.fx's proxy for a module's parameter or buffer (``l0.weight`` in a replacement),
        carrying a fake copy of that tensor as its value."""
        proxy = super().getattr(attr, attr_val, parameter_proxy_cache)
        if isinstance(proxy, Proxy) and isinstance(attr_val, torch.Tensor) \
                and self.values.get(proxy.node, NO_VALUE) is NO_VALUE:
            self.values[proxy.node] = fake_from(self.mode, attr_val)
        return proxy

    def _value(self, kind: str, target: Any, args: tuple[Any, ...], *, kwargs: dict[str, Any]) -> Any:
        if kind == "call_module":
            slot = str(target)
            first = slot not in self._called
            self._called.add(slot)
            return self.calls.get(slot, NO_VALUE) if first else NO_VALUE  # a second call's value is not recorded
        unknown: list[Proxy] = []

        def value_of(item: Any) -> Any:
            if isinstance(item, Proxy):
                found = self.values.get(item.node, NO_VALUE)
                if found is NO_VALUE:
                    unknown.append(item)
                return found
            return item
        concrete = map_aggregate((args, kwargs), value_of)
        if unknown and not self.strict:
            return NO_VALUE  # traced on symbolically
        if unknown:
            read = (f".{args[1]}" if kind == "call_function" and target is getattr else
                    f".{target}()" if kind == "call_method" and target in METADATA_METHODS else None)
            if read is not None:
                raise PatternError(f"it reads {read} of {unknown[0].node.name}, whose value is unknown here (in the trace from"
                                   " example_inputs=, a module call's result; for a candidate, a graph input fake"
                                   " propagation does not reach, as an extraction's own input); read the metadata of"
                                   " tensor arguments only")
            return NO_VALUE
        call_args, call_kwargs = concrete
        function = getattr(call_args[0], target) if kind == "call_method" else target
        if kind == "call_method":
            call_args = call_args[1:]
        try:
            with self.mode:
                return function(*call_args, **call_kwargs)
        except Exception as error:
            if not self.strict:
                return NO_VALUE
            name = getattr(target, "__name__", str(target))
            raise PatternError(f"{name} fails on the values it is traced with ({type(error).__name__}:"
                               f" {(str(error).splitlines() or [''])[0][:200]})") from error


def _key(values: Mapping[str, Any]) -> tuple[Any, ...]:
    def of(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (value.dtype, tuple(int(s) for s in value.shape), str(value.device))
        return "unknown" if value is NO_VALUE else type(value).__name__
    return tuple(sorted((name, of(value)) for name, value in values.items()))


class Specialiser:
    """Traces one pattern: :meth:`generic` (symbolically, or from the example inputs),
    :meth:`specialised` from a candidate's values (see the module docstring).

    Args:
        pattern: the pattern function or module.
        constants: the bound constants.
        name: the pattern's name, for messages.
        example: ``example_inputs=``: a tensor per tensor argument, a tuple in argument order or a
            dict by name; None: the generic pattern is the symbolic trace.

    Raises:
        PatternError: ``example`` does not give one real tensor per tensor argument.
    """

    def __init__(self, pattern: Any, *, constants: Mapping[str, Any], name: str, example: Any = None):
        self.pattern, self.constants, self.name = pattern, dict(constants), name
        self.example = self._example(example) if example is not None else None
        self._mode = fake_mode()
        self._generic: dict[Any, PatternGraph] = {}
        self._specialised: dict[tuple[Any, ...], PatternGraph] = {}

    def _example(self, example: Any) -> dict[str, torch.Tensor]:
        names = tensor_arguments(self.pattern, constants=self.constants, name=self.name)
        rule = (f"example_inputs= gives the pattern {self.name} a tensor per tensor argument {names} (a tuple in that"
                " order, or a dict by name; module and constant arguments take none)")
        if isinstance(example, Mapping):
            given = dict(example)
            if set(given) != set(names):
                raise PatternError(f"{rule}; got the names {sorted(given)}. Give exactly {names}.")
        elif isinstance(example, Sequence) and not isinstance(example, (str, bytes)):
            if len(example) != len(names):
                raise PatternError(f"{rule}; got {len(example)} value(s). Give {len(names)}.")
            given = dict(zip(names, example))
        else:
            raise PatternError(f"{rule}; got a {type(example).__name__}. Pass (x,) or {{'x': x}}.")
        odd = [f"{n}: {type(v).__name__}" for n, v in given.items() if not isinstance(v, torch.Tensor)]
        if odd:
            raise PatternError(f"{rule}; got {odd}. Give a real tensor for each.")
        return given

    def trace(self, inputs: Mapping[str, Any], *, calls: Mapping[str, Any], mode: Any) -> PatternGraph:
        """The pattern traced with ``inputs`` and ``calls`` (see :class:`ValueTracer`).

        Raises:
            PatternError: the pattern cannot be traced with these values.
        """
        tracer = ValueTracer(inputs, calls=calls, mode=mode)
        try:
            traced = trace_pattern(self.pattern, constants=self.constants, name=self.name, tracer=tracer)
        except PatternError as error:
            if str(error).startswith("the pattern"):
                raise
            raise PatternError(f"the pattern {self.name} cannot be traced with the values"
                               f" {{{', '.join(f'{n}: {describe(v)}' for n, v in inputs.items())}}}: {error}.") from error
        traced.specialiser = self
        return traced

    def generic(self, dtype: torch.dtype | None = None) -> PatternGraph:
        """The pattern extracted from the example inputs (their floating ones cast to ``dtype``),
        or traced by torch.fx from them when it cannot be; module calls have no value (see
        :data:`~.pattern_export.LIKE_INPUT`). Without example inputs, the symbolic trace.

        Raises:
            PatternError: the pattern cannot be traced (the message says the rule and the fix).
        """
        if dtype in self._generic:
            return self._generic[dtype]
        if self.example is None:
            traced = trace_pattern(self.pattern, constants=self.constants, name=self.name)
            traced.specialiser = self
            self._generic[dtype] = traced
            return traced
        values = {name: value.to(dtype) if dtype is not None and value.is_floating_point() else value
                  for name, value in self.example.items()}
        try:  # torch.fx's trace first: it refuses what no candidate could specialise (see ValueTracer)
            traced = self.trace({n: fake_from(self._mode, v) for n, v in values.items()}, calls={}, mode=self._mode)
        except PatternError as error:
            raise PatternError(f"{error} example_inputs= are the values the pattern is first traced with (to know"
                               " its ops); give tensors it runs on, of the dtypes and sizes it expects.") from error
        try:  # the ATen form, in which a candidate's ops are found by their names
            exported = export_pattern(self.pattern, constants=self.constants, name=self.name, inputs=values, calls={})
        except PatternError:  # (a module call's guessed value does not fit the code after it): the fx trace
            exported = None
        if exported is not None:
            exported.specialiser, exported.dropped = self, traced.dropped
            traced = exported
        self._generic[dtype] = traced
        return traced

    def cast(self, dtype: torch.dtype) -> list[PatternGraph]:
        """``[the pattern traced with the example inputs cast to dtype]``; ``[]`` when it cannot be
        (such a graph's candidates are walked with the example's own trace only)."""
        try:
            return [self.generic(dtype)]
        except PatternError:
            return []

    @property
    def specialisations(self) -> int:
        """How many specialised traces are cached (one per distinct key)."""
        return len(self._specialised)

    def specialised(self, inputs: Mapping[str, Any], *, calls: Mapping[str, Any], slots: Mapping[str, type],
                    mode: Any) -> PatternGraph:
        """The pattern for one candidate, cached by its values' dtypes, sizes and devices and the
        slots' classes: extracted (:mod:`.pattern_export`) when every value is known, else traced
        by torch.fx.

        Raises:
            PatternError: the pattern cannot be traced with these values.
        """
        key = (_key(inputs), _key(calls), tuple(sorted((s, c.__qualname__) for s, c in slots.items())))
        if key not in self._specialised:
            special: PatternGraph | None = None
            if exportable(inputs, calls):
                try:
                    special = export_pattern(self.pattern, constants=self.constants, name=self.name, inputs=inputs,
                                             calls=calls)
                    special.specialiser = self
                except PatternError:
                    names = tensor_arguments(self.pattern, constants=self.constants, name=self.name)
                    if all(n in inputs for n in names):
                        raise
                    # an argument the walk did not bind (a later output's input) is used: torch.fx's trace
            self._specialised[key] = special if special is not None else self.trace(inputs, calls=calls, mode=mode)
        return self._specialised[key]

    def search(self, module: GraphModule, *, where: str, recorded: Mapping[str, Any] | None) -> Search:
        """A search of ``module``'s graph (at NodePath ``where``; ``recorded``: its inputs' recorded
        values, :func:`~.pass_inputs.recorded_inputs`)."""
        return Search(self, module, where=where, recorded=dict(recorded or {}))


class Search:
    """The two-phase search of one graph (see the module docstring)."""

    def __init__(self, specialiser: Specialiser, module: GraphModule, *, where: str, recorded: dict[str, Any]):
        self.specialiser, self.module, self.where, self.recorded = specialiser, module, where, recorded
        dtypes = sorted({n.meta["val"].dtype for n in module.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
                         and n.meta["val"].is_floating_point()}, key=str)
        example = specialiser.example
        own = {v.dtype for v in example.values() if v.is_floating_point()} if example is not None else set()
        casts = [g for d in dtypes if own != {d} for g in specialiser.cast(d)] if example is not None else []
        self.generic = [specialiser.generic()] + casts
        self._propagated: tuple[dict[Node, Any], Any] | None = None

    def candidates(self) -> list[Node]:
        """Every generic pattern's candidate anchors, in graph order."""
        found = {n for pattern in self.generic for n in candidates(pattern, self.module)}
        return [n for n in self.module.graph.nodes if n in found]

    def values(self) -> tuple[dict[Node, Any], Any]:
        """``({graph node: fake value}, the fake mode)`` by fake propagation of the graph (once)."""
        if self._propagated is None:
            self._propagated = graph_values(self.module, recorded=self.recorded, where=self.where)
        return self._propagated

    def attempt(self, node: Node) -> tuple[_Attempt, str | None]:
        """The walk from anchor ``node`` and why it failed (None: a match)."""
        best: tuple[_Attempt, str] | None = None
        for generic in self.generic:
            first = _Attempt(generic, self.module, self.where, lenient=True)
            try:
                first.node(generic.output, node)
            except _Failed as failed:
                if best is None or len(first.found.nodes) > len(best[0].found.nodes):
                    best = (first, failed.reason)
                continue
            return self._specialise(first, node)
        assert best is not None, "a candidate of no generic pattern"
        return best

    def _specialise(self, first: _Attempt, node: Node) -> tuple[_Attempt, str | None]:
        values, mode = self.values()
        inputs = {name: values.get(t, NO_VALUE) for name, t in first.found.tensors.items()}
        calls = {str(p.target): values.get(t, NO_VALUE) for p, t in first.found.nodes.items() if p.op == "call_module"}
        slots = {slot: first.module_class(t) or object for p, t in first.found.nodes.items() if p.op == "call_module"
                 for slot in [str(p.target)]}
        shown = ", ".join(f"{n}: {describe(v)}" for n, v in inputs.items())  # an unknown one is fine unless read
        try:
            special = self.specialiser.specialised(inputs, calls=calls, slots=slots, mode=mode)
        except PatternError as error:
            return first, f"cannot be specialised for this candidate ({shown}): {error}"
        second = _Attempt(special, self.module, self.where)
        try:
            second.node(special.output, node)
        except _Failed as failed:
            return second, f"specialised for {shown}: {failed.reason}"
        moved = [name for name, t in second.found.tensors.items() if first.found.tensors.get(name) is not t]
        if moved:
            return second, (f"the pattern specialised for {shown} binds {moved} to other nodes than those it was"
                            " specialised for")
        second.found.values, second.found.mode = values, mode
        return second, None


def graph_values(module: GraphModule, *, recorded: Mapping[str, Any] | None, where: str) -> tuple[dict[Node, Any], Any]:
    """``({graph node: fake value, or NO_VALUE where propagation does not reach}, the fake mode)``
    for ``module``'s graph at NodePath ``where`` (``recorded``: its inputs' recorded values,
    :func:`~.pass_inputs.recorded_inputs`)."""
    mode = fake_mode()
    propagation = FakeValues(module, mode, recorded=dict(recorded or {}), where=where)
    propagation.propagate()
    return {n: NO_VALUE if v is UNKNOWN else v for n, v in propagation.env.items()}, mode

