"""Call structures: which extraction serves which call (like Dynamo's guards).

A graph is specialised to the structure of the call it was exported from: which positional and
keyword arguments were passed, their non-tensor values, tensor dtypes, devices, ranks,
``requires_grad`` and memory layouts (contiguous or not: :func:`memory_layout`), the train/eval
flags, grad mode, autocast state, the default dtype, inference mode and deterministic algorithms
(as Dynamo's global-state guard: code may branch on ``torch.get_default_dtype()`` or create
tensors in it, and a graph keeps what it saw).
:func:`structure_key` captures that as a hashable key; :class:`ShapeGuard` records which tensor
dimensions export kept dynamic (``Dim.AUTO``), their allowed ranges, and the shape guards export
recorded (``x.size()[1] % 2 == 0``). The module state a graph bakes in (attribute values,
children, parameter dtypes) is guarded by :class:`~nnbridge.guards.module_state.StateGuard`.

*State* here means torch's global state (grad mode, autocast state, the default dtype, inference
mode, deterministic algorithms): process-wide flags read with each call, part of its structure.
Module state and the module globals a model's code reads are guarded elsewhere
(:mod:`.module_state`, :mod:`.global_state`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import torch
from ..compat.torch.pytree import pytree
from ..compat.torch.symbolic import symbolic_expr, symbolic_hint

from ..compat.torch.export import compile_guards, export_guards, guard_view

#: One dimension's rule in a :class:`ShapeGuard`: a static size, ``(symbol, low, high)``, or
#: ``(symbol, low, high, coefficient, offset)`` (a size derived from a symbol).
DimRule = int | tuple[str, int, int | None] | tuple[str, int, int | None, int, int]

#: Device types whose autocast state is part of a call's structure.
_AUTOCAST_DEVICES = ("cpu", "cuda")


def memory_layout(tensor: torch.Tensor) -> Hashable:
    """What code can branch on in a tensor's strides, independent of its sizes: True when it is
    contiguous; else the order of its dimensions by decreasing stride and which dimensions have
    stride 0 (an ``expand``), size-1 dimensions left out (their strides are arbitrary); a
    non-strided tensor's layout (sparse). As Dynamo's tensor guards check strides: export traces
    with the example's strides, so ``if x.is_contiguous():`` or ``x.stride(0)`` is baked in (else
    a transposed input would run the contiguous branch's graph, without an error)."""
    if tensor.layout is not torch.strided:
        return tensor.layout
    if tensor.is_contiguous():
        return True
    shape, strides = tensor.shape, tensor.stride()
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    return (tuple(sorted(dims, key=lambda d: (-strides[d], d))), tuple(d for d in dims if strides[d] == 0))


def _leaf_key(leaf: object) -> Hashable:
    if isinstance(leaf, torch.Tensor):
        # requires_grad: export traces with it, so a branch on an input's requires_grad is baked in
        return ("tensor", leaf.dtype, leaf.device, leaf.dim(), leaf.requires_grad, memory_layout(leaf))
    try:
        hash(leaf)
    except TypeError:
        return (type(leaf), id(leaf))
    return (type(leaf), leaf)


def alias_pattern(tensors: list[torch.Tensor]) -> tuple[Hashable, ...]:
    """Which of a call's tensors alias an earlier one, as Dynamo's duplicate-input guard: per tensor,
    None when it shares nothing with the tensors before it, else ``(i, same)`` where ``i`` is the
    position of the first earlier tensor on the same storage and ``same`` tells whether it is that
    very tensor object. Export traces one placeholder for a tensor passed twice, so a graph exported
    from ``block(a, a)`` computes ``block(h, a)`` wrongly: the pattern is part of a call's structure.

    Tensors without a storage of their own to compare (fake, meta, functorch-wrapped, size 0, and
    all of them while Dynamo traces) count by identity only."""
    pattern: list[Hashable] = []
    objects: dict[int, int] = {}
    storages: dict[int, int] = {}
    compiling = torch.compiler.is_dynamo_compiling()
    for i, tensor in enumerate(tensors):
        first = objects.setdefault(id(tensor), i)
        if first != i:
            pattern.append((first, True))
            continue
        pointer = 0 if compiling else _storage_pointer(tensor)
        if pointer:
            first = storages.setdefault(pointer, i)
            if first != i:
                pattern.append((first, False))
                continue
        pattern.append(None)
    return tuple(pattern)


