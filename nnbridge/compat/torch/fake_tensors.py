"""Export without the fake-tensor dispatch cache; a module run on fake tensors (:func:`fake_call`);
code run on an export's fake tensors without recording nodes (:func:`untraced`).

``FakeTensorMode`` (torch 2.13) caches each op's output metadata, keyed by the op and its
arguments' metadata, symbolic sizes included; each export makes a new shape environment, so keys
with symbolic sizes rarely recur, and making an entry costs more than the dispatch it would save
(the entry's output is rebuilt from it to validate it). Counted with ``FakeTensorMode.cache_hits``
and ``cache_misses``: ``bridge()`` of SmolLM2-135M 331 hits, 261 misses; the 30 per-layer exports
of a new call structure under an eagerly run ``LlamaModel`` (``output_attentions=True``) 1,576
hits, 6,233 misses. The cache only saves work; fake outputs are computed the same way without it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch

from .. import registry


@contextlib.contextmanager
def fake_tensor_cache_off() -> Iterator[None]:
    """For the body's duration, fake-tensor modes created (export's) do not cache dispatches
    (``torch._dynamo.config.fake_tensor_cache_enabled``, a process-wide setting, restored
    afterwards, also on error; extraction holds nnbridge's lock meanwhile)."""
    config = importlib.import_module("torch._dynamo.config")
    with registry.applied("fake_tensor_cache_off") as applying:
        with config.patch(fake_tensor_cache_enabled=False) if applying else contextlib.nullcontext():  # registry: fake_tensor_cache_off
            yield


def fake_call(module: torch.nn.Module, specs: list[tuple[torch.Size, torch.dtype, torch.device]]) -> Any:
    """``module(*inputs)`` on fake tensors (no data, nothing computed) of the given
    ``(sizes, dtype, device)``, under a new ``torch._subclasses.FakeTensorMode`` that takes the
    module's real parameters and buffers as constants (``allow_non_fake_inputs``); returns the
    output (fake tensors carry the output's sizes, dtype and device).

    Raises:
        Exception: whatever the module raises for such inputs (a size mismatch, say).
    """
    mode = importlib.import_module("torch._subclasses.fake_tensor").FakeTensorMode(allow_non_fake_inputs=True)
    with mode, torch.no_grad():
        inputs = [torch.empty(size, dtype=dtype, device=device) for size, dtype, device in specs]
        return module(*inputs)


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """While the body runs inside a ``torch.export`` trace, ops on its (fake) tensors compute their
    outputs without recording graph nodes (``proxy_tensor.disable_proxy_modes_tracing``): what the
    body makes is not in the graph, and an op of the trace that takes it afterwards raises. Outside
    a trace the body runs as it is."""
    from torch.fx.experimental import proxy_tensor
    with proxy_tensor.disable_proxy_modes_tracing():
        yield
