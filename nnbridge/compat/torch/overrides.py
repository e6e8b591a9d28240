"""What of a call eager PyTorch would hand to ``__torch_function__`` that graph code does not.

Graph code calls aten operators (``torch.ops.aten.linear.default``); eager code calls the public
functions (``F.linear``), which first offer the call to every active ``TorchFunctionMode`` and to
the ``__torch_function__`` of tensor subclasses among their arguments. A mode or subclass that
changes a result (scales, rounds, logs and substitutes) therefore changes eager's numbers and not
the graph's: found as a silent difference. Dispatch-level subclasses and modes
(``__torch_dispatch__``, ``FakeTensorMode``, ``FlopCounterMode``) act below both paths and are
not checked.

Torch's own ``torch.device(...)`` context (a ``DeviceContext`` mode that only fills in the
``device`` of factory functions) is not reported: graph code passes devices explicitly.

Example::

    function_override([x.as_subclass(Scaled)])
    # "argument tensor 0 is a Scaled, a torch.Tensor subclass with its own __torch_function__"
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.overrides import _get_current_function_mode_stack, has_torch_function
from torch.utils._device import DeviceContext

#: the function behind ``torch.Tensor.__torch_function__`` (a classmethod): a subclass that keeps it
#: computes as a plain tensor does (its results are re-wrapped in the subclass, values unchanged)
_TENSOR_FUNCTION = torch.Tensor.__torch_function__.__func__  # type: ignore[attr-defined]
_DISABLED = torch._C._disabled_torch_function_impl


def overrides_torch_function(kind: type) -> bool:
    """Whether tensors of class ``kind`` run a ``__torch_function__`` of their own (neither
    ``torch.Tensor``'s nor the disabled one of ``nn.Parameter``)."""
    function = getattr(kind, "__torch_function__", None)
    function = getattr(function, "__func__", function)
    return function is not _TENSOR_FUNCTION and function is not _DISABLED


def function_override(tensors: Sequence[torch.Tensor]) -> str | None:
    """Why eager PyTorch would run ``__torch_function__`` code for a call with ``tensors`` (its
    tensor arguments, in pytree order) that the graph's aten calls skip, in words, or None.

    Checked: the active ``TorchFunctionMode`` stack (``DeviceContext`` left out, see the module
    docstring) and each tensor's class. Cost when neither applies: two C-level checks.
    """
    if torch._C._is_torch_function_mode_enabled():
        modes = [mode for mode in _get_current_function_mode_stack() if not isinstance(mode, DeviceContext)]
        if modes:
            return f"a TorchFunctionMode ({type(modes[-1]).__name__}) is active"
    if has_torch_function(tuple(tensors)):
        for index, tensor in enumerate(tensors):
            if overrides_torch_function(type(tensor)):
                return (f"argument tensor {index} is a {type(tensor).__name__}, a torch.Tensor subclass with its own"
                        " __torch_function__")
    return None
