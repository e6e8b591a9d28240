"""Generated corpus programs (issue 48): a program is data (a :class:`Program`, a small tree of frozen
dataclasses), rendered to the Python source of an ``nn.Module`` and its script (:func:`render`),
written to a file and imported (:func:`load`), so that its classes have a source file as a user's
do (the disk extraction cache only serves those) and a failing program reads as a corpus entry.

The grammar (``tests/corpus/test_fuzz.py`` draws from it with hypothesis) is made of the constructs that
broke extraction before, and their neighbours:

- block classes ``B<i>`` (``forward(self, x, a)`` or ``forward(self, x)``) over a ``Linear``,
  optionally calling an inner child ``Inner(p, q)`` positionally, by keyword in either order or
  mixed, and reading a Python float attribute ``self.alpha``;
- the root's children: single blocks, ``ModuleList``s of identical or of differing blocks (layer
  reuse), a second attribute for an earlier child (a shared module), and a ``ModuleList`` of
  ``CachedLayer``s (``corpus.program_parts``) that write and read their own layer of a
  transformers ``DynamicCache`` (layer reuse with cache rebinding; decode steps);
- the root's forward: child calls with positional/keyword arguments in any order and repeated
  arguments (``self.c0(v1, v1)``), loops over a ``ModuleList`` (``h = b(h, a)``, ``h is a`` on the
  first iteration when aliased), a child called twice, ``torch.no_grad()`` regions, in-place buffer
  updates in training, dropout (the RNG), a Python counter, a list nested in a root attribute the
  forward appends to (and reads the length of, or not), reads of a Python float, of a plain
  object's attributes (``self.hp.scale``, ``self.hp.inner.bias``, a tensor ``self.hp.vector``), of
  a callable object (``self.act(v)``), of a numpy scalar (``self.k``), of a numpy array
  (``self.arr[0]``), of a numpy array in a module global dict (``TABLES["t"][0]``), a call of a ``Linear`` kept out of the registry in a plain list
  (``self.outside[0](v)``), a child appending to a list the root
  makes and reads back (``self.gather(v, acts)``), a loop over the cached layers with the
  root's ``cache`` argument; a tensor, tuple or dict output;
- the script: calls with and without grad (all with one cache, when the root takes one: each
  call after the first is a decode step), and edits between them: module attribute writes,
  plain-object attribute writes and replacements (a numpy array written in place, the global
  ``TABLES["t"]`` too; a held tensor
  written in place or replaced; the
  out-of-registry ``Linear``'s weight written in place, or the ``Linear`` replaced), child swaps,
  class swaps (``__class__``),
  ``.double()`` and a block child called on its own (its output kept and compared);
- block bodies and root reads that walk a module's registry (``self.children()``, ``self.modules()``);
- registry edits in forward, from a plain list of spares while they last: in the root's, a block
  appended to a ``ModuleList``, an entry replaced, a block child's attribute rebound; in a
  block's, its ``Linear`` rebound.

Every construct a program uses that belongs to a known silent difference is named in
:attr:`Program.features` (see ``KNOWN_FEATURES`` in ``tests/corpus/test_fuzz.py``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from corpus.program_parts import CACHED_KINDS

#: body templates of a block's forward by arity (``x`` and ``a`` are its arguments)
#: (the last of each walks the block's registry: a bridge's op points must not be in it while its code runs)
BODIES: dict[int, tuple[str, ...]] = {
    2: ("self.lin(x + a)", "self.lin(x) * torch.tanh(a)", "self.lin(x) + self.lin(a)", "torch.relu(self.lin(x)) - a",
        "self.lin(x + a) * len(list(self.children()))"),
    1: ("self.lin(x)", "torch.tanh(self.lin(x)) + x", "self.lin(self.lin(x))", "self.lin(x) + len(list(self.modules()))"),
}
#: how a block calls its inner child ``Inner(p, q)``
INNER_CALLS = ("pos", "kw", "kw_rev", "mixed")
#: the root's reads: a Python float, a plain object's attributes, a callable object, a numpy scalar,
#: the number of modules in its tree (a walk of its registry), a plain object's tensor, a ``Linear``
#: kept out of the registry, a list the root makes and its child ``gather`` fills, an element of
#: a numpy array, and an element of a numpy array in a module global dict beside a function
#: (``TABLES["t"][0]``, see nnbridge.guards.code_walk.CodeWalk.data_item), of one in a module global
#: ``deque`` (``QUEUE[0][0]``), and a module global ``functools.partial`` called (``SCALED(x)``, its
#: keyword ``k`` a number)
READS = ("alpha", "hp", "nested", "act", "k", "modules", "vector", "outside", "gather", "array", "table", "queue",
         "keyword")
#: the reads of module globals, which each run's script sets back first (:data:`_GLOBALS_RESET`)
GLOBAL_READS = ("table", "queue", "keyword")
#: where a ``"log"`` statement appends: a list nested in a list, a dict, a tuple or a
#: ``SimpleNamespace`` the root holds (state reached inside an attribute, see nnbridge.guards.reached_state)
LOGS = {"list": ("[[]]", "[0]"), "dict": ("{'h': []}", "['h']"), "tuple": ("([], 0)", "[0]"),
        "namespace": ("types.SimpleNamespace(items=[])", ".items"), "print": ("", "")}
#: edits of plain objects (not modules): issue 48 item 2
PLAIN_EDITS = ("hp_attr", "hp_replace", "nested_attr", "act_attr", "act_replace", "k_replace", "vector_write",
               "vector_replace", "outside_write", "outside_replace", "array_write", "table_write", "queue_write",
               "keyword_write")
#: the edits of :data:`PLAIN_EDITS` that change a tensor a graph would bake in as a constant, or an
#: array element it would bake in as a number
HELD_TENSOR_EDITS = ("vector_write", "vector_replace", "outside_write", "outside_replace", "array_write",
                     "table_write", "queue_write")
#: how a ``"registry"`` statement edits a child's registry in forward: ``self.c<i>.append(spare)``,
#: ``self.c<i>[j] = spare`` (a ModuleList), ``self.c<i> = spare`` (a block or shared child)
REGISTRY_EDITS = ("grow", "swap", "set")
#: (``direct``: the user calls a block child on its own, its code running over the bridged model)
EDITS = ("root_alpha", "block_alpha", "swap_child", "swap_class", "double", *PLAIN_EDITS, "direct")


@dataclass(frozen=True)
class Block:
    """A block class: ``arity`` arguments, ``body`` an index into :data:`BODIES`, ``inner`` how it
    calls an inner ``Inner`` child first (None: no inner child), ``alpha``: multiplies by
    ``self.alpha``, ``rebinds``: binds a spare ``Linear`` to ``self.lin`` in forward, while its
    plain list of two spares lasts."""
    arity: int
    body: int
    inner: str | None = None
    alpha: bool = False
    rebinds: bool = False


@dataclass(frozen=True)
class Child:
    """A root child ``c<i>``: ``kind`` ``"block"`` (``blocks[0]``), ``"list"`` (a ModuleList of
    ``blocks``), ``"shared"`` (``blocks[0]`` is an earlier child's index: the same module) or
    ``"cached"`` (a ModuleList of ``blocks[0]`` ``CachedLayer``s of kind
    ``CACHED_KINDS[blocks[1]]``, layer indices 0, 1, ...; ``blocks[2]``: the cache alternates
    sliding-window layers)."""
    kind: str
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class Stmt:
    """One statement of the root's forward, making a new variable from earlier ones (``v0`` is the
    input). ``kind``: ``"call"`` (child ``child`` on ``args``, by ``style``), ``"loop"`` (over list
    ``child``, ``h = args[0]``, each ``h = b(h, args[1])``), ``"cached"`` (over the cached layers
    ``child``, each ``h = b(h, cache)``; ``style`` ``"reversed"``: the last layer first),
    ``"read"`` (``style`` one of :data:`READS` applied to ``args[0]``), ``"buffer"``, ``"nograd"``
    (``call`` in a no_grad region), ``"dropout"``, ``"counter"``, ``"log"`` (appends the batch size
    to a list nested in a root attribute, :data:`LOGS` ``style``, then ``args[0]``, times the
    list's length for ``"list"`` and ``"dict"``; ``"print"``: prints its batch size and sum), ``"add"``, ``"registry"`` (edits
    child ``child``'s registry by ``style``, one of :data:`REGISTRY_EDITS`, entry ``entry`` for
    ``"swap"``, from spares of block class :meth:`Program.spare_class`; then ``args[0]`` times the
    number of the root's children, or of the list's entries)."""
    kind: str
    args: tuple[int, ...]
    child: int = 0
    style: str = "pos"
    entry: int = 0


@dataclass(frozen=True)
class Step:
    """A script step: a call (``kind == "call"``, ``grad``, ``input_grad``: the input requires
    grad, ``rows``: its batch size) or an edit (``kind`` one of :data:`EDITS`, of child ``child``,
    entry ``entry`` of a list, to ``value`` or to block class ``block``)."""
    kind: str
    grad: bool = True
    input_grad: bool = False
    rows: int = 2
    child: int = 0
    entry: int = 0
    block: int = 0
    value: float = 2.0


@dataclass(frozen=True)
class Program:
    blocks: tuple[Block, ...]
    children: tuple[Child, ...]
    stmts: tuple[Stmt, ...]
    output: tuple[str, tuple[int, ...]]  # ("one" | "tuple" | "dict", variables)
    script: tuple[Step, ...]
    modes: tuple[str, ...] = ("train",)

    @property
    def features(self) -> frozenset[str]:
        """The constructs of known silent differences the program uses (``tests/corpus/test_fuzz.py``)."""
        found = set()
        roots = alias_roots(self.stmts)
        for stmt in self.stmts:
            if stmt.kind == "loop" and self.blocks[self.children[stmt.child].blocks[0]].arity == 2 \
                    and roots[stmt.args[0]] == roots[stmt.args[1]]:
                found.add("loop_alias")
        if any(step.kind in PLAIN_EDITS for step in self.script):
            found.add("plain_object_edit")
        return frozenset(found)

    def name(self) -> str:
        return "fuzz_" + hashlib.sha256(repr(self).encode()).hexdigest()[:10]

    def spare_class(self, stmt: Stmt) -> int:
        """The block class of a ``"registry"`` statement's spares: that of the entry it replaces,
        of a list's first entry (appended), or of the child it rebinds."""
        spec = self.children[stmt.child]
        while spec.kind == "shared":
            spec = self.children[spec.blocks[0]]
        return spec.blocks[stmt.entry if stmt.style == "swap" else 0]

    @property
    def cache(self) -> Child | None:
        """The ``"cached"`` child (at most one: its layers index one cache), or None; the root
        then takes a ``cache`` argument."""
        return next((c for c in self.children if c.kind == "cached"), None)


