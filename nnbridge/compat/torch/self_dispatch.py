"""torch functions that hand themselves to ``__torch_function__`` by their global name (torch 2.0 - 2.15).

A Python function of ``torch.nn.functional`` (``F.softmax``, ``F.silu``, ``F.layer_norm``) or of
``torch.functional`` (``torch.norm``) begins ``if has_torch_function(...): return
handle_torch_function(softmax, ...)``, naming itself by the global its module holds. When that
global holds a replacement (``F.softmax = recording_softmax``, a wrapper that calls the original)
and a torch-function mode is active, as whenever torch.export traces, the original hands the
*replacement* to each mode, which calls it again: the wrapper's own ops are traced once per mode
(``torch.export.export`` of ``softmax(x) * 1.5`` records the ``mul`` 15 times, strict 11), while
eager runs them once. A graph of such code would compute other numbers.

:func:`replaced_dispatch` tells, from the frame a call enters, whether it is such a function
while its module's global of its name holds something else.
"""

from __future__ import annotations

import types
from pathlib import Path

import torch.functional
import torch.nn.functional

_FILES = frozenset(str(p) for module in (torch.nn.functional, torch.functional)
                   for p in (Path(str(module.__file__)), Path(str(module.__file__)).resolve()))
_DISPATCHING: dict[types.CodeType, bool] = {}


def replaced_dispatch(frame: types.FrameType) -> str | None:
    """``"torch.nn.functional.softmax"`` when ``frame`` runs a function of torch's functional
    modules that passes itself to ``handle_torch_function`` by its global name, and that global
    holds another function now (a replacement, which calls it); None else."""
    code = frame.f_code
    dispatching = _DISPATCHING.get(code)
    if dispatching is None:
        dispatching = _DISPATCHING[code] = (code.co_filename in _FILES and code.co_name in code.co_names
                                            and "handle_torch_function" in code.co_names)
    if not dispatching:
        return None
    held = frame.f_globals.get(code.co_name)
    if getattr(held, "__code__", None) is code:
        return None
    return f"{frame.f_globals.get('__name__')}.{code.co_name}"
