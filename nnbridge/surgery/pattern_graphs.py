"""Patterns and replacements as torch.fx graphs, for :func:`~nnbridge.surgery.replace_pattern`.

A pattern is a plain function (or an ``nn.Module``'s bound ``forward``). It is traced by torch.fx's
tracer: each argument annotated with an ``nn.Module`` subclass (``l0: CustomLinear``) is
a *module slot*, whose calls become ``call_module`` nodes (target: the argument's name), the form
nnbridge's per-module graphs give a child's call; each other argument is a tensor wildcard (a
placeholder); ``constants`` are bound before tracing (Python control flow on them is resolved,
as with fx's ``concrete_args``). An input no node uses after that is dropped, and said so. Traced
from values instead (``example_inputs=``, :mod:`.pattern_spec`), reads of tensor metadata give the
values' dtypes and sizes; traced symbolically, a pattern reading them is refused.

A replacement is traced the same way once per match, with the matched module objects in place of
the slots, so reading ``l0.weight`` gives a ``get_attr`` of the matched module's own parameter
(target relative to the graph's module: ``l0.weight``) and calling ``l0(x)`` a ``call_module``
of it (target ``l0``). Example::

    pattern = trace_pattern(lambda x, l0: l0(x), constants={}, name="p")   # annotations required
    pattern.slots        # {'l0': CustomLinear}
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, Node, Tracer

from ..errors import PatternError


@dataclass
class PatternGraph:
    """A traced pattern.

    Attributes:
        name: the pattern's name (for messages).
        graph: the fx graph: placeholders (tensor wildcards and slots), ops, and the output: one
            value or a tuple of distinct values.
        slots: ``{argument: nn.Module subclass}`` of the module slots still used.
        tensors: the names of the tensor wildcards still used, in order.
        dropped: the inputs no node uses after binding ``constants`` (dropped).
        specialiser: the :class:`~.pattern_spec.Specialiser` that made it and specialises it per
            candidate (None only while :func:`trace_pattern` makes it).
        exported: the graph module of an extracted pattern (:mod:`.pattern_export`), whose graph
            this is; None for a torch.fx trace.
    """

    name: str
    graph: Graph
    slots: dict[str, type[torch.nn.Module]]
    tensors: list[str]
    dropped: list[str] = field(default_factory=list)
    specialiser: Any = None
    exported: Any = None

    @property
    def outputs(self) -> list[Node]:
        """The nodes whose values the pattern returns, in order (one, or the items of a returned
        tuple)."""
        out = next(n for n in self.graph.nodes if n.op == "output")
        value = out.args[0]
        return list(value) if isinstance(value, (tuple, list)) else [value]  # Nodes: checked by trace_pattern

    @property
    def output(self) -> Node:
        """The node of the pattern's (first) output value: the anchor of every match."""
        return self.outputs[0]

    @property
    def returns_tuple(self) -> bool:
        """Whether the pattern returns a tuple of values (its replacement must too)."""
        out = next(n for n in self.graph.nodes if n.op == "output")
        return isinstance(out.args[0], (tuple, list))


class _Slot(torch.nn.Module):
    """Stands for a module argument while a pattern is traced (its calls stay ``call_module``)."""

    def __init__(self, name: str):
        super().__init__()
        self.slot = name


