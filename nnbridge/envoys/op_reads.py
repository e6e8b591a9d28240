"""Whether a trace body may read an op envoy: the test behind running module-only traces eagerly.

A trace whose workers only read and write module inputs and outputs (``model.transformer.h[0].output``)
needs no graph: nnsight's own hooks on the modules serve it, so :class:`~.models._Bridged` runs the
model's own code for it and extracts nothing. A trace that may touch an op
(``...attn.softmax.output``) is extracted first: only the modules its reads are placed on
(:func:`op_owners`), else the whole model.

The test reads the bytecode of every worker about to start (each invoke's body, and the model's
stored edits), of the code nested in it and of the Python functions it names: every attribute it
*reads* (``LOAD_ATTR``; method calls such as ``x.sum()`` are not envoy reads), and the identifier
segments of every string constant (but one only ever used as a key of a module's value:
``invoker.inputs[1]["input_ids"]``) and of every string a name in the body holds
(``getattr(envoy, "softmax")``, ``model.get(path)``). A name counts as a possible op when:

- it is one of the model's op envoy names already registered (exact, once anything was extracted);
- or, not being one of the envoy API's names (``output``, ``save``, ...) nor a tensor attribute
  (``grad``, ``device``, ...), it looks like a node name: an ATen op (``softmax``, ``add_3``), a
  forward argument of one of the model's module classes (placeholders: ``hidden_states``), a name
  ending in ``_`` (``weight_``, ``output_``), ``getitem``/``sym_size_int``, or ``invocation_<k>``.

A chain read through a ``for`` loop's variable over a module container (``for layer in
model.transformer.h[2:5]``, also in ``enumerate``/``reversed``/``zip``) or through a computed index
(``model.transformer.h[i]``, ``i`` a ``range`` counter or an int name) is read off every entry
iterated (every entry for a computed index); a variable assigned again, read outside its loop, or a
loop in nested code or a called function is not placed.

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

import builtins
import dis
import functools
import inspect
import re
import sys
import types
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Set as AbstractSet
from typing import NamedTuple, cast

import torch

from ..graph.module_tree import named_real_modules
from ..graph.op_point import OpPoint, OpPointContainer
from ..compat.torch.module_dicts import modules_of
from ..compat.nnsight.interleaving import envoy_api, envoy_module

#: Tensor attributes that are also ATen op names (``x.grad``, ``x.device``): read off values, not envoys.
TENSOR_ATTRIBUTES = frozenset({"grad", "data", "device", "dtype", "shape", "real", "imag", "T", "mT", "H", "mH",
                               "ndim", "layout", "is_leaf", "requires_grad", "grad_fn", "names", "itemsize",
                               "nbytes", "is_cuda", "values", "indices"})
#: nnbridge node names that are not ATen op names.
NODE_NAMES = frozenset({"getitem", "lifted_tensor", "_tensor_constant", "sym_size_int", "sym_numel", "sym_stride_int", "sym_storage_offset"})
#: Tracer and envoy methods whose use may make a trace see every location, ops included
#: (``tracer.cache(ops=True)``; see :func:`_sees_every_op`).
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
        for root, chain, assumed in chains:
            module = None
            if root is not None and id(code) in top and root not in stored and all(
                    name not in stored and _holds(name, resolve(name)) for name in assumed):
                module = envoy_module(resolve(root))
            for owner, names in _chain_reads(module, chain):
                if owner is None:
                    found.update(names)
                else:
                    owned.extend((owner, name) for name in names)
        for name in loaded:
            value = resolve(name)
            if isinstance(value, str):  # a path or name held in a variable (``model.get(path)``)
                found.update(_identifiers(value))
            elif isinstance(value, (list, tuple)) and value and all(isinstance(item, str) for item in value):
                found.update(name for item in value for name in _identifiers(item))  # ``for path in paths``
            elif isinstance(value, types.FunctionType):
                stack.append(value.__code__)
            elif isinstance(value, types.MethodType) and isinstance(value.__func__, types.FunctionType):
                stack.append(value.__func__.__code__)
            elif any(isinstance(envoy_module(item), (OpPoint, OpPointContainer))
                     for item in (value if isinstance(value, (list, tuple)) else (value,))):
                found.add(_HELD_OP)  # an op envoy held in a variable (``tracer.cache(modules=ops)``)
    return found, owned


def _chain_reads(start: torch.nn.Module | None, chain: tuple[Element, ...]
                 ) -> list[tuple[torch.nn.Module | None, list[str]]]:
    """The names of ``chain`` (attribute names and indices read one after the other from a value)
    that may be op reads, each with the module they are read off (None: not known), given the
    module whose envoy the chain starts from (None: not known, every name counts). Child modules
    (op points excepted) are followed; a constant index or slice of a container follows its
    entries, an :class:`AnyIndex` fans out to every entry; a module's ``output``/``input``/
    ``inputs`` ends the chain (a value follows)."""
    here: torch.nn.Module | list[torch.nn.Module] | None = start  # a list: a slice of a container's entries
    for position, element in enumerate(chain):
        if here is None:
            return [(None, _names(chain[position:]))]
        if not isinstance(element, str):
            entries = here if isinstance(here, list) else _entries(here)
            if entries is None:
                here = None
            elif isinstance(element, AnyIndex):
                rest = chain[position + 1:]
                return [read for entry in {id(e): e for e in entries}.values() for read in _chain_reads(entry, rest)]
            elif isinstance(element, slice):
                here = entries[element]
            else:
                here = entries[element] if -len(entries) <= element < len(entries) else None
            continue
        if isinstance(here, list) or element in envoy_api():  # a list's or the envoy's own attribute
            return [] if element in _VALUE_PROPERTIES else [(None, _names(chain[position:]))]
        child = modules_of(here).get(element)
        if isinstance(child, torch.nn.Module) and not isinstance(child, (OpPoint, OpPointContainer)):
            here = child
            continue
        return [(here, _names(chain[position:]))]
    return []


def _entries(module: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The entries of a container module in the order its envoy indexes, slices and iterates them
    (nnsight 0.8: the module's ``_modules``), or None: not a ModuleList/Sequential, or an entry is
    empty or an op point (then the envoy's children are not the entries)."""
    if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
        return None
    entries = list(modules_of(module).values())
    if not all(isinstance(entry, torch.nn.Module) and not isinstance(entry, (OpPoint, OpPointContainer))
               for entry in entries):
        return None
    return cast("list[torch.nn.Module]", entries)


