"""The ``nnbridge::sibling_zeros`` torch custom op, registered when this module is imported.

Its one job: zeros that ``torch.export`` records as depending on every tensor of a list, in one
graph node. Layer reuse's sibling stubs (:mod:`nnbridge.extract.sibling_stubs`) and stubbed
modules (:func:`nnbridge.extract.recording.stub_output`) call it while exporting; a saved program
that calls it loads only once this module is imported. Example::

    sibling_zeros([x, mask], [x.shape[0], 4], torch.float32)
"""

from __future__ import annotations

from typing import Any

import torch


@torch.library.custom_op("nnbridge::sibling_zeros", mutates_args=())
def sibling_zeros(inputs: list[torch.Tensor], size: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Zeros of ``size`` (ints or symbolic sizes) and ``dtype`` on ``inputs[0]``'s device that
    export records as depending on every tensor of ``inputs``: one graph node, where
    ``new_zeros`` plus ``0 * t.sum()`` for each input would take three per input, which a deep
    model's many sibling stubs make a large share of its export (see
    :func:`~nnbridge.extract.sibling_stubs.sibling_stub`). Only sibling stubs and stubbed modules
    (:func:`~nnbridge.extract.recording.stub_output`) call it, while exporting; their graphs
    are replaced by their representative's or by opaque modules, so it never runs in a graph
    nnbridge calls. Gradients: none (``None`` for every input)."""
    return inputs[0].new_zeros(size, dtype=dtype)


@sibling_zeros.register_fake
def _sibling_zeros_fake(inputs: list[torch.Tensor], size: list[int], dtype: torch.dtype) -> torch.Tensor:
    return inputs[0].new_zeros(size, dtype=dtype)


def _sibling_zeros_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.inputs = len(inputs[0])


def _sibling_zeros_backward(ctx: Any, grad: torch.Tensor) -> tuple[list[None], None, None]:
    return [None] * ctx.inputs, None, None


sibling_zeros.register_autograd(_sibling_zeros_backward, setup_context=_sibling_zeros_context)