class LeafTracer(Tracer):
    """torch.fx's tracer keeping every module call a ``call_module`` node."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return True


def function_of(pattern: Any, what: str) -> Callable[..., Any]:
    if isinstance(pattern, torch.nn.Module):
        return pattern.forward
    if not callable(pattern):
        raise PatternError(f"{what} must be a function or an nn.Module (its forward is traced); got"
                           f" {type(pattern).__name__}. Write it as def {what}(x, l0: MyLinear): return l0(x).")
    return pattern


def name_of(pattern: Any) -> str:
    """A pattern's or replacement's name for messages."""
    if isinstance(pattern, torch.nn.Module):
        return f"{type(pattern).__name__}.forward"
    return getattr(pattern, "__name__", None) or type(pattern).__name__


def parameters_of(function: Callable[..., Any], name: str) -> list[inspect.Parameter]:
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError) as error:
        raise PatternError(f"the pattern {name} has no inspectable signature ({error}); write it as a Python"
                           " function with named arguments.") from error
    odd = [p.name for p in parameters if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if odd:
        raise PatternError(f"the pattern {name} takes *args/**kwargs or keyword-only arguments {odd}; each input must"
                           " be a named positional argument (a tensor, or a module annotated with its class).")
    return parameters


def annotations_of(function: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(function)
    except Exception:  # noqa: BLE001 - unresolvable string annotations: read them raw
        return dict(getattr(function, "__annotations__", {}))


def is_module_class(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, torch.nn.Module)


def tensor_arguments(pattern: Any, *, constants: Mapping[str, Any], name: str) -> list[str]:
    """The names of ``pattern``'s tensor arguments (neither bound by ``constants`` nor annotated
    with a module class), in order.

    Raises:
        PatternError: as :func:`trace_pattern` for a pattern that is no function or takes
            ``*args``/``**kwargs``.
    """
    function = function_of(pattern, "pattern")
    hints = annotations_of(function)
    return [p.name for p in parameters_of(function, name) if p.name not in constants
            and not is_module_class(hints.get(p.name))]


def trace_pattern(pattern: Any, *, constants: Mapping[str, Any], name: str, tracer: Tracer | None = None
                  ) -> PatternGraph:
    """Trace ``pattern`` (see the module docstring); ``tracer``: the fx tracer to trace with (it must
    keep module calls as ``call_module`` nodes, as :class:`~.pattern_spec.ValueTracer` does), else
    torch.fx's symbolic tracer.

    Raises:
        PatternError: not a function, ``constants`` naming no argument, a called argument without a
            module annotation, tracing failed, the pattern returns no computed value (nor a tuple of
            distinct ones), or a symbolically traced pattern reads tensor metadata (``x.dtype``,
            ``x.shape``).
    """
    function = function_of(pattern, "pattern")
    parameters = parameters_of(function, name)
    names = [p.name for p in parameters]
    unknown = sorted(set(constants) - set(names))
    if unknown:
        raise PatternError(f"constants= names {unknown}, which the pattern {name} does not take (its arguments:"
                           f" {names}); bind only its own arguments.")
    hints = annotations_of(function)
    slots = {n: hints[n] for n in names if n not in constants and is_module_class(hints.get(n))}
    holder = torch.nn.Module()
    for slot in slots:
        holder.add_module(slot, _Slot(slot))
    free = [n for n in names if n not in constants and n not in slots]

    def bound(*tensors: Any) -> Any:
        values = dict(zip(free, tensors))
        values.update(constants)
        values.update((slot, getattr(holder, slot)) for slot in slots)
        return function(*(values[n] for n in names))

    try:
        graph = (tracer or LeafTracer()).trace(rooted(holder, bound, free))
    except PatternError:
        raise
    except Exception as error:
        hint = (" Check that the pattern runs on example_inputs=." if tracer is not None else
                " Bind arguments that steer Python control flow with constants={...}, or give example_inputs= so that"
                " tensor metadata (x.dtype, x.shape) is read from values, per candidate; write tensor code only.")
        raise PatternError(f"the pattern {name} cannot be traced by torch.fx: {type(error).__name__}: {error}."
                           f"{hint}") from error
    if tracer is None:
        _refuse_metadata_reads(graph, name)
    called = [n for n in graph.nodes if n.op == "call_method" and n.target == "__call__"]
    if called:
        argument = called[0].args[0]
        raise PatternError(f"the pattern {name} calls its argument {str(argument)!r} like a module, but it has no"
                           " nn.Module annotation; annotate it with the module class to match (def pattern(x,"
                           f" {argument}: torch.nn.LayerNorm): ...), or bind it with constants=.")
    output = next(n for n in graph.nodes if n.op == "output")
    value = output.args[0]
    values = list(value) if isinstance(value, (tuple, list)) else [value]
    if not values or any(not isinstance(v, Node) or v.op == "placeholder" for v in values) or len(
            set(values)) != len(values):
        raise PatternError(f"the pattern {name} must return one computed value (an op's or a module call's result)"
                           f" or a tuple of distinct ones; it returns {value!r}. Return tensors made inside the"
                           " pattern (return a, b), each once.")
    dropped = []
    for node in list(graph.nodes):
        if node.op == "placeholder" and not node.users:
            dropped.append(str(node.target))
            graph.erase_node(node)
    called_slots = {str(n.target) for n in graph.nodes if n.op == "call_module"}
    used = {str(n.target) for n in graph.nodes if n.op == "placeholder"}
    return PatternGraph(name, graph, {s: c for s, c in slots.items() if s in called_slots},
                        [n for n in free if n in used], dropped + [s for s in slots if s not in called_slots])


#: tensor methods giving metadata, not a tensor
METADATA_METHODS = frozenset({"size", "dim", "stride", "numel", "element_size", "is_floating_point",
                               "is_complex", "is_contiguous", "get_device"})


def _refuse_metadata_reads(graph: Graph, name: str) -> None:
    """A symbolically traced pattern reading tensor metadata has ``getattr``/``size`` nodes no
    extracted graph has (its sizes and dtypes are literals there): such a pattern could never match."""
    for node in graph.nodes:
        read = (node.op == "call_function" and node.target is getattr) or (
            node.op == "call_method" and node.target in METADATA_METHODS)
        if read:
            what = f".{node.args[1]}" if node.op == "call_function" else f".{node.target}()"
            raise PatternError(f"the pattern {name} reads {node.args[0]}{what}, which a symbolic trace leaves as a node"
                               " no extracted graph has (sizes and dtypes are literals there); give example_inputs=(...)"
                               " (a tensor per tensor argument) so that the pattern is traced with values and"
                               " specialised per candidate.")


def rooted(holder: torch.nn.Module, function: Callable[..., Any], arguments: list[str]) -> torch.nn.Module:
    """A module with ``holder``'s children whose forward takes ``arguments`` and calls ``function``
    (fx's tracer reads the argument names off the forward's code object)."""
    for argument in arguments:
        if not argument.isidentifier():
            raise PatternError(f"argument name {argument!r} is no identifier")
    source = f"def forward(self, {', '.join(arguments)}):\n    return _function({', '.join(arguments)})\n"
    scope: dict[str, Any] = {"_function": function}
    exec(compile(source, "<nnbridge pattern>", "exec"), scope)  # noqa: S102 - names checked above
    # a class made here, of no module with a source file: no extraction cache keys a program by it
    # (its code is the pattern's, which the source of this module does not show)
    root = type("PatternRoot", (torch.nn.Module,), {"forward": scope["forward"], "__module__": "<nnbridge pattern>"})()
    for child_name, child in holder.named_children():
        root.add_module(child_name, child)
    return root


def trace_replacement(replacement: Any, *, values: Mapping[str, Any], owner: torch.nn.Module, name: str,
                      tracer: Tracer | None = None) -> Graph:
    """Trace ``replacement`` for one match.

    Args:
        values: ``{argument: value}``: :data:`TENSOR` for a tensor input (traced as a placeholder);
            constants and the matched modules (objects of ``owner``'s tree) are passed as is.
        owner: the module whose graph holds the match.
        tracer: the tracer (default :class:`LeafTracer`, symbolic); a ``ValueTracer`` of
            :mod:`.pattern_spec` traces it from the match's values, so that reading ``x.dtype`` or
            ``x.shape[-1]`` gives the match's own (module call targets are ``owner.<path>``).

    Returns:
        A graph whose placeholders are the replacement's tensor arguments (by name), whose
        ``get_attr``/``call_module`` targets are paths relative to ``owner``, except a ``get_attr``
        of a tensor the replacement made (its value in ``node.meta[CONSTANT_KEY]``).

    Raises:
        PatternError: the replacement takes an argument the pattern does not bind, or cannot be traced.
    """
    function = function_of(replacement, "replacement")
    parameters = parameters_of(function, name)
    missing = [p.name for p in parameters if p.name not in values and p.default is inspect.Parameter.empty]
    if missing:
        raise PatternError(f"the replacement {name} takes {missing}, which the pattern does not bind (the pattern's"
                           f" inputs and constants: {sorted(values)}); give it the pattern's argument names.")
    tensors = [p.name for p in parameters if p.name in values and values[p.name] is TENSOR]

    def bound(*proxies: Any) -> Any:
        given = dict(zip(tensors, proxies))
        return function(*(given.get(p.name, values.get(p.name, p.default)) for p in parameters))

    holder = torch.nn.Module()
    holder.add_module("owner", owner)
    root = rooted(holder, bound, tensors)
    try:
        graph = (tracer or LeafTracer()).trace(root)
    except PatternError as error:
        raise PatternError(f"the replacement {name} cannot be traced with this match's values: {error}.") from error
    except Exception as error:
        raise PatternError(f"the replacement {name} cannot be traced by torch.fx: {type(error).__name__}: {error}."
                           " Write tensor code over its tensor arguments and the matched modules.") from error
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            target = str(node.target)
            constant = getattr(root, target, None) if node.op == "get_attr" and "." not in target else None
            if isinstance(constant, torch.Tensor):  # a tensor the replacement made (torch.ones(x.shape[-1]))
                node.meta[CONSTANT_KEY] = constant
                continue
            if not target.startswith("owner."):
                raise PatternError(f"the replacement {name} uses {target!r}, which is no part of the matched module's"
                                   " tree; use the matched modules' parameters and calls, or plain tensor code.")
            node.target = target[len("owner."):]
    return graph


#: ``node.meta`` key of a ``get_attr`` node of :func:`trace_replacement`'s graph reading a tensor the
#: replacement made while it was traced (torch.fx keeps such a tensor as a constant); its value
CONSTANT_KEY = "nnbridge_replacement_constant"

#: marks a tensor argument in :func:`trace_replacement`'s ``values``
TENSOR: Any = object()