def _names(chain: tuple[Element, ...]) -> list[str]:
    """The attribute names of ``chain``, read off a value or a module's envoy, but the name right
    after ``.source`` (an nnsight source operation, not an op)."""
    names: list[str] = []
    after_source = False
    for element in chain:
        if not isinstance(element, str):
            after_source = False
            continue
        if not after_source:
            names.append(element)
        after_source = element == "source"
    return names


def _holds(name: str, value: object) -> bool:
    """Whether ``name`` holds, when the trace starts, what a placed chain assumed of it: one of
    :data:`_ITERATION_BUILTINS`, not shadowed (``value``: the name's value in the trace's scope,
    None when it has none), else an int (an index)."""
    if name in _ITERATION_BUILTINS:
        return value is None or value is getattr(builtins, name)
    return isinstance(value, int) and not isinstance(value, bool)


#: An envoy's properties whose value is the module's value (a tensor, a tuple, a model output).
_VALUE_PROPERTIES = frozenset({"output", "input", "inputs"})
_ROOT_LOADS = frozenset({"LOAD_NAME", "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_FAST"})
_STORES = frozenset({"STORE_NAME", "STORE_GLOBAL", "STORE_DEREF", "STORE_FAST", "DELETE_NAME", "DELETE_FAST",
                     "DELETE_GLOBAL", "DELETE_DEREF"})
#: the stores that bind a loop variable :func:`_code_reads` follows (not a closure cell or a global)
_LOOP_STORES = frozenset({"STORE_NAME", "STORE_FAST"})
#: builtins a placed ``for`` loop may iterate: their loop variables are entries of module containers or ints
_ITERATION_BUILTINS = frozenset({"enumerate", "reversed", "zip", "range"})
#: instructions an index expression (``h[i + 1]``) may consist of
_INDEX_OPS = frozenset({"LOAD_CONST", "LOAD_NAME", "LOAD_FAST", "LOAD_GLOBAL", "BINARY_OP", "UNARY_NEGATIVE",
                        "UNARY_INVERT", "BUILD_SLICE"})


