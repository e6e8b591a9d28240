"""The live registries of an ``nn.Module`` (private attributes, torch 1.x - 2.13).

``parameters_of(m)``, ``buffers_of(m)`` and ``modules_of(m)`` return ``m._parameters``,
``m._buffers`` and ``m._modules`` themselves (not copies): nnbridge reads them without
``__getattr__``'s cost and edits them to swap children, rename reserved names and put state back.
"""

from __future__ import annotations

import torch


#: the keys of a fresh ``nn.Module``'s ``__dict__``: torch's own slots (``_parameters``, ``_modules``,
#: the hook dicts, ``training``...), which no forward reads as attributes of its own
MODULE_SLOTS = frozenset(vars(torch.nn.Module()))


def parameters_of(module: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    """``module._parameters``: name -> Parameter or None, the live dict."""
    return module._parameters


def buffers_of(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """``module._buffers``: name -> Tensor or None, the live dict."""
    return module._buffers


def modules_of(module: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    """``module._modules``: name -> child module or None, the live dict."""
    return module._modules


def clear_modules(module: torch.nn.Module) -> None:
    """Give ``module`` a new, empty ``_modules`` dict (the old one, which another module may share
    after a shallow copy, is left as it was)."""
    module.__dict__["_modules"] = {}


def non_persistent_buffers_of(module: torch.nn.Module) -> set[str]:
    """``module._non_persistent_buffers_set``: names of buffers left out of ``state_dict``."""
    return getattr(module, "_non_persistent_buffers_set", set())
