"""Whether an export made with layer reuse kept the siblings interchangeable.

Its one job: :func:`check_reused_export`, run on the program exported with sibling stubs (see
:mod:`.reuse_plan`, :mod:`.sibling_stubs`) before any sibling's graph is built from its
representative's: a stubbed or state-threading module in a representative's or sibling's
subtree, or a sibling whose preserved call signature is not its representative's, makes
extraction start again without reuse (:class:`~.reuse_plan.ReuseFallback`). Example::

    check_reused_export(plan, exported, stubs, states=states)
"""

from __future__ import annotations

from typing import Any

import torch

from ..compat.torch.pytree import pytree
from .cache_narrowing import narrowed_spec
from .reuse_plan import ReuseFallback, ReusePlan


def check_reused_export(plan: ReusePlan, exported: torch.export.ExportedProgram, stubs: dict[str, str], *,
                        states: dict[str, list[list[Any]]]) -> None:
    """Raise :class:`~.reuse_plan.ReuseFallback` unless the export kept the siblings
    interchangeable: no module of a representative's or sibling's subtree was stubbed or threads
    state, and every sibling's preserved call signature has its representative's input and output
    structure."""
    for fqn in stubs:
        if plan.covers(fqn):
            raise ReuseFallback(f"'{fqn}' is opaque")
    for fqn, keys in states.items():
        sibling = next((s for s in plan.siblings if fqn == s or fqn.startswith(f"{s}.")), None)
        if plan.covers(fqn) and any(keys) and (sibling is None or sibling not in plan.caches) \
                and not any(fqn == r or fqn.startswith(f"{r}.") for r in
                            {plan.siblings[s] for s in plan.caches}):
            raise ReuseFallback(f"'{fqn}' threads state")
    signatures = {entry.fqn: entry.signature for entry in exported.module_call_graph}
    for sibling, rep in plan.siblings.items():
        mine, theirs = signatures.get(f"model.{sibling}"), signatures.get(f"model.{rep}")
        if mine is None or theirs is None:
            raise ReuseFallback(f"'{sibling}' has another call signature than '{rep}'")
        in_spec, out_spec, rep_out_spec = mine.in_spec, mine.out_spec, theirs.out_spec
        rebinding = plan.caches.get(sibling)
        if rebinding is not None:  # the cache differs in its other layers; outputs: (output, [new states])
            stand_in = narrowed_spec(rebinding.spec, rebinding.index)  # see .cache_narrowing
            if stand_in is not None:
                in_spec = _substituted(in_spec, stand_in, rebinding.rep_spec)
            in_spec = _substituted(in_spec, rebinding.spec, rebinding.rep_spec)
            if out_spec.num_children != 2 or rep_out_spec.num_children != 2 \
                    or out_spec.children()[1].num_children != rep_out_spec.children()[1].num_children:
                raise ReuseFallback(f"'{sibling}' has another call signature than '{rep}'")
            out_spec, rep_out_spec = out_spec.children()[0], rep_out_spec.children()[0]
        if in_spec != theirs.in_spec or out_spec != rep_out_spec:
            raise ReuseFallback(f"'{sibling}' has another call signature than '{rep}'")


def _substituted(spec: Any, old: Any, new: Any) -> Any:
    """``spec`` with every subtree equal to ``old`` replaced by ``new``."""
    if spec == old:
        return new
    if spec.is_leaf():
        return spec
    return pytree.TreeSpec(spec.type, spec.context, [_substituted(c, old, new) for c in spec.children()])