class AnyIndex:
    """A chain element for an index the code computes (``h[i]``, ``h[i + 1]``) or the entry a
    loop variable holds (``for layer in h``): any entry of the container."""

    def __repr__(self) -> str:
        return "AnyIndex()"


_ANY = AnyIndex()
Element = str | int | slice | AnyIndex
#: ``(root name or None, elements, names whose values when the trace starts the chain assumes
#: (see :func:`_holds`))``
Chain = tuple[str | None, tuple[Element, ...], frozenset[str]]


class _Binding(NamedTuple):
    """What a ``for`` loop's variable holds in the loop's body (``body``: instruction offsets):
    an entry of the container ``iterable`` reads, or an int (``iterable`` None)."""
    iterable: Chain | None
    assumed: frozenset[str]
    body: range


@functools.lru_cache(maxsize=1024)
def _code_reads(code: types.CodeType) -> tuple[frozenset[str], frozenset[str], tuple[types.CodeType, ...],
                                                tuple[Chain, ...], frozenset[str]]:
    """What one code object reads, by itself (cached: a trace's block is read once): its string
    identifiers and :data:`WHOLE_MODEL_METHODS` calls, the global/local names it loads, its nested
    code, its attribute chains (``model.h[0].attn.output`` is ``("model", ("h", 0, "attn",
    "output"), frozenset())``) and the names it assigns.

    A ``for`` loop variable stored once, over a chain (``for layer in model.h[1:3]``, also wrapped
    in ``enumerate``/``reversed``/``zip``), starts chains in the loop's body as the chain and
    :class:`AnyIndex` (``layer.attn`` is ``model.h[1:3][any].attn``); an index computed from
    names (``model.h[i]``) is :class:`AnyIndex`, the names that are not ``range``/``enumerate``
    counters in their loop's body being assumed ints."""
    reader = _CodeReader(code)
    reader.read()
    return reader.result()


