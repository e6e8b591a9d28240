"""Whether a trace body may read an op envoy: the test behind running module-only traces eagerly.

A trace whose workers only read and write module inputs and outputs (``model.transformer.h[0].output``)
needs no graph: nnsight's own hooks on the modules serve it, so :class:`~.models._Bridged` runs the
model's own code for it and extracts nothing (issue: "for a trace that touches only module inputs
and outputs, run the plain model"). A trace that may touch an op (``...attn.softmax.output``) is
extracted first: only the modules its reads are placed on (:func:`op_owners`), else the whole model.

The test reads the bytecode of every worker about to start (each invoke's body, and the model's
stored edits), of the code nested in it and of the Python functions it names: every attribute it
*reads* (``LOAD_ATTR``; method calls such as ``x.sum()`` are not envoy reads), and the identifier
segments of every string constant and of every string a name in the body holds
(``getattr(envoy, "softmax")``, ``model.get(path)``). A name counts as a possible op when:

- it is one of the model's op envoy names already registered (exact, once anything was extracted);
- or, not being one of the envoy API's names (``output``, ``save``, ...) nor a tensor attribute
  (``grad``, ``device``, ...), it looks like a node name: an ATen op (``softmax``, ``add_3``), a
  forward argument of one of the model's module classes (placeholders: ``hidden_states``), a name
  ending in ``_`` (``weight_``, ``output_``), ``getitem``/``sym_size_int``, or ``invocation_<k>``.

It errs towards extracting: a name the test cannot rule out costs an extraction, never a result.
A body that reaches an op only through code the test cannot see (a name built at run time) gets
nnbridge's "ops are not known yet" ``AttributeError`` at that read (loud, never a wrong value);
``model.extract(*inputs)`` before the trace makes the ops known.

Example::

    reads = attribute_reads([compile("model.transformer.h[0].attn.softmax.output.save()", "", "exec")],
                            lambda name: None)
    # {'transformer', 'h', 'attn', 'softmax', 'output'}
"""

from __future__ import annotations

import dis
import functools
import inspect
import re
import sys
import types
from collections.abc import Callable, Iterable

import torch

from ..bridge.op_point import OpPoint, OpPointContainer
from ..compat.module_dicts import modules_of
from ..compat.nnsight import envoy_api, envoy_module

#: Tensor attributes that are also ATen op names (``x.grad``, ``x.device``): read off values, not envoys.
TENSOR_ATTRIBUTES = frozenset({"grad", "data", "device", "dtype", "shape", "real", "imag", "T", "mT", "H", "mH",
                               "ndim", "layout", "is_leaf", "requires_grad", "grad_fn", "names", "itemsize",
                               "nbytes", "is_cuda", "values", "indices"})
#: nnbridge node names that are not ATen op names.
NODE_NAMES = frozenset({"getitem", "lifted_tensor", "_tensor_constant", "sym_size_int", "sym_numel", "sym_stride_int", "sym_storage_offset"})
#: Tracer and envoy methods whose use makes a trace see every location, ops included (``tracer.cache()``).
WHOLE_MODEL_METHODS = frozenset({"cache"})
#: what :func:`attribute_reads` reports for an op envoy held in a name: a node name
_HELD_OP = "getitem"
_NUMBERED = re.compile(r"(.*?)(_\d+)?")
_INVOCATION = re.compile(r"invocation_\d+")
_LOAD_ATTRIBUTE = frozenset({"LOAD_ATTR", "STORE_ATTR", "DELETE_ATTR"})
_METHOD = sys.version_info >= (3, 12)  # LOAD_ATTR's low bit marks a method load from 3.12 on


@functools.cache
def _aten(name: str) -> bool:
    return bool(name) and hasattr(torch.ops.aten, name)