def alias_roots(stmts: tuple[Stmt, ...]) -> list[int]:
    """For each variable (``v0`` the input, ``v<n>`` made by ``stmts[n - 1]``), the first variable
    that may be the same tensor (``F.dropout`` without training returns its input)."""
    roots = [0]
    for stmt in stmts:
        roots.append(roots[stmt.args[0]] if stmt.kind == "dropout" else len(roots))
    return roots


# -- rendering ------------------------------------------------------------------------------------
_PRELUDE = '''\
import collections
import functools
import types

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from corpus import Call, Edit, Entry
from corpus.program_parts import CachedLayer, HParams, Inner, ProgramRoot, Swish, new_cache

#: a module global dict a ``"table"`` read reads an array element of (its script starts by setting it)
TABLES = {"t": np.array([2.0]), "act": torch.tanh}
#: a module global deque a ``"queue"`` read reads an array element of
QUEUE = collections.deque([np.array([2.0])])


def _scaled(x, k=2.0):
    return x * k


#: a module global partial a ``"keyword"`` read calls (its keyword ``k`` is a number a graph bakes in)
SCALED = functools.partial(_scaled, k=2.0)'''


def _inner_call(style: str, x: str, a: str) -> str:
    return {"pos": f"self.inner({x}, {a})", "kw": f"self.inner(p={x}, q={a})", "kw_rev": f"self.inner(q={a}, p={x})",
            "mixed": f"self.inner({x}, q={a})"}[style]


