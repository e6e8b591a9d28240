"""``BridgeEnvoy``: nnsight's Envoy, aware that a bridged module's graph nodes are children.

Every op point of a bridged module is an ordinary submodule, so nnsight mirrors it as an envoy
and everything an envoy supports in a trace works on ops (``.output``, ``.input``, ``.skip``,
``.save()``, assignment, invokes, ``tracer.iter``, ``.grad``, ``tracer.cache()``). This class adds
what nnsight cannot know: the op's NodePath, and errors that name the closest valid ops.
"""

from __future__ import annotations

from typing import Any

import nnsight
import torch

from ..compat.nnsight.models import wrapped_module
from ..compat.nnsight import printing as nnsight_repr
from ..compat.torch.module_dicts import modules_of
from ..inplace.absence import module_absence
from ..inplace.bridging import bridge_of
from ..graph.node_path import NodePathStr
from ..graph.op_point import OpPoint, OpPointContainer


def node_path(path: str, root: torch.nn.Module) -> NodePathStr:
    """graphpatch NodePath of an envoy path (``model.transformer.h.0.attn.softmax`` ->
    ``transformer.h_0.attn.softmax``; ``linear.invocation_1.linear`` -> ``linear_1.linear``)."""
    segments = path.split(".")[1:]
    out: list[str] = []
    module: torch.nn.Module | None = root
    for segment in segments:
        module = modules_of(module).get(segment) if module is not None else None
        if isinstance(module, OpPoint):
            out.append(module.node_name)
        elif segment.isdigit() and out:
            out[-1] = f"{out[-1]}_{segment}"
        elif isinstance(module, OpPointContainer) and out:
            out[-1] = f"{out[-1]}_{segment.rpartition('_')[2]}"
        else:
            out.append(segment)
    return NodePathStr(".".join(out))


#: spellings of older nnsight versions, and their nnsight 0.8 replacement (AttributeError, as nnsight)
_OLD_SPELLINGS = {
    "value": ("`.value` is nnsight 0.4's proxy value; in nnsight 0.8 a saved value is the tensor itself:"
              " `x = envoy.output.save()`, then use `x` after the trace."),
    "next": ("`.next()` is nnsight 0.5-0.7's generation step; in nnsight 0.8 loop over steps with"
             " `for step in tracer.iter[...]:` (or `tracer.all()` for every step)."),
}


class BridgeEnvoy(nnsight.Envoy):
    """An nnsight Envoy whose children include the module's op envoys (see the module docstring)."""

    @property
    def node_path(self) -> NodePathStr:
        """The NodePath of this envoy's module or op (``transformer.h_0.attn.softmax``)."""
        return node_path(self.path, wrapped_module(self.root))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") or name.startswith("_"):
                raise
            raise AttributeError(self._missing(name)) from None

    def _missing(self, name: str) -> str:
        return missing_message(self, name)

    def __repr__(self) -> str:
        """nnsight's printed tree, each module's ops on one line (see :func:`tree_repr`)."""
        return tree_repr(self)

    def __dir__(self) -> list[str]:
        module = wrapped_module(self)
        children = list(modules_of(module)) if module is not None else []
        return sorted(set(super().__dir__()) | set(children))


def missing_message(envoy: nnsight.Envoy, name: str) -> str:
    """Why ``envoy`` has no attribute ``name``, for its ``AttributeError``: nnbridge's one
    explanation of a missing op (:func:`~nnbridge.inplace.absence.module_absence`): the module runs
    eagerly, or its attention implementation has no such op, or the closest op names of its module
    by edit distance (or why it has no ops yet); the entries of a module container."""
    module = wrapped_module(envoy)
    if name in _OLD_SPELLINGS and name not in modules_of(module or torch.nn.Module()):
        return f"{envoy.path}.{name}: {_OLD_SPELLINGS[name]}"
    where = f"{envoy.path} ({type(module).__name__})"
    root = wrapped_module(envoy.root)
    bridge = bridge_of(root) if isinstance(root, torch.nn.Module) else None
    entry = isinstance(module, _CONTAINERS) and (name.isdigit() or isinstance(module, (torch.nn.ModuleList,
                                                                                        torch.nn.ModuleDict)))
    subject = f"{where} has no entry {name!r}" if entry else f"{where} has no attribute or op {name!r}"
    return module_absence(subject, name, module=module, path=envoy.path.partition(".")[2], where=where,
                          model=root if isinstance(root, torch.nn.Module) else None, bridge=bridge,
                          entries=entry, unknown=_UNKNOWN)


#: How a module envoy's ops become known (said while nothing is extracted).
_UNKNOWN = ("they appear when the model is extracted, at the first trace whose code names an op (a trace that"
            " reads only module inputs and outputs runs the model as is), or with model.extract(*inputs).")


def bridged_hint(envoy: nnsight.Envoy, name: str) -> str | None:
    """:func:`missing_message` for an envoy under one of nnbridge's front-ends (``nnbridge.NNsight``,
    ``LanguageModel``...), of a bridged model or of a module holding op points, else None: nnsight's
    envoys of a model nnbridge never bridged keep nnsight's error."""
    module = wrapped_module(envoy)
    top = envoy.root
    root = wrapped_module(top)
    bridged = getattr(type(top), "NNBRIDGE_FRONT_END", False) or (isinstance(root, torch.nn.Module) and bridge_of(root) is not None)
    if not bridged and not any(isinstance(child, (OpPoint, OpPointContainer))
                               for child in (modules_of(module).values() if module is not None else ())):
        return None
    return missing_message(envoy, name)


def tree_repr(envoy: nnsight.Envoy) -> str:
    """``envoy``'s tree as nnsight 0.8.1 prints it (``Envoy.__repr__``: repeated ``ModuleList``
    entries collapse to ``(0-29): 30 x LlamaDecoderLayer(...)``), with each module's op envoys
    on one line, ``(ops): 8 ops: x, bias_, weight_, ..., output_`` (the first 6 and last 2 names)."""
    return nnsight_repr.tree_repr(envoy, lambda module: isinstance(module, (OpPoint, OpPointContainer)))


#: Module containers: their entries are modules, indexed by position or key.
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)