class _CodeReader:
    """One pass over a code object's instructions for :func:`_code_reads`, one method per kind of
    instruction it follows: attribute loads, string constants, subscripts, loads of a name.

    Attributes:
        chain: the attribute chain being read, if any (its ``root`` name or None, the names
            ``assumed``, the position of its first instruction ``start``).
        spans: ``{position of a chain's last instruction: (its first's, the chain)}``.
        bindings: the ``for`` loop variables followed (see :func:`_loop_bindings`).
        value_keys: string constants used as keys of a module's value (``.output["logits"]``);
            ``strings``: the others.
    """

    def __init__(self, code: types.CodeType):
        self.code = code
        self.instructions = list(dis.get_instructions(code))
        self.stores = Counter(instruction.argval for instruction in self.instructions
                              if instruction.opname in _STORES)
        self.reads: set[str] = set()
        self.loaded: set[str] = set()
        self.chains: list[Chain] = []
        self.bindings: dict[str, _Binding] = {}
        self.spans: dict[int, tuple[int, Chain]] = {}
        self.root: str | None = None
        self.chain: list[Element] | None = None
        self.assumed: set[str] = set()
        self.start = 0
        self.value_keys: set[str] = set()
        self.strings: set[str] = set()

    def read(self) -> None:
        """Read every instruction."""
        i = 0
        while i < len(self.instructions):
            i = self.step(i)
        self.end(len(self.instructions) - 1)

    def step(self, i: int) -> int:
        """Read instruction ``i``; the position of the next instruction to read."""
        instruction = self.instructions[i]
        name, opname = instruction.argval, instruction.opname
        if opname in _LOAD_ATTRIBUTE and isinstance(name, str):
            self.load_attribute(i, name)
            return i + 1
        if opname == "LOAD_CONST" and isinstance(name, str):
            self.load_string(i, name)
        chain = self.chain
        index = _index(self.instructions, i) if chain is not None else None
        if chain is not None and index is not None:
            return self.subscript(instruction, index, chain) + 1
        self.end(i - 1)
        if opname == "GET_ITER":
            self.bindings.update(_loop_bindings(self.instructions, i, self.spans))
        if opname == "LOAD_METHOD" and name in WHOLE_MODEL_METHODS and _sees_every_op(self.code, self.instructions, i):
            self.reads.add(name)
        elif opname in _ROOT_LOADS and isinstance(name, str):
            self.load_name(instruction, i)
        return i + 1

    def load_attribute(self, i: int, name: str) -> None:
        """An attribute read (or written, deleted): extends the chain; a method load ends it."""
        instruction = self.instructions[i]
        method = (_METHOD and instruction.opname == "LOAD_ATTR" and bool((instruction.arg or 0) & 1))
        if method:
            if name in WHOLE_MODEL_METHODS and _sees_every_op(self.code, self.instructions, i):
                self.reads.add(name)
            self.end(i - 1)
            return
        if self.chain is None:
            self.root, self.chain, self.assumed, self.start = None, [], set(), i
        self.chain.append(name)
        if instruction.opname != "LOAD_ATTR":
            self.end(i)

    def load_string(self, i: int, value: str) -> None:
        """A string constant: a key of a module's value, or a string whose identifiers count."""
        chain = self.chain
        value_key = (chain is not None and i + 1 < len(self.instructions)
                     and self.instructions[i + 1].opname == "BINARY_SUBSCR"
                     and any(element in _VALUE_PROPERTIES for element in chain if isinstance(element, str)))
        (self.value_keys if value_key else self.strings).add(value)

    def subscript(self, instruction: dis.Instruction, index: tuple[Element, frozenset[str], int],
                  chain: list[Element]) -> int:
        """An index (see :func:`_index`) starting at ``instruction`` extends ``chain``; the position
        of its subscript."""
        element, names, position = index
        self.loaded.update(names)
        for index_name in names:
            counter = self.bound(index_name, instruction.offset)
            self.assumed.update({index_name} if counter is None or counter.iterable is not None else counter.assumed)
        chain.append(element)
        return position

    def load_name(self, instruction: dis.Instruction, i: int) -> None:
        """A load of a name: starts a chain at it (or at the chain of the container a loop variable
        iterates)."""
        name = instruction.argval
        if instruction.opname != "LOAD_FAST":
            self.loaded.add(name)
        binding = self.bound(name, instruction.offset)
        self.root, self.chain, self.assumed, self.start = name, [], set(), i
        if binding is not None and binding.iterable is not None:  # an entry of the container iterated
            root, elements, iterated = binding.iterable
            self.root = root
            self.chain, self.assumed = [*elements, _ANY], set(iterated | binding.assumed)

    def bound(self, name: str, offset: int) -> _Binding | None:
        """What the loop variable ``name`` holds at ``offset``, when it is one followed there."""
        binding = self.bindings.get(name)
        return binding if binding is not None and self.stores[name] == 1 and offset in binding.body else None

    def end(self, last: int) -> None:
        """End the chain being read (its last instruction: ``last``)."""
        if self.chain:
            read = (self.root, tuple(self.chain), frozenset(self.assumed))
            self.chains.append(read)
            self.spans[last] = (self.start, read)
        self.chain = None

    def result(self) -> tuple[frozenset[str], frozenset[str], tuple[types.CodeType, ...], tuple[Chain, ...],
                              frozenset[str]]:
        """What :func:`_code_reads` returns."""
        code = self.code
        # the names it assigns; a function's arguments and closure names are not the block's names
        # resolve() sees either
        stored = set(self.stores) | set(code.co_varnames) | set(code.co_cellvars) | set(code.co_freevars)
        nested: list[types.CodeType] = []
        for constant in code.co_consts:
            if isinstance(constant, types.CodeType):
                nested.append(constant)
            elif isinstance(constant, str) and (constant in self.strings or constant not in self.value_keys):
                self.reads.update(_identifiers(constant))
        return frozenset(self.reads), frozenset(self.loaded), tuple(nested), tuple(self.chains), frozenset(stored)


def _index(instructions: list[dis.Instruction], start: int) -> tuple[Element, frozenset[str], int] | None:
    """The index that ``instructions[start:]`` compute and subscript a value with: (a constant int
    or slice, or :class:`AnyIndex` for one computed from names without calls; the names; the
    position of the subscript), or None (not such an index)."""
    depth = 0
    names: set[str] = set()
    constants: list[object] = []
    for position in range(start, len(instructions)):
        instruction = instructions[position]
        if depth == 1 and instruction.opname == "BINARY_SUBSCR":
            break
        if instruction.opname not in _INDEX_OPS or (instruction.opname == "LOAD_GLOBAL" and (instruction.arg or 0) & 1):
            return None
        if instruction.opname == "LOAD_CONST":
            constants.append(instruction.argval)
        elif instruction.opname.startswith("LOAD_"):
            names.add(instruction.argval)
        elif names and instruction.opname == "BUILD_SLICE":
            return None  # a slice with computed bounds: which entries it holds is not known
        depth += dis.stack_effect(instruction.opcode, instruction.arg)
        if depth <= 0:
            return None
    else:
        return None
    element: Element
    if names:
        element = _ANY
    elif len(constants) == 1 and type(constants[0]) is int:
        element = constants[0]
    elif instructions[position - 1].opname == "BUILD_SLICE" and all(
            value is None or type(value) is int for value in constants):
        element = slice(*cast("list[int | None]", constants))
    else:
        return None
    return element, frozenset(names), position