def _storage_pointer(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage, or 0 when it has none to compare (see :func:`alias_pattern`)."""
    if tensor.layout is not torch.strided or tensor.device.type == "meta":
        return 0
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


def structure_key(modules: list[torch.nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any],
                  *, flat: tuple[list[Any], Any] | None = None) -> Hashable:
    """Hashable description of a call's structure (everything except tensor values and sizes).

    Args:
        modules: the module and its submodules, whose train/eval flags are part of the structure.
        flat: ``pytree.tree_flatten((args, kwargs))`` when the caller has it (a cache argument's
            flatten walks every layer).
    """
    leaves, spec = pytree.tree_flatten((args, kwargs)) if flat is None else flat
    return (str(spec), tuple(_leaf_key(leaf) for leaf in leaves), tuple(m.training for m in modules),
            torch.is_grad_enabled(), autocast_state(), torch.get_default_dtype(), global_flags(),
            alias_pattern([leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]))


def with_flags_of(key: Hashable, modules: list[torch.nn.Module]) -> Hashable:
    """``key`` (a :func:`structure_key`) with the train/eval flags of ``modules`` in place of the
    ones it was made with: the key a call with the same structure gets once the module tree is
    ``modules`` (an extraction that added children, as graph surgery's edits do)."""
    parts: tuple[Any, ...] = tuple(key)  # type: ignore[arg-type]
    return (*parts[:2], tuple(m.training for m in modules), *parts[3:])


def with_grad_mode(key: Hashable, enabled: bool) -> Hashable:
    """``key`` (a :func:`structure_key`) with grad mode ``enabled``: the key of the same call made
    under the other grad mode."""
    parts: tuple[Any, ...] = tuple(key)  # type: ignore[arg-type]
    return (*parts[:3], enabled, *parts[4:])


def global_flags() -> tuple[bool, bool, bool]:
    """Inference mode and deterministic algorithms (``torch.use_deterministic_algorithms``, with
    its ``warn_only``): code may branch on them, and a graph keeps the branch it was exported with."""
    if torch.compiler.is_dynamo_compiling():  # Dynamo cannot trace these queries (it guards global state itself)
        return (False, False, False)
    return (torch.is_inference_mode_enabled(), torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled())


def autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    """``(device type, enabled, dtype)`` of autocast for each device type: graphs bake in the casts
    autocast inserted while exporting."""
    return tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                 for device in _AUTOCAST_DEVICES)


def _layout_text(layout: Hashable) -> str:
    if layout is True:
        return "contiguous"
    if isinstance(layout, tuple):
        order, zero = layout
        return f"strided, dimensions by stride {list(order)}" + (f", stride 0 in {list(zero)}" if zero else "")
    return str(layout)


def describe_key_change(old: Hashable, new: Hashable) -> str:
    """Which part of a call's structure differs between two :func:`structure_key` values."""
    names = ("argument structure", "non-tensor values, tensor dtypes/devices/ranks/requires_grad/memory layouts",
             "train/eval flags", "grad mode", "autocast state", "default dtype",
             "inference mode or deterministic algorithms", "aliasing between tensor arguments")
    for name, a, b in zip(names, old, new):  # type: ignore[call-overload]
        if a != b:
            if name == "grad mode":
                return f"grad mode changed ({'enabled' if a else 'disabled'} -> {'enabled' if b else 'disabled'})"
            if name == "default dtype":
                return f"default dtype changed ({a} -> {b})"
            if name == "train/eval flags":
                if len(a) != len(b):  # one flag per module: the tree itself changed (an insertion)
                    return f"modules were added or removed ({len(a)} -> {len(b)} modules)"
                return "train/eval mode of a module changed"
            if name.startswith("non-tensor") and len(a) == len(b):
                layouts = [i for i, (x, y) in enumerate(zip(a, b)) if x != y and x[:5] == y[:5] and x[0] == "tensor"]
                if layouts and len(layouts) == sum(x != y for x, y in zip(a, b)):
                    i = layouts[0]
                    return (f"memory layout of tensor argument {i} changed ({_layout_text(a[i][5])} ->"
                            f" {_layout_text(b[i][5])})")
            return f"{name} changed"
    return "call structure changed"


class CallDifference(NamedTuple):
    """How a call (or a value) differs from another beyond tensor values (see :func:`call_difference`).

    Attributes:
        sized: True when sizes, dtypes, devices, the tree structure or a plain value differ (what a
            caller's graph may have specialised on); False when only tensor classes,
            ``requires_grad``, memory layouts or aliasing do (what the callee's own code may branch on).
        text: the first difference, as text for an error message.
    """

    sized: bool
    text: str


def call_difference(before: Any, after: Any) -> CallDifference | None:
    """The first way the value ``after`` (a call's ``(args, kwargs)``, or its output) differs from
    ``before`` other than in tensor values; None when it does not: the same tree structure, equal
    non-tensor leaves (the same object, when unhashable), and tensors of the same class, sizes,
    dtypes, devices, ``requires_grad`` and memory layouts, aliasing one another alike
    (:func:`alias_pattern`). A graph a caller's extraction chose for ``before`` (a child's call in
    its trace) then computes eager's result for ``after`` too, as a forward pre-hook or a
    front-end's input edit replaced them; a difference that is not
    :attr:`~CallDifference.sized` needs the callee's own extraction; a sized one, a graph of the
    caller extracted for ``after`` (its trace continued from the value)."""
    if before is after:
        return None
    (old, old_spec), (new, new_spec) = pytree.tree_flatten(before), pytree.tree_flatten(after)
    if old_spec != new_spec:
        return CallDifference(True, f"a {_shape_text(new_spec)} where it was {_shape_text(old_spec)}")
    unsized: str | None = None
    for i, (a, b) in enumerate(zip(old, new)):
        if a is b:
            continue
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device):
                return CallDifference(True, f"leaf {i}: a {tuple(b.shape)} {b.dtype} tensor on {b.device} where"
                                            f" it was {tuple(a.shape)} {a.dtype} on {a.device}")
            if unsized is None and (type(a) is not type(b) or _leaf_key(a) != _leaf_key(b)):
                unsized = (f"leaf {i}: a {type(b).__name__} (requires_grad={b.requires_grad},"
                           f" {_layout_text(memory_layout(b))}) where it was a {type(a).__name__}"
                           f" (requires_grad={a.requires_grad}, {_layout_text(memory_layout(a))})")
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or _leaf_key(a) != _leaf_key(b):
            return CallDifference(True, f"leaf {i}: {_leaf_text(b)} where it was {_leaf_text(a)}")
    if unsized is None and alias_pattern([t for t in old if isinstance(t, torch.Tensor)]) != alias_pattern(
            [t for t in new if isinstance(t, torch.Tensor)]):
        unsized = "the tensors alias one another otherwise"
    return None if unsized is None else CallDifference(False, unsized)


