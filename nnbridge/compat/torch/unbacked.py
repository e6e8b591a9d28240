"""Skip export's unbacked-binding pass when the trace made no unbacked symbol.

torch 2.13's ``torch.export._trace._replace_unbacked_bindings`` recomputes, for every node of the
traced program, which unbacked symbols (sizes only known at run time, such as ``nonzero``'s) its
example value binds: it drops each node's ``unbacked_bindings`` and walks every size, stride and
storage offset of every example value looking for the shape environment's unbacked symbols. When
the environment has none, that walk can bind nothing: ``_free_unbacked_symbols_with_path`` records
a symbol only when it is in the pending set, which is then empty. The pass then only drops the
nodes' ``unbacked_bindings``, which :func:`unbacked_bindings_pass_narrowed` does without the walk.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

from .. import registry


@contextlib.contextmanager
def unbacked_bindings_pass_narrowed() -> Iterator[None]:
    """For the body's duration, export's ``_replace_unbacked_bindings`` only removes the nodes'
    ``unbacked_bindings`` when the program's shape environment has no unbacked symbol (the result
    torch's own pass gives then, see the module docstring); otherwise torch's pass runs. Restored
    afterwards, also on error."""
    trace = importlib.import_module("torch.export._trace")
    utils = importlib.import_module("torch._export.utils")
    symbols = importlib.import_module("torch.utils._sympy.symbol")
    original = trace._replace_unbacked_bindings

    def replace(gm: Any) -> None:
        shape_env = utils._get_shape_env_from_gm(gm)
        unbacked = (symbols.SymT.UNBACKED_INT, symbols.SymT.UNBACKED_FLOAT)
        if shape_env is None or any(symbols.symbol_is_type(symbol, unbacked) and symbol not in shape_env.unbacked_renamings
                                    for symbol in shape_env.var_to_range):
            original(gm)
            return
        for node in gm.graph.nodes:
            node.meta.pop("unbacked_bindings", None)

    with registry.replaced("unbacked_bindings", trace, "_replace_unbacked_bindings", value=replace):
        yield