def _loop_bindings(instructions: list[dis.Instruction], at: int, spans: dict[int, tuple[int, Chain]]
                   ) -> dict[str, _Binding]:
    """The variables of the ``for`` loop whose iterator ``instructions[at]`` (``GET_ITER``) makes,
    by name (none when the loop is not one :func:`_code_reads` follows)."""
    iterables = _iterated(instructions, at, spans)
    targets = _loop_targets(instructions, at + 1)
    if iterables is None or targets is None or len(targets) != len(iterables[1]):
        return {}
    body = range(instructions[at + 1].offset + 1, instructions[at + 1].argval)  # after FOR_ITER, to the loop's exit
    return {target: _Binding(iterable, iterables[0], body) for target, iterable in zip(targets, iterables[1])}


def _loop_targets(instructions: list[dis.Instruction], at: int) -> list[str] | None:
    """The names the ``FOR_ITER`` at ``instructions[at]`` stores each item in (one, or several
    unpacked), or None (another target: an attribute, a nested tuple, a closure cell)."""
    if instructions[at].opname != "FOR_ITER":
        return None
    count, first = 1, at + 1
    if instructions[first].opname == "UNPACK_SEQUENCE":
        count, first = instructions[first].arg or 0, first + 1
    stores = instructions[first:first + count]
    if len(stores) != count or any(store.opname not in _LOOP_STORES for store in stores):
        return None
    return [store.argval for store in stores]


def _iterated(instructions: list[dis.Instruction], at: int, spans: dict[int, tuple[int, Chain]]
              ) -> tuple[frozenset[str], list[Chain | None]] | None:
    """What the ``GET_ITER`` at ``instructions[at]`` iterates: (the builtins it assumes, for
    each variable of an item, the chain whose entries it holds or None for an int): a chain
    (``model.h``), ``enumerate``/``reversed``/``zip`` of chains, or ``range(...)``; else None."""
    if at - 1 in spans:
        chain = spans[at - 1][1]
        return (frozenset(), [chain]) if chain[0] is not None else None
    call = instructions[at - 1]
    if call.opname != "CALL":
        return None
    last = at - 2 if instructions[at - 2].opname == "PRECALL" else at - 1  # the arguments end before it
    callee = _callee(instructions, last, call.arg or 0)
    if callee is None:
        return None
    function = instructions[callee].argval
    assumed = frozenset({function})
    if function == "range":
        return assumed, [None]
    if function == "enumerate" and call.arg == 2 and type(instructions[last - 1].argval) is int \
            and instructions[last - 1].opname == "LOAD_CONST":
        last -= 1  # enumerate(h, 1)
    arguments = _chains_between(spans, callee + 1, last)
    if arguments is None or any(argument[0] is None for argument in arguments):
        return None
    if function == "enumerate" and len(arguments) == 1:
        return assumed, [None, arguments[0]]
    if function == "reversed" and len(arguments) == 1 or function == "zip":
        return assumed, list(arguments)
    return None


def _callee(instructions: list[dis.Instruction], last: int, count: int) -> int | None:
    """The position of the load of the :data:`_ITERATION_BUILTINS` function a call takes its
    ``count`` positional arguments to, the arguments being computed by ``instructions[:last]``
    without jumps, or None."""
    for candidate in range(last - 1, -1, -1):
        instruction = instructions[candidate]
        if instruction.opname not in ("LOAD_NAME", "LOAD_GLOBAL") or instruction.argval not in _ITERATION_BUILTINS:
            continue
        depth = 0
        for argument in instructions[candidate + 1:last]:
            if argument.opcode in dis.hasjrel or argument.opcode in dis.hasjabs or argument.opname == "KW_NAMES":
                return None
            depth += dis.stack_effect(argument.opcode, argument.arg if argument.opcode >= dis.HAVE_ARGUMENT else None)
            if depth < 0:
                break
        else:
            if depth == count:
                return candidate
    return None


