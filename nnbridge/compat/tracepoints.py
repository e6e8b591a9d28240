"""Let a module called with a string argument keep its own graph (torch 2.13 ``torch.export``).

``torch.export`` brackets every module whose call signature it preserves with the
``_export_tracepoint`` higher-order op, passing the call's flattened arguments through it.
``torch._export.wrappers`` accepts ``str`` leaves there (``check_flattened``), but the proxy
tracer's ``extract_val`` (``torch.fx.experimental.proxy_tensor``), which records each output's
example value, knows tensors, symbolic and plain numbers and ``None`` only, and fails with
``AssertionError: Expected code to be unreachable, but got: 'sliding_attention'``. Gemma 3's
``Gemma3RotaryEmbedding.forward(x, position_ids, layer_type)`` is such a module; without this shim
the export of its caller fails and nnbridge fell back to running the caller (``Gemma3TextModel``)
eagerly.

A string is a constant of the traced call (the graph is specialized to it, like every non-tensor
argument, and nnbridge's call-structure guards check it on each call), so its recorded example
value is the string itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.fx.experimental import proxy_tensor


@contextlib.contextmanager
def string_arguments_traced() -> Iterator[None]:
    """While the body runs, ``proxy_tensor.extract_val`` returns ``str`` values unchanged (torch
    2.13 raises ``AssertionError`` on them); restored afterwards, also on error."""
    original = proxy_tensor.extract_val

    def extract_val(val: Any, include_real: bool = False) -> Any:
        if isinstance(val, str):
            return val
        return original(val, include_real)

    proxy_tensor.extract_val = extract_val
    try:
        yield
    finally:
        proxy_tensor.extract_val = original