def attribute_reads(codes: Iterable[types.CodeType], resolve: Callable[[str], object]) -> set[str]:
    """Every attribute name ``codes`` read (not method calls), the identifier segments of their
    string constants and of the strings their names hold, and the method names of
    :data:`WHOLE_MODEL_METHODS` they call, following nested code and the Python functions named in them (``resolve(name)``: the value of a global or
    local name, or None).

    A chain of reads from a name of a block in ``codes`` that the block never assigns
    (``model.linear.output``) is followed through the modules of the envoy the name holds: the
    names of child modules and what follows a module's ``output``/``input``/``inputs`` (values,
    not envoys: ``.output.hidden_states``) are not reads of possible ops."""
    unowned, owned = _reads(codes, resolve)
    return unowned | {name for _, name in owned}


def _reads(codes: Iterable[types.CodeType], resolve: Callable[[str], object]
           ) -> tuple[set[str], list[tuple[torch.nn.Module, str]]]:
    """:func:`attribute_reads`, split: the names read off no known module, and ``(module, name)``
    for the names of a chain read off ``module``'s envoy (``model.h[0].attn.softmax`` reads
    ``softmax`` off ``h[0].attn``)."""
    found: set[str] = set()
    owned: list[tuple[torch.nn.Module, str]] = []
    seen: set[int] = set()
    top = {id(code) for code in codes}
    stack = list(codes)
    while stack:
        code = stack.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        reads, loaded, nested, chains, stored = _code_reads(code)
        found.update(reads)
        stack.extend(nested)
        for root, chain in chains:
            module = None
            if root is not None and id(code) in top and root not in stored:
                module = envoy_module(resolve(root))
            owner, names = _chain_reads(module, chain)
            if owner is None:
                found.update(names)
            else:
                owned.extend((owner, name) for name in names)
        for name in loaded:
            value = resolve(name)
            if isinstance(value, str):  # a path or name held in a variable (``model.get(path)``)
                found.update(_identifiers(value))
            elif isinstance(value, types.FunctionType):
                stack.append(value.__code__)
            elif isinstance(value, types.MethodType) and isinstance(value.__func__, types.FunctionType):
                stack.append(value.__func__.__code__)
            elif any(isinstance(envoy_module(item), (OpPoint, OpPointContainer))
                     for item in (value if isinstance(value, (list, tuple)) else (value,))):
                found.add(_HELD_OP)  # an op envoy held in a variable (``tracer.cache(modules=ops)``)
    return found, owned


def _chain_reads(module: torch.nn.Module | None, chain: tuple[str | int, ...]
                 ) -> tuple[torch.nn.Module | None, list[str]]:
    """The names of ``chain`` (attribute names and constant indices read one after the other from
    a value) that may be op reads, given the module whose envoy the chain starts from (None: not
    known, every name counts), and the module they are read off (None: not known). Child modules
    (op points excepted) are followed; a module's ``output``/``input``/``inputs`` ends the chain
    (a value follows); the name right after ``.source`` is an nnsight source operation, not an
    op."""
    names: list[str] = []
    owner: torch.nn.Module | None = None
    after_source = False
    for position, element in enumerate(chain):
        if module is not None:
            if isinstance(element, int):
                if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and -len(module) <= element < len(module):
                    module = module[element]
                    continue
                module = None
                continue
            if element in _VALUE_PROPERTIES:
                return None, names
            if element in envoy_api():  # the envoy's own attribute, whatever the module's children
                return None, names + _chain_reads(None, chain[position:])[1]
            child = modules_of(module).get(element)
            if isinstance(child, torch.nn.Module) and not isinstance(child, (OpPoint, OpPointContainer)):
                module = child
                continue
            owner, module = module, None
        if isinstance(element, int):
            after_source = False
            continue
        if not after_source:
            names.append(element)
        after_source = element == "source"
    return owner, names


#: An envoy's properties whose value is the module's value (a tensor, a tuple, a model output).
_VALUE_PROPERTIES = frozenset({"output", "input", "inputs"})
_ROOT_LOADS = frozenset({"LOAD_NAME", "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_FAST"})
_STORES = frozenset({"STORE_NAME", "STORE_GLOBAL", "STORE_DEREF", "STORE_FAST", "DELETE_NAME", "DELETE_FAST",
                     "DELETE_GLOBAL", "DELETE_DEREF"})
