"""Reads of grad mode by the code of one eager run (torch 2.0 - 2.15).

A graph replays tensor operations; the Python code around them ran once, under the grad mode of
the extracted call. Code that branches on grad mode keeps, in its graph, the branch it took then.
Such code reads grad mode in one of two ways:

- it calls ``torch.is_grad_enabled()`` (``nn.MultiheadAttention`` chooses its native fast path so;
  transformers' gradient checkpointing asks it);
- it reads a tensor's ``requires_grad``, ``grad_fn`` or ``is_leaf``, which for a tensor computed in
  the call depend on grad mode.

:func:`grad_mode_reads` reports both from the interpreter's profiling events
(``sys.setprofile``), patching nothing: a call of ``torch.is_grad_enabled`` is a ``c_call`` event
(found by identity, whatever name the code calls it by), and each Python function entered outside
torch's own package is checked once for those attribute names (a function naming them counts
whether or not the line ran: conservative). Not counted: torch's own grad-mode context managers
(``torch.no_grad()``, ``torch.set_grad_enabled``), which read the mode only to put it back, and
nnbridge's own code.

The same events report two more things a graph cannot keep: code outside torch naming a tensor's
``grad``, ``grad_fn`` or ``is_leaf``, or its hooks (``register_hook``, ``retain_grad``): autograd
state no call structure records and no graph registers; and calls that set a ``torch.Generator``'s
state (``torch.manual_seed``, ``torch.set_rng_state``); and reads of process-wide state a graph
keeps as it was read: calls of :data:`STATE_QUERIES` (``torch.get_num_threads()``), and of torch's
built-in flag getters (:func:`_flag_read`: ``torch.is_anomaly_enabled()``,
``torch.backends.cudnn.enabled``); code outside torch naming where a tensor lies in memory
(:data:`STORAGE_ATTRIBUTES`: ``x.storage_offset()``); and output (:mod:`nnbridge.compat.output`).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..output import OutputWatch
from .self_dispatch import replaced_dispatch


def _prefixes(*paths: Path, folder: bool) -> tuple[str, ...]:
    """Each path as imported and resolved (a folder's with a trailing separator)."""
    return tuple({str(p) + (os.sep if folder else "") for path in paths for p in (path, path.resolve())})


#: Attribute names whose values, for a tensor computed under the call, depend on grad mode.
GRAD_ATTRIBUTES = frozenset({"requires_grad", "grad_fn", "is_leaf"})
#: Names of autograd state that no call structure records and a graph does not repeat: a
#: parameter's ``grad`` (None until a backward), whether an argument is a leaf (``grad_fn``,
#: ``is_leaf``), and a tensor's hooks (``register_hook``, ``retain_grad``: export registers none, so
#: a gradient hook set in forward would never run).
AUTOGRAD_ATTRIBUTES = frozenset({"grad", "grad_fn", "is_leaf", "retains_grad", "register_hook", "retain_grad",
                                 "register_post_accumulate_grad_hook"})
#: Names of where a tensor lies in memory, which no call structure records (it holds shapes,
#: strides, dtypes, devices and which inputs alias): a view's ``storage_offset()``, its storage
#: (``untyped_storage``, ``data_ptr``, ``is_shared``) and its version counter (``_version``).
STORAGE_ATTRIBUTES = frozenset({"storage_offset", "untyped_storage", "data_ptr", "is_shared", "_version"})
#: Methods of ``torch.Generator`` that set its state (``torch.manual_seed`` and
#: ``torch.set_rng_state`` call them on the default generator).
SEEDING_METHODS = frozenset({"manual_seed", "seed", "set_state", "set_offset", "graphsafe_set_state"})
#: torch functions returning process-wide state that no call structure records (the call structure
#: holds grad mode, autocast, the default dtype, inference mode and deterministic algorithms).
STATE_QUERIES = (torch.get_num_threads, torch.get_num_interop_threads, torch.initial_seed,
                 torch.get_float32_matmul_precision)
# (by id: a ``c_call`` event's function may be a method of an unhashable object)
_QUERY_BUILTINS = frozenset(id(f) for f in STATE_QUERIES if not isinstance(f, types.FunctionType))
_QUERY_CODES = frozenset(f.__code__ for f in STATE_QUERIES if isinstance(f, types.FunctionType))
#: The names of torch's built-in getters of process-wide flags: ``torch.is_anomaly_enabled``, and
#: ``torch._C._get_cudnn_enabled`` behind ``torch.backends.cudnn.enabled``,
#: ``torch._C._get_cublas_allow_tf32`` behind ``torch.backends.cuda.matmul.allow_tf32``: every
#: module-level built-in of ``torch._C`` named so is one.
_GETTER = re.compile(r"_?(is|are|get)_")
#: Of those, the ones whose state the call structure records (grad mode: its own rule, see the
#: module docstring; autocast, the default dtype, inference mode, deterministic algorithms: see
#: :func:`nnbridge.guards.call_structure.structure_key`).
_RECORDED = re.compile(r"grad_enabled|autocast|default_dtype|inference_mode|deterministic")
#: Where a torch function that answers a flag for its caller lives, by its code's name or file:
#: ``torch.get_float32_matmul_precision``, the properties of ``torch.backends``.
_ANSWERS = re.compile(r"_?(is|are|get)_|__get__$|__getattr__$")
_BACKENDS = _prefixes(Path(torch.backends.__file__).parent, folder=True)


#: Where a call of ``torch.is_grad_enabled`` is no branch on grad mode: torch's grad-mode context
#: managers (they read the mode to put it back) and nnbridge's own package.
_CALLS_NOT_COUNTED = (*_prefixes(Path(torch.autograd.grad_mode.__file__), folder=False),
                      *_prefixes(Path(__file__).parents[2], folder=True))
#: Where naming ``requires_grad``, ``grad_fn`` or ``is_leaf`` is not counted: torch's own package,
#: whose forward code asks ``torch.is_grad_enabled()`` where it branches on them
#: (``nn.MultiheadAttention``'s fast path) and otherwise reads them in its hook and copy machinery
#: (``nn.Module.__call__`` with hooks, ``Tensor.__deepcopy__``), and nnbridge's own package.
#: nnbridge's own package, whose output (its warnings are its reports) is not the forward's.
_OWN = _prefixes(Path(__file__).parents[2], folder=True)
_NAMES_NOT_COUNTED = _prefixes(Path(torch.__file__).parent, Path(__file__).parents[2], folder=True)


def _outside(code: types.CodeType, prefixes: tuple[str, ...], verdicts: dict[types.CodeType, bool]) -> bool:
    verdict = verdicts.get(code)
    if verdict is None:
        verdict = verdicts[code] = not code.co_filename.startswith(prefixes)
    return verdict


def _flag_read(frame: types.FrameType, getter: Any) -> bool:
    """Whether the call of ``getter`` (a built-in of ``torch._C``) in ``frame`` reads, for code
    outside torch and nnbridge, a process-wide flag the call structure does not record: the code
    calls the getter (``torch.is_anomaly_enabled()``), or calls a torch function or reads a torch
    property that answers with it (``torch.backends.cudnn.enabled``); not when torch's own code
    asks (``F.batch_norm`` reads ``cudnn.enabled`` to choose a kernel, equal in a graph's replay)."""
    name = getter.__name__
    if not _GETTER.match(name) or _RECORDED.search(name):
        return False
    code = frame.f_code
    if not code.co_filename.startswith(_NAMES_NOT_COUNTED):
        return True
    caller = frame.f_back
    return (caller is not None and (code.co_filename.startswith(_BACKENDS) or bool(_ANSWERS.match(code.co_name)))
            and not caller.f_code.co_filename.startswith(_NAMES_NOT_COUNTED))


@contextlib.contextmanager
def grad_mode_reads(on_read: Callable[[], None], *, on_unwatched: Callable[[], None],
                    on_autograd: Callable[[], None] = lambda: None,
                    on_seeding: Callable[[], None] = lambda: None,
                    on_query: Callable[[], None] = lambda: None,
                    on_output: Callable[[], None] = lambda: None,
                    on_storage: Callable[[], None] = lambda: None,
                    on_replaced: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Call ``on_read()`` each time code run in the body, in the thread that entered it, reads
    grad mode (see the module docstring): a call of ``torch.is_grad_enabled``, or the entry into a
    function outside torch whose code names ``requires_grad``, ``grad_fn`` or ``is_leaf``.

    Also, from the same events: ``on_autograd()`` on the entry into a function outside torch whose
    code names one of :data:`AUTOGRAD_ATTRIBUTES` (a graph keeps what they were while it was
    exported, and registers no tensor hook), and ``on_seeding()`` on each call of a
    ``torch.Generator`` method that sets its state (:data:`SEEDING_METHODS`, ``torch.manual_seed``
    included: a graph draws from the generator without setting it), and ``on_query()`` on each call
    of one of :data:`STATE_QUERIES` and each flag read (:func:`_flag_read`), and ``on_output()``
    on each print, stream write, shown warning or handled log record of code outside nnbridge
    (:class:`~nnbridge.compat.output.OutputWatch`: a graph would not repeat it), and
    ``on_storage()`` on the entry into a function outside torch whose code names one of
    :data:`STORAGE_ATTRIBUTES`, and ``on_replaced()`` on the entry into a torch function whose
    module's global of its name holds a replacement (:mod:`.self_dispatch`: export would trace the
    replacement once per torch-function mode).

    When another profile function is set in this thread (``cProfile``, a debugger), it is left in
    place, nothing is watched, and ``on_unwatched()`` is called once on entry."""
    if sys.getprofile() is not None:
        on_unwatched()
        yield
        return
    calls: dict[types.CodeType, bool] = {}
    names: dict[types.CodeType, tuple[bool, bool, bool]] = {}
    output = OutputWatch(_OWN)

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if output.wrote(frame, event, arg):
            on_output()
        if event == "c_call":
            if arg is torch.is_grad_enabled and _outside(frame.f_code, _CALLS_NOT_COUNTED, calls):
                on_read()
            elif isinstance(getattr(arg, "__self__", None), torch.Generator) and arg.__name__ in SEEDING_METHODS:
                on_seeding()
            elif id(arg) in _QUERY_BUILTINS or (getattr(arg, "__self__", None) is torch._C and _flag_read(frame, arg)):
                on_query()
        elif event == "call":
            code = frame.f_code
            if code in _QUERY_CODES:
                on_query()
            if replaced_dispatch(frame) is not None:
                on_replaced()
            named = names.get(code)
            if named is None:
                counted = not code.co_filename.startswith(_NAMES_NOT_COUNTED)
                named = names[code] = (counted and not GRAD_ATTRIBUTES.isdisjoint(code.co_names),
                                       counted and not AUTOGRAD_ATTRIBUTES.isdisjoint(code.co_names),
                                       counted and not STORAGE_ATTRIBUTES.isdisjoint(code.co_names))
            if named[0]:
                on_read()
            if named[1]:
                on_autograd()
            if named[2]:
                on_storage()

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)