def _chains_between(spans: dict[int, tuple[int, Chain]], first: int, last: int) -> list[Chain] | None:
    """The chains that ``instructions[first:last]`` read one after the other, exactly, or None."""
    chains: list[Chain] = []
    end = last - 1
    while end >= first:
        if end not in spans:
            return None
        start, chain = spans[end]
        chains.append(chain)
        end = start - 1
    return chains[::-1] if end == first - 1 else None


#: instructions that start a call's callable (a method load, or the NULL before a function)
_CALL_STARTS = frozenset({"LOAD_METHOD", "PUSH_NULL"})


def _sees_every_op(code: types.CodeType, instructions: list[dis.Instruction], start: int) -> bool:
    """Whether the method loaded at ``instructions[start]`` (``tracer.cache``) may record every op:
    called with an ``ops=`` keyword (``tracer.cache(ops=True)``), or a call the test cannot read
    (``**kwargs``, or not found). ``tracer.cache()`` records module envoys only, as nnsight's, and
    ``modules=`` records the envoys it names (what they are is read as any other chain)."""
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
            return isinstance(names, tuple) and "ops" in names
        elif opname in ("CALL_FUNCTION_EX", "RETURN_VALUE", "RETURN_CONST"):
            return True
    return True


def _identifiers(text: str) -> list[str]:
    """The identifier segments of a name or dotted path (``"transformer.h.0.attn.softmax"``)."""
    if len(text) > 200:
        return []
    return [part for part in text.split(".") if part.isidentifier()]


def forward_arguments(model: torch.nn.Module, modules: Iterable[torch.nn.Module] | None = None) -> frozenset[str]:
    """The forward parameter names of every module class in ``model`` (their placeholders' names);
    ``modules``: ``model``'s modules when already listed (op points left out either way: their
    own forward is nnbridge's)."""
    if modules is None:
        modules = (module for _, module in named_real_modules(model))
    return _forward_arguments(frozenset(type(module) for module in modules))


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


def may_be_op(name: str, known_ops: AbstractSet[str], arguments: frozenset[str]) -> bool:
    """Whether ``name``, read as an attribute in a trace body, may be an op envoy (see the module
    docstring): always for a registered op name, else by its shape."""
    decided = _decided(name, known_ops)
    return decided if decided is not None else _argument_like(name, arguments)


def _decided(name: str, known_ops: AbstractSet[str]) -> bool | None:
    """:func:`may_be_op` by the rules that need no forward argument names, or None: only
    :func:`_argument_like` decides."""
    if name in known_ops or name in WHOLE_MODEL_METHODS:
        return True
    if name in envoy_api() or name in TENSOR_ATTRIBUTES:
        return False
    if name.endswith("_") or _INVOCATION.fullmatch(name):
        return True
    return None


def _argument_like(name: str, arguments: frozenset[str]) -> bool:
    match = _NUMBERED.fullmatch(name)
    base = match.group(1) if match is not None else name
    return base in NODE_NAMES or base in arguments or name in arguments or _aten(base) or _aten(name)


def possible_ops(codes: Iterable[types.CodeType], resolve: Callable[[str], object], model: torch.nn.Module,
                 *, known_ops: Iterable[str]) -> list[str]:
    """The names the trace bodies ``codes`` read that may be op envoys of ``model`` whose
    registered op envoy names so far are ``known_ops`` (see the module docstring), sorted."""
    reads = attribute_reads(codes, resolve)
    if not reads:
        return []
    known, arguments = frozenset(known_ops), forward_arguments(model)
    return sorted(name for name in reads if may_be_op(name, known, arguments))