def _block_source(index: int, block: Block) -> str:
    params = "x, a" if block.arity == 2 else "x"
    init = ["super().__init__()", "self.lin = nn.Linear(4, 4)"]
    body = []
    if block.inner is not None:
        init.append("self.inner = Inner()")
        body.append(f"x = {_inner_call(block.inner, 'x', 'a' if block.arity == 2 else 'x')}")
    if block.alpha:
        init.append("self.alpha = 1.5")
    if block.rebinds:
        init.append("self.spare = [nn.Linear(4, 4), nn.Linear(4, 4)]  # (not registered)")
        body += ["if self.spare:", "    self.lin = self.spare.pop()"]
    expression = BODIES[block.arity][block.body]
    body.append(f"return {expression}" + (" * self.alpha" if block.alpha else ""))
    lines = [f"class B{index}(nn.Module):", "    def __init__(self):"]
    lines += [f"        {line}" for line in init]
    lines += ["", f"    def forward(self, {params}):"] + [f"        {line}" for line in body]
    lines += ["", "", f"class B{index}Alt(B{index}):", f"    def forward(self, {params}):",
              f"        return super().forward({params}) * 2.0"]
    return "\n".join(lines)


def _call_args(style: str, arity: int, names: list[str]) -> str:
    if arity == 1:
        return {"pos": names[0], "kw": f"x={names[0]}"}.get(style, names[0])
    x, a = names
    return {"pos": f"{x}, {a}", "kw": f"x={x}, a={a}", "kw_rev": f"a={a}, x={x}", "mixed": f"{x}, a={a}"}[style]


