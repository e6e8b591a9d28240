"""Which attention implementation a transformers model runs.

transformers keeps it in the private ``config._attn_implementation`` (``"eager"``, ``"sdpa"``,
``"flash_attention_2"``, ``"flex_attention"``...; set by ``from_pretrained(...,
attn_implementation=...)`` or ``model.set_attn_implementation(...)``). Only the eager one computes
attention as separate ops (``softmax``, the ``matmul`` of queries with keys, the ``dropout`` of the
weights); the others call one fused function.
"""

from __future__ import annotations


def attention_implementation(model: object) -> str | None:
    """``model``'s attention implementation (``model.config._attn_implementation``), or None for a
    model without a transformers config."""
    config = getattr(model, "config", None)
    value = getattr(config, "_attn_implementation", None) if config is not None else None
    return value if isinstance(value, str) else None
