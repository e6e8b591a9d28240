"""transformers' sdpa attention masks, which transformers builds differently when traced.

transformers 5.x (``transformers.masking_utils``, verified on 5.23 and 5.24) skips building the
attention mask in eager code when SDPA's ``is_causal`` can stand for it (no padding, a full causal or
bidirectional mask): ``sdpa_mask`` returns None and the attention function gets
``attention_mask=None``. Under tracing (``torch.export``, which extraction uses) the skip is never
taken, as the padding mask's values cannot be read: the graph builds the explicit mask and passes
it. transformers' own ``sdpa_attention_forward`` then computes the same numbers either way (it
derives ``is_causal`` from ``attention_mask is None``; nnbridge's tests compare it with
``torch.equal``), but an attention function registered in its place (``ALL_ATTENTION_FUNCTIONS``)
may not: one that ignores ``is_causal`` attends causally in the graph and to every position in
eager.

:func:`mask_skips` notices the skips during an eager run; :func:`replaced_sdpa_functions` names
the attention functions for which a skip changes what a graph would receive.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import registry

try:  # transformers >= 5.0
    from transformers import masking_utils as _masks
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as _STOCK_SDPA
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as _ATTENTION
except ImportError:  # pragma: no cover - older transformers, or none
    _masks = None  # type: ignore[assignment]
    _STOCK_SDPA = None  # type: ignore[assignment]
    _ATTENTION = None  # type: ignore[assignment]

#: The mask helpers whose True means "no mask built in eager" (names in ``transformers.masking_utils``).
_SKIP_HELPERS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


@contextlib.contextmanager
def mask_skips(on_skip: Callable[[], None]) -> Iterator[None]:
    """Call ``on_skip()`` each time transformers' sdpa mask builder skips building a mask in the
    body (it returns None, leaving causality to ``is_causal``). transformers' helpers are put back
    on exit, also on error. Does nothing without transformers' ``masking_utils``.
    """
    if _masks is None or not all(hasattr(_masks, name) for name in _SKIP_HELPERS):
        yield
        return
    originals = {name: getattr(_masks, name) for name in _SKIP_HELPERS}

    def noticing(helper: Callable[..., Any]) -> Callable[..., Any]:
        def skips(*args: Any, **kwargs: Any) -> Any:
            result = helper(*args, **kwargs)
            if not isinstance(result, torch.Tensor) or not _traced(result):
                if bool(result):
                    on_skip()
            return result
        return skips
    with contextlib.ExitStack() as stack:
        for name, helper in originals.items():
            stack.enter_context(registry.replaced("mask_skips", _masks, name, value=noticing(helper)))
        yield


def _traced(value: torch.Tensor) -> bool:
    return _masks is not None and bool(_masks.is_tracing(value))


def replaced_sdpa_functions(module: torch.nn.Module) -> dict[str, str]:
    """``{attention implementation: qualified function name}`` for each implementation named by a
    config in ``module``'s tree (``config._attn_implementation``) whose mask transformers builds
    with a builder that may skip the mask (any but ``eager_mask``; names without a mask builder
    get no mask, traced or not) and whose attention function is not transformers' own
    ``sdpa_attention_forward``. {} without transformers."""
    if _masks is None or _ATTENTION is None:
        return {}
    builders = _masks.ALL_MASK_ATTENTION_FUNCTIONS
    found: dict[str, str] = {}
    for sub in module.modules():
        implementation = getattr(getattr(sub, "config", None), "_attn_implementation", None)
        if not isinstance(implementation, str) or implementation in found:
            continue
        builder = builders.get(implementation) if implementation in builders._global_mapping else None
        if builder is None or builder is _masks.eager_mask:
            continue
        function = _ATTENTION.get(implementation)
        if function is not _STOCK_SDPA:
            found[implementation] = (f"{getattr(function, '__module__', '?')}."
                                     f"{getattr(function, '__qualname__', repr(function))}")
    return found