Chain = tuple[str | None, tuple[str | int, ...]]


@functools.lru_cache(maxsize=1024)
def _code_reads(code: types.CodeType) -> tuple[frozenset[str], frozenset[str], tuple[types.CodeType, ...],
                                                tuple[Chain, ...], frozenset[str]]:
    """What one code object reads, by itself (cached: a trace's block is read once): its string
    identifiers and :data:`WHOLE_MODEL_METHODS` calls, the global/local names it loads, its nested
    code, its attribute chains (``(root name or None, (attribute or constant index, ...))``:
    ``model.h[0].attn.output`` is ``("model", ("h", 0, "attn", "output"))``) and the names it
    assigns."""
    reads: set[str] = set()
    loaded: set[str] = set()
    stored: set[str] = set()
    chains: list[Chain] = []
    root: str | None = None
    chain: list[str | int] | None = None  # the chain being read, if any

    def end() -> None:
        nonlocal chain
        if chain:
            chains.append((root, tuple(chain)))
        chain = None

    instructions = list(dis.get_instructions(code))
    for i, instruction in enumerate(instructions):
        name, opname = instruction.argval, instruction.opname
        if opname in _LOAD_ATTRIBUTE and isinstance(name, str):
            method = (_METHOD and opname == "LOAD_ATTR" and bool((instruction.arg or 0) & 1))
            if method:
                if name in WHOLE_MODEL_METHODS and not _limited_to_modules(code, instructions, i):
                    reads.add(name)
                end()
                continue
            if chain is None:
                root, chain = None, []
            chain.append(name)
            if opname != "LOAD_ATTR":
                end()
            continue
        if (chain is not None and opname == "LOAD_CONST" and type(name) is int and i + 1 < len(instructions)
                and instructions[i + 1].opname == "BINARY_SUBSCR"):
            chain.append(name)
            continue
        if chain is not None and opname == "BINARY_SUBSCR" and chain and type(chain[-1]) is int \
                and instructions[i - 1].opname == "LOAD_CONST":
            continue
        end()
        if opname == "LOAD_METHOD" and name in WHOLE_MODEL_METHODS and not _limited_to_modules(code, instructions, i):
            reads.add(name)
        elif opname in _ROOT_LOADS and isinstance(name, str):
            if opname != "LOAD_FAST":
                loaded.add(name)
            root, chain = name, []
        elif opname in _STORES and isinstance(name, str):
            stored.add(name)
    end()
    # a function's arguments and closure names are not the block's names resolve() sees
    stored.update(code.co_varnames, code.co_cellvars, code.co_freevars)
    nested: list[types.CodeType] = []
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            nested.append(constant)
        elif isinstance(constant, str):
            reads.update(_identifiers(constant))
    return frozenset(reads), frozenset(loaded), tuple(nested), tuple(chains), frozenset(stored)


#: instructions that start a call's callable (a method load, or the NULL before a function)
_CALL_STARTS = frozenset({"LOAD_METHOD", "PUSH_NULL"})


def _limited_to_modules(code: types.CodeType, instructions: list[dis.Instruction], start: int) -> bool:
    """Whether the method loaded at ``instructions[start]`` (``tracer.cache``) is called with a
    ``modules=`` keyword (nnsight 0.8: then it caches those envoys only; what they are is read as
    any other chain). False when the call cannot be found (a conservative answer)."""
    depth = 0
    for position in range(start + 1, len(instructions)):
        instruction = instructions[position]
        opname = instruction.opname
        if opname in _CALL_STARTS or (opname == "LOAD_GLOBAL" and (instruction.arg or 0) & 1) or (
                _METHOD and opname == "LOAD_ATTR" and (instruction.arg or 0) & 1):
            depth += 1
        elif opname in ("CALL", "CALL_KW"):
            if depth:
                depth -= 1
                continue
            names: object = None
            for before in reversed(instructions[max(start, position - 3):position]):
                if before.opname == "KW_NAMES" and before.arg is not None:
                    names = code.co_consts[before.arg]
                elif opname == "CALL_KW" and before.opname == "LOAD_CONST":
                    names = before.argval
                if names is not None:
                    break
            return isinstance(names, tuple) and "modules" in names
        elif opname in ("CALL_FUNCTION_EX", "RETURN_VALUE", "RETURN_CONST"):
            return False
    return False