def _arity(program: Program, child: int) -> int:
    spec = program.children[child]
    if spec.kind == "shared":
        return _arity(program, spec.blocks[0])
    return program.blocks[spec.blocks[0]].arity


def _root_source(program: Program) -> tuple[str, bool]:
    init = ["super().__init__()  # the state every program's root has (corpus.program_parts)"]
    for i, child in enumerate(program.children):
        if child.kind == "block":
            init.append(f"self.c{i} = B{child.blocks[0]}()")
        elif child.kind == "list":
            init.append(f"self.c{i} = nn.ModuleList([{', '.join(f'B{b}()' for b in child.blocks)}])")
        elif child.kind == "cached":
            kind = CACHED_KINDS[child.blocks[1]]
            layers = ", ".join(f"CachedLayer({j}, {kind!r})" for j in range(child.blocks[0]))
            init.append(f"self.c{i} = nn.ModuleList([{layers}])")
        else:
            init.append(f"self.c{i} = self.c{child.blocks[0]}  # shared")
    init += [f"self.spares{n} = [B{program.spare_class(stmt)}(), B{program.spare_class(stmt)}()]  # (not registered)"
             for n, stmt in enumerate(program.stmts, start=1) if stmt.kind == "registry"]
    body: list[str] = []
    counter = False
    for n, stmt in enumerate(program.stmts, start=1):
        new, args = f"v{n}", [f"v{i}" for i in stmt.args]
        if stmt.kind in ("call", "nograd"):
            arity = _arity(program, stmt.child)
            call = f"self.c{stmt.child}({_call_args(stmt.style, arity, args[:arity])})"
            if stmt.kind == "nograd":
                body += ["with torch.no_grad():", f"    {new} = {call}"]
            else:
                body.append(f"{new} = {call}")
        elif stmt.kind == "loop":
            arity = _arity(program, stmt.child)
            body.append(f"{new} = {args[0]}")
            step = f"b({new}, {args[1]})" if arity == 2 else f"b({new})"
            body += [f"for b in self.c{stmt.child}:", f"    {new} = {step}"]
        elif stmt.kind == "cached":
            layers = f"reversed(self.c{stmt.child})" if stmt.style == "reversed" else f"self.c{stmt.child}"
            body += [f"{new} = {args[0]}", f"for b in {layers}:", f"    {new} = b({new}, cache)"]
        elif stmt.kind == "read" and stmt.style == "gather":  # a list the root makes, a child fills
            # (summed: a pre-hook that edits the arguments passes gather a new list, in eager code too)
            body += [f"acts{n} = []", f"{new} = self.gather({args[0]}, acts{n}) + sum(acts{n})"]
        elif stmt.kind == "read":
            v = args[0]
            body.append({"alpha": f"{new} = {v} * self.alpha",
                         "hp": f"{new} = {v} * self.hp.scale + self.hp.shift",
                         "nested": f"{new} = {v} + self.hp.inner.bias",
                         "act": f"{new} = self.act({v})",
                         "k": f"{new} = {v} * float(self.k)",
                         "modules": f"{new} = {v} + len(list(self.modules()))",
                         "vector": f"{new} = {v} + self.hp.vector",
                         "outside": f"{new} = self.outside[0]({v})",
                         "array": f"{new} = {v} * float(self.arr[0])",
                         "table": f"{new} = {v} * float(TABLES['t'][0])",
                         "queue": f"{new} = {v} * float(QUEUE[0][0])",
                         "keyword": f"{new} = SCALED({v})"}[stmt.style])
        elif stmt.kind == "buffer":
            body += ["if self.training:", f"    self.running.mul_(0.5).add_({args[0]}.detach().mean(0))",
                     "    self.steps += 1", f"{new} = {args[0]} - self.running"]
        elif stmt.kind == "dropout":
            body.append(f"{new} = F.dropout({args[0]}, 0.25, self.training)")
        elif stmt.kind == "counter":
            counter = True
            body += ["self.calls += 1", f"{new} = {args[0]} * self.calls"]
        elif stmt.kind == "log" and stmt.style == "print":  # output: the harness compares each call's stdout
            body += [f"print('h{n}', {args[0]}.shape[0], round(float({args[0]}.detach().sum()), 3))",
                     f"{new} = {args[0]}"]
        elif stmt.kind == "log":
            made, reach = LOGS[stmt.style]
            init.append(f"self.log{n} = {made}")
            read = f" * len(self.log{n}{reach})" if stmt.style in ("list", "dict") else ""  # (others only write)
            body += [f"self.log{n}{reach}.append({args[0]}.shape[0])", f"{new} = {args[0]}{read}"]
        elif stmt.kind == "add":
            body.append(f"{new} = {args[0]} + {args[1]}")
        elif stmt.kind == "registry":
            target, spare = f"self.c{stmt.child}", f"self.spares{n}.pop()"
            edit, counted = {"grow": (f"{target}.append({spare})", target),
                             "swap": (f"{target}[{stmt.entry}] = {spare}", target),
                             "set": (f"{target} = {spare}", "list(self.children())")}[stmt.style]
            body += [f"if self.spares{n}:", f"    {edit}", f"{new} = {args[0]} * len({counted})"]
        else:
            raise ValueError(stmt.kind)
    kind, outs = program.output
    names = [f"v{i}" for i in outs]
    body.append({"one": f"return {names[0]}", "tuple": f"return ({', '.join(names)},)",
                 "dict": "return {" + ", ".join(f'"out{i}": {name}' for i, name in enumerate(names)) + "}"}[kind])
    lines = ["class Root(ProgramRoot):", "    def __init__(self):"] + [f"        {line}" for line in init]
    params = "v0, cache" if program.cache is not None else "v0"
    lines += ["", f"    def forward(self, {params}):"] + [f"        {line}" for line in body]
    return "\n".join(lines), counter