def op_owners(codes: Iterable[types.CodeType], resolve: Callable[[str], object], model: torch.nn.Module,
              *, known_ops: Iterable[str] | AbstractSet[str]) -> dict[str, frozenset[str]] | None:
    """Where the trace bodies ``codes`` may read op envoys, for extracting only there (see
    :meth:`nnbridge.inplace.bridging.Bridge.lazily`): ``{path of a submodule of model: the possible
    op names read off its envoy}`` (empty: no op read).

    A read through a loop variable or a computed index counts for every container entry it may
    be (see :func:`_code_reads`): ``for layer in model.h: layer.attn.softmax`` gives
    ``{"h.0.attn": {"softmax"}, "h.1.attn": {"softmax"}, ...}``.

    None when the whole model must be extracted: a possible op name is read off no module the test
    can name (a string path, a loop variable it does not follow, a name read in nested code or a
    called function, ``tracer.cache(ops=True)``), off
    the model itself, or is an invocation container (``invocation_1``: a module called several
    times per forward numbers its calls only in a whole-model extraction); also when the reads lie
    in more than :data:`LAZY_ENTRIES` entries of one container (see there)."""
    unowned, owned = _reads(codes, resolve)
    known = known_ops if isinstance(known_ops, AbstractSet) else frozenset(known_ops)
    # the module tree is walked (op points, hundreds after an extraction, left out) only when a
    # name's shape needs the forward argument names, or a read is owned by a module whose path
    # the last walk of this model did not give: a module-only trace reads no possible op, and a
    # trace reading a registered op of a known module needs no walk
    walk: list[tuple[str, torch.nn.Module]] | None = None
    arguments: frozenset[str] | None = None

    def walked() -> list[tuple[str, torch.nn.Module]]:
        nonlocal walk
        if walk is None:
            walk = _walk(model)
        return walk

    def possible(name: str) -> bool:
        nonlocal arguments
        decided = _decided(name, known)
        if decided is not None:
            return decided
        if arguments is None:
            arguments = forward_arguments(model, (module for _, module in walked()))
        return _argument_like(name, arguments)

    if any(possible(name) for name in unowned):
        return None
    result: dict[str, set[str]] = {}
    for owner, name in owned:
        if not possible(name):
            continue
        path = _known_path(model, owner)
        if path is None:
            walked()
            path = _known_path(model, owner)
        if not path or _INVOCATION.fullmatch(name):
            return None
        result.setdefault(path, set()).add(name)
    # one container's entries reached: at most one per path, so only more paths than the bound need the walk
    if len(result) > LAZY_ENTRIES and _entries_reached(walked(), result) > LAZY_ENTRIES:
        return None
    return {path: frozenset(names) for path, names in result.items()}


#: ``{id(model): (model's weak reference, {id(module): its path in model})}`` from the last walk
#: of each model (see :func:`_known_path`)
_PATHS: dict[int, tuple[weakref.ref[torch.nn.Module], dict[int, str]]] = {}


def _walk(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``model``'s ``(path, module)`` pairs without op points (:func:`named_real_modules`); the
    paths are kept for :func:`_known_path`."""
    walk = list(named_real_modules(model))
    key = id(model)

    def forget(_: object) -> None:
        _PATHS.pop(key, None)
    _PATHS[key] = (weakref.ref(model, forget), {id(module): path for path, module in walk})
    return walk


def _known_path(model: torch.nn.Module, module: torch.nn.Module) -> str | None:
    """The path under which ``model``'s last walk found ``module``, if ``model.get_submodule``
    still gives ``module`` there (a module moved, removed or replaced since is walked again);
    else None. A module under two parents has the path the walk met last (as a dict of the
    walk's pairs gives)."""
    entry = _PATHS.get(id(model))
    if entry is None or entry[0]() is not model:
        return None
    path = entry[1].get(id(module))
    if path is None:
        return None
    try:
        found = model.get_submodule(path) if path else model
    except AttributeError:
        return None
    return path if found is module else None


#: Most entries of one module container (decoder layers) a lazily extracted trace reaches: beyond,
#: the whole model is extracted, which exports one representative layer and builds its siblings
#: from it (layer reuse), while each lazily extracted module is exported by itself: separate
#: exports of many layers cost more than one export of the whole model, even without reuse.
LAZY_ENTRIES = 2


def _entries_reached(modules: Iterable[tuple[str, torch.nn.Module]], paths: Iterable[str]) -> int:
    """The largest number of entries of one ModuleList/Sequential among ``modules`` (a model's
    ``(path, module)`` pairs) that ``paths`` (submodule paths) lie in."""
    containers = [name for name, module in modules
                  if name and isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential))]
    most = 0
    for container in containers:
        entries = {path[len(container) + 1:].split(".")[0] for path in paths if path.startswith(f"{container}.")}
        most = max(most, len(entries))
    return most
