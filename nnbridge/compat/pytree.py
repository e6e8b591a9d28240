"""torch's pytree utilities (private modules ``torch.utils._pytree`` and ``torch.fx._pytree``,
torch 2.0 - 2.13): flattening call arguments and outputs the way torch.export does, so specs
compare equal to the ones export records.

Usage: ``from nnbridge.compat.pytree import pytree, fx_pytree``.
"""

from __future__ import annotations

from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

__all__ = ["fx_pytree", "pytree"]