def _edit_source(program: Program, step: Step, doubled: bool) -> str:
    child = program.children[step.child] if program.children else None
    target = f"m.c{step.child}"
    if child is not None and child.kind == "list":
        target = f"m.c{step.child}[{step.entry}]"
    value = repr(step.value)
    if step.kind == "direct":  # (a single block: its output is kept and compared)
        ones = f"torch.ones(2, 4{', dtype=torch.float64' if doubled else ''})"
        return f"m.seen = {target}({', '.join([ones] * _arity(program, step.child))}).detach()"
    return {"root_alpha": f"m.alpha = {value}",
            "block_alpha": f"{target}.alpha = {value}",
            "swap_child": f"{target} = B{step.block}()" + (".double()" if doubled else ""),
            "swap_class": f"{target}.__class__ = B{step.block}Alt",
            "double": "m.double()",
            "hp_attr": f"m.hp.scale = {value}",
            "hp_replace": f"m.hp = HParams(scale={value})",
            "nested_attr": f"m.hp.inner.bias = {value}",
            "act_attr": f"m.act.beta = {value}",
            "act_replace": f"m.act = Swish({value})",
            "k_replace": f"m.k = np.float32({value})",
            "vector_write": f"m.hp.vector.mul_({value})",
            "vector_replace": f"m.hp.vector = torch.full((4,), {value})",
            "outside_write": f"m.outside[0].weight.mul_({value})",
            "outside_replace": f"m.outside[0] = nn.Linear(4, 4).requires_grad_(False)",
            "array_write": f"m.arr[0] = {value}",
            "table_write": f"TABLES['t'][0] = {value}",
            "queue_write": f"QUEUE[0][0] = {value}",
            "keyword_write": f"SCALED.keywords['k'] = {value}"}[step.kind]