def _identifiers(text: str) -> list[str]:
    """The identifier segments of a name or dotted path (``"transformer.h.0.attn.softmax"``)."""
    if len(text) > 200:
        return []
    return [part for part in text.split(".") if part.isidentifier()]


def forward_arguments(model: torch.nn.Module) -> frozenset[str]:
    """The forward parameter names of every module class in ``model`` (their placeholders' names)."""
    return _forward_arguments(frozenset(type(module) for module in model.modules()))


@functools.cache
def _forward_arguments(classes: frozenset[type[torch.nn.Module]]) -> frozenset[str]:
    names: set[str] = set()
    for cls in classes:
        try:
            names.update(inspect.signature(cls.forward).parameters)
        except (TypeError, ValueError):  # a builtin or C forward: no placeholders to name
            continue
    names.discard("self")
    return frozenset(names)


def may_be_op(name: str, known_ops: frozenset[str], arguments: frozenset[str]) -> bool:
    """Whether ``name``, read as an attribute in a trace body, may be an op envoy (see the module
    docstring): always for a registered op name, else by its shape."""
    if name in known_ops or name in WHOLE_MODEL_METHODS:
        return True
    if name in envoy_api() or name in TENSOR_ATTRIBUTES:
        return False
    if name.endswith("_") or _INVOCATION.fullmatch(name):
        return True
    match = _NUMBERED.fullmatch(name)
    base = match.group(1) if match is not None else name
    return base in NODE_NAMES or base in arguments or name in arguments or _aten(base) or _aten(name)


def possible_ops(codes: Iterable[types.CodeType], resolve: Callable[[str], object], model: torch.nn.Module,
                 known_ops: Iterable[str]) -> list[str]:
    """The names the trace bodies ``codes`` read that may be op envoys of ``model`` whose
    registered op envoy names so far are ``known_ops`` (see the module docstring), sorted."""
    reads = attribute_reads(codes, resolve)
    if not reads:
        return []
    known, arguments = frozenset(known_ops), forward_arguments(model)
    return sorted(name for name in reads if may_be_op(name, known, arguments))


def op_owners(codes: Iterable[types.CodeType], resolve: Callable[[str], object], model: torch.nn.Module,
              known_ops: Iterable[str]) -> dict[str, frozenset[str]] | None:
    """Where the trace bodies ``codes`` may read op envoys, for extracting only there (see
    :meth:`nnbridge.bridge.in_place.Bridge.lazily`): ``{path of a submodule of model: the possible
    op names read off its envoy}`` (empty: no op read).

    None when the whole model must be extracted: a possible op name is read off no module the test
    can name (a string path, a loop variable, a name read in nested code, ``tracer.cache()``), off
    the model itself, or is an invocation container (``invocation_1``: a module called several
    times per forward numbers its calls only in a whole-model extraction)."""
    unowned, owned = _reads(codes, resolve)
    known, arguments = frozenset(known_ops), forward_arguments(model)
    if any(may_be_op(name, known, arguments) for name in unowned):
        return None
    paths = {id(module): path for path, module in model.named_modules()}
    result: dict[str, set[str]] = {}
    for owner, name in owned:
        if not may_be_op(name, known, arguments):
            continue
        path = paths.get(id(owner))
        if not path or _INVOCATION.fullmatch(name):
            return None
        result.setdefault(path, set()).add(name)
    return {path: frozenset(names) for path, names in result.items()}