def _shape_text(spec: Any) -> str:
    text = str(spec).replace("\n", " ")
    return text if len(text) <= 120 else text[:117] + "..."


def _leaf_text(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"a {tuple(leaf.shape)} {leaf.dtype} tensor"
    text = repr(leaf)
    return f"{type(leaf).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def tensor_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors of a call, in pytree order (the order torch.export numbers its user inputs)."""
    return [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]


class ShapeGuard:
    """Tensor sizes an extraction is valid for.

    Args:
        dims: per tensor input (pytree order), per dimension an ``int`` (static size),
            ``(symbol, low, high)`` (dynamic size; ``high`` may be ``None`` for unbounded), or
            ``(symbol, low, high, coefficient, offset)``: a size export derived from a symbol, which
            must be ``coefficient * symbol + offset`` (a decoder layer's attention mask over the
            cache and the new tokens: ``past + 1`` during decoding). ``low``/``high`` bound the
            symbol. Dimensions sharing a symbol must be equal at call time.
    """

    def __init__(self, dims: list[list[DimRule]], code: list[str] | None = None):
        self.dims = dims
        self.code = list(code or [])
        self._check = compile_guards(self.code) if self.code else None

    @classmethod
    def static(cls, tensors: list[torch.Tensor]) -> ShapeGuard:
        """A guard accepting exactly the sizes of ``tensors``."""
        return cls([list(t.shape) for t in tensors])

    @classmethod
    def any_size(cls, tensors: list[torch.Tensor]) -> ShapeGuard:
        """A guard accepting any sizes of tensors of the ranks of ``tensors`` (each dimension a
        symbol of its own): for an opaque module, whose own code runs and whose children's
        dispatchers guard their graphs' sizes themselves."""
        return cls([[(f"_any_{i}_{d}", 0, None) for d in range(t.dim())] for i, t in enumerate(tensors)])

    @classmethod
    def from_export(cls, exported: torch.export.ExportedProgram) -> ShapeGuard:
        """Read the dynamic dimensions and their ranges off an exported program's user inputs."""
        user_inputs = set(exported.graph_signature.user_inputs)
        dims: list[list[DimRule]] = []
        for node in exported.graph.nodes:
            if node.op != "placeholder" or node.name not in user_inputs:
                continue
            value = node.meta.get("val")
            if not isinstance(value, torch.Tensor):
                continue
            tensor_dims: list[DimRule] = []
            for size in value.shape:
                if isinstance(size, int):
                    tensor_dims.append(size)
                    continue
                expr = symbolic_expr(size)
                affine = _affine(expr)
                bounds = exported.range_constraints.get(affine[0]) if affine is not None else None
                if bounds is None:  # another expression of symbols: the example's size only
                    tensor_dims.append(symbolic_hint(size))
                    continue
                try:
                    high: int | None = int(bounds.upper)
                except (TypeError, ValueError, AttributeError, OverflowError):
                    high = None  # unbounded (torch's int_oo)
                symbol, coefficient, offset = affine
                if (coefficient, offset) == (1, 0):
                    tensor_dims.append((str(symbol), int(bounds.lower), high))
                else:
                    tensor_dims.append((str(symbol), int(bounds.lower), high, coefficient, offset))
            dims.append(tensor_dims)
        return cls(dims, export_guards(exported))

    def matches(self, tensors: list[torch.Tensor], call: tuple[tuple[Any, ...], dict[str, Any]] | None = None) -> bool:
        """Whether ``tensors`` (pytree order) have sizes this extraction accepts.

        Args:
            tensors: the call's tensors in pytree order.
            call: ``(args, kwargs)`` of the call, to evaluate export's own shape guards (required when
                :attr:`code` is not empty; without it such a guard does not match).
        """
        if len(tensors) != len(self.dims):
            return False
        if self._check is not None and (call is None or not self._check_call(call)):
            return False
        symbols: dict[str, int] = {}
        derived: list[tuple[int, tuple[Any, ...]]] = []
        for tensor, dims in zip(tensors, self.dims):
            shape = tensor.shape
            if len(shape) != len(dims):
                return False
            for size, rule in zip(shape, dims):
                if isinstance(rule, int):
                    if size != rule:
                        return False
                    continue
                if len(rule) == 5:  # after every plain symbol is bound
                    derived.append((size, rule))
                    continue
                symbol, low, high = rule
                if size < low or (high is not None and size > high):
                    return False
                if symbols.setdefault(symbol, size) != size:
                    return False
        for size, (symbol, low, high, coefficient, offset) in derived:
            value, remainder = divmod(size - offset, coefficient)
            if remainder or value < low or (high is not None and value > high):
                return False
            if symbols.setdefault(symbol, value) != value:
                return False
        return True

    def _check_call(self, call: tuple[tuple[Any, ...], dict[str, Any]]) -> bool:
        try:  # the exported root is nnbridge's wrapper: forward(args, kwargs); guards address leaves by key path
            return self._check(guard_view({"args": call[0], "kwargs": call[1]}))  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - a guard that cannot be evaluated does not hold
            return False

    def failed(self, tensors: list[torch.Tensor], call: tuple[tuple[Any, ...], dict[str, Any]]) -> str:
        """Why :meth:`matches` is False for this call (for re-extraction messages)."""
        if len(tensors) != len(self.dims):
            return f"{len(tensors)} tensors instead of {len(self.dims)}"
        for i, (tensor, dims) in enumerate(zip(tensors, self.dims)):
            if len(tensor.shape) != len(dims):
                return f"tensor {i} has rank {len(tensor.shape)}, not {len(dims)}"
            for d, (size, rule) in enumerate(zip(tensor.shape, dims)):
                if isinstance(rule, int) and size != rule:
                    return f"tensor {i} has size {size} in dimension {d}; the graph is specialised to {rule}"
                if not isinstance(rule, int) and len(rule) == 3 and (
                        size < rule[1] or (rule[2] is not None and size > rule[2])):
                    return f"tensor {i} has size {size} in dimension {d}, outside [{rule[1]}, {rule[2]}]"
        if self._check is not None:
            failing = [code for code in self.code if not ShapeGuard([], [code])._check_call(call)]
            if failing:
                return f"export's shape guard {failing[0]!r} does not hold"
        return "dynamic dimensions that were equal (or derived from one another) differ"


def _affine(expr: Any) -> tuple[Any, int, int] | None:
    """``(symbol, coefficient, offset)`` when the sympy expression ``expr`` is
    ``coefficient * symbol + offset`` with integer coefficient (not 0) and offset; else None."""
    if expr is None:
        return None
    if expr.is_Symbol:
        return expr, 1, 0
    free = expr.free_symbols
    if len(free) != 1:
        return None
    (symbol,) = free
    coefficient, offset = expr.coeff(symbol), expr.subs(symbol, 0)
    if not (coefficient.is_Integer and offset.is_Integer) or coefficient == 0 or (
            (coefficient * symbol + offset - expr).expand() != 0):
        return None
    return symbol, int(coefficient), int(offset)