#: sets the module globals of :data:`GLOBAL_READS` back to their first values
_GLOBALS_RESET = """def reset_globals(m):
    TABLES['t'][0] = 2.0
    QUEUE[0][0] = 2.0
    SCALED.keywords['k'] = 2.0"""


def render(program: Program, name: str | None = None, doc: str = "") -> str:
    """The Python source of ``program``: its classes, edits and an ``ENTRIES`` list of one corpus
    :class:`~corpus.Entry` named ``name`` (default :meth:`Program.name`); ``doc`` opens the
    module's docstring."""
    name = name or program.name()
    header = f"{name}: {doc}" if doc else f"{name}: a program generated by tests/corpus/test_fuzz.py."
    parts = [f'"""{header}\n\n{program!r}\n"""', _PRELUDE]
    parts += [_block_source(i, block) for i, block in enumerate(program.blocks)]
    root, counter = _root_source(program)
    parts.append(root)
    edits, script = [], []
    if any(stmt.kind == "read" and stmt.style in GLOBAL_READS for stmt in program.stmts):
        # (each run starts from the same globals: the eager run's edits wrote them before)
        edits.append(_GLOBALS_RESET)
        script.append("Edit(reset_globals)")
    dtype = ""
    for step in program.script:
        if step.kind == "call":
            grad = ", requires_grad=True" if step.input_grad and step.grad else ""
            tensor = f"torch.randn({step.rows}, 4{', dtype=torch.float64' if dtype else ''}{grad})"
            inputs = f"{tensor}, cache" if program.cache is not None else f"{tensor},"
            script.append(f"Call(({inputs})" + ("" if step.grad else ", grad=False") + ")")
        else:
            index = len(edits)
            edits.append(f"def edit{index}(m):\n    {_edit_source(program, step, bool(dtype))}")
            script.append(f"Edit(edit{index})")
            dtype = dtype or ("double" if step.kind == "double" else "")
    parts += edits
    cache = program.cache
    opening = "" if cache is None else f"    cache = new_cache({cache.blocks[0]}, sliding={bool(cache.blocks[2])})\n"
    parts.append("def script():\n" + opening + "    return [\n" + "".join(f"        {s},\n" for s in script) + "    ]")
    watched = ["m.calls"] * counter + ["m.__dict__.get('seen')"] * any(s.kind == "direct" for s in program.script)
    watched += [f"list(m.log{n}{LOGS[s.style][1]})" for n, s in enumerate(program.stmts, start=1)
                if s.kind == "log" and s.style != "print"]
    attrs = f", attrs=lambda m: {watched[0]}" if len(watched) == 1 else \
        f", attrs=lambda m: ({', '.join(watched)})" if watched else ""
    parts.append(f"ENTRIES = [Entry({name!r}, Root, script, item=48, modes={program.modes!r}{attrs})]")
    return "\n\n\n".join(parts) + "\n"


def load(source: str, directory: Path) -> ModuleType:
    """Import ``source`` from a file of ``directory`` named by its hash (the same program is one
    file, imported once per process)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    name = f"nnbridge_fuzz_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    path = directory / f"{name}.py"
    if not path.exists():
        path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
