"""nnbridge: every intermediate operation of a PyTorch model as a named, patchable point.

nnbridge turns any ``nn.Module`` into a hierarchy of ``torch.fx``
graphs, one per submodule invocation, on torch 2.13, and exposes graphpatch's API on it::

    import torch, nnbridge
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100,
                                       attn_implementation="eager")).eval()
    ids = torch.randint(0, 100, (1, 8))
    pg = nnbridge.PatchableGraph(model, ids)
    probe = nnbridge.ProbePatch()
    with pg.patch({"transformer.h_0.attn.softmax": probe}):
        pg(ids)
    probe.activation.shape          # (batch, heads, seq, seq) = (1, 4, 8, 8)

Or bridge the model in place, so plain torch hooks reach every op::

    nnbridge.bridge(model, ids)
    model.get_submodule("transformer.h.0.attn.softmax").register_forward_hook(
        lambda module, args, output: output * 0)

Vocabulary (each word names one idea, here and in the code):

- *extraction*: the hierarchy of graph modules made for one module and one call structure
  (:mod:`nnbridge.extract`, kept by :mod:`nnbridge.dispatch`);
- *call structure*: what a call must share with the example call for an extraction to serve it
  (argument kinds, non-symbolic sizes, dtypes, devices, aliasing; :mod:`nnbridge.guards.call_structure`);
- *guard*: a check, before a call, that what an extraction read still holds (:mod:`nnbridge.guards`);
- *op point*: the identity module standing for one graph node, the one place patches, torch hooks
  and nnsight envoys reach its value (:class:`OpPoint`);
- *listener*: a patch, torch hook or running trace registered on an op point;
- *NodePath*: the dotted name of a node (``transformer.h_0.attn.softmax``), parsed by
  :class:`NodePath`; internal signatures annotate its text as ``nnbridge.graph.NodePathStr``;
- *module path*: ``named_modules()``'s name of a module (``transformer.h.0.attn``, ``""`` the
  root), annotated ``nnbridge.graph.ModulePath`` where the extraction and dispatch layers pass one
  (``fqn``, ``path``). Both are ``typing.NewType``s of ``str``: plain strings at run time, told
  apart by mypy;
- *opaque*: a module that runs its own code instead of a graph, with a recorded reason
  (:class:`OpaqueGraphModule`); its children may still be graphs;
- *representative* and *sibling*: under layer reuse, identical layers are exported once, by the
  representative, and each sibling gets the representative's graph over its own weights;
- *patch*: what to do to a node's value (graphpatch's classes, :class:`Patch`).

``import nnbridge`` checks the installed versions against the verified ones
(:func:`nnbridge.compat.registry.check_versions`, read from package metadata: a correctness patch
not verified on them raises :class:`NNBridgeError` here) and imports nothing heavy: the public
names below load on first use (PEP 562 ``__getattr__``), which imports torch, transformers and
nnsight and installs nnsight's routing into the graph runtime
(:func:`nnbridge.envoys.routing.install`). So the ``nnbridge``
command's ``--help`` and argument errors answer at once (``nnbridge.cli`` imports the rest only for
the command it runs).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .compat import registry as _registry

if TYPE_CHECKING:  # the names as the type checker sees them; at run time __getattr__ loads them
    from .errors import ExtractionError as ExtractionError
    from .errors import NNBridgeError as NNBridgeError
    from .errors import FallbackWarning as FallbackWarning
    from .errors import NNBridgeWarning as NNBridgeWarning
    from .errors import NodePathError as NodePathError
    from .errors import SaveLoadError as SaveLoadError
    from .errors import PassCheckError as PassCheckError
    from .errors import PatternError as PatternError
    from .errors import SurgeryError as SurgeryError
    from .extract.options import ExtractionOptions as ExtractionOptions
    from .graph.graph_module import CompiledGraphModule as CompiledGraphModule
    from .graph.graph_module import MultiplyInvokedModule as MultiplyInvokedModule
    from .graph.graph_module import OpaqueGraphModule as OpaqueGraphModule
    from .graph.node_path import NodePath as NodePath
    from .graph.op_point import OpPoint as OpPoint
    from .inplace.bridging import bridge as bridge
    from .inplace.bridging import unbridge as unbridge
    from .patching.explain import Explanation as Explanation
    from .patching.explain import explain as explain
    from .patching.patchable_graph import PatchableGraph as PatchableGraph
    from .patching.patches import AddPatch as AddPatch
    from .patching.patches import CustomPatch as CustomPatch
    from .patching.patches import Patch as Patch
    from .patching.patches import ProbePatch as ProbePatch
    from .patching.patches import RecordPatch as RecordPatch
    from .patching.patches import ReplacePatch as ReplacePatch
    from .patching.patches import ZeroPatch as ZeroPatch
    from .envoys import LanguageModel as LanguageModel
    from .envoys import NNsight as NNsight
    from .envoys import TransformersModel as TransformersModel


def _doctor_process() -> bool:
    """Whether this process runs ``nnbridge doctor`` (the console script, or ``python -m nnbridge``,
    whose ``sys.argv[0]`` is ``-m`` while this package is imported): the one command that imports
    nnbridge past a refused version check, to report it. A correctness patch still refuses when
    used (:func:`nnbridge.compat.registry.enabled`)."""
    import os
    import sys

    argv = sys.argv
    return len(argv) >= 2 and argv[1] == "doctor" and (os.path.basename(argv[0]) in ("nnbridge", "-m")
                                                       or argv[0].endswith(os.path.join("nnbridge", "__main__.py")))


#: the version check's refusal, kept instead of raised only in an ``nnbridge doctor`` process
REFUSAL: Exception | None = None
try:
    _registry.check_versions()  # a correctness patch not verified on the installed versions refuses here
except Exception as _refusal:
    if not _doctor_process():
        raise
    REFUSAL = _refusal

#: ``{public name: module defining it}``, loaded together on the first use of any (see :func:`_load`)
_EXPORTS: dict[str, str] = {
    "AddPatch": ".patching.patches",
    "CompiledGraphModule": ".graph.graph_module",
    "CustomPatch": ".patching.patches",
    "ExtractionError": ".errors",
    "ExtractionOptions": ".extract.options",
    "Explanation": ".patching.explain",
    "LanguageModel": ".envoys",
    "MultiplyInvokedModule": ".graph.graph_module",
    "NNBridgeError": ".errors",
    "FallbackWarning": ".errors",
    "NNBridgeWarning": ".errors",
    "NNsight": ".envoys",
    "NodePath": ".graph.node_path",
    "NodePathError": ".errors",
    "OpPoint": ".graph.op_point",
    "OpaqueGraphModule": ".graph.graph_module",
    "Patch": ".patching.patches",
    "PatchableGraph": ".patching.patchable_graph",
    "ProbePatch": ".patching.patches",
    "RecordPatch": ".patching.patches",
    "ReplacePatch": ".patching.patches",
    "SaveLoadError": ".errors",
    "PassCheckError": ".errors",
    "PatternError": ".errors",
    "SurgeryError": ".errors",
    "TransformersModel": ".envoys",
    "ZeroPatch": ".patching.patches",
    "bridge": ".inplace.bridging",
    "explain": ".patching.explain",
    "unbridge": ".inplace.bridging",
}

__all__ = [
    "AddPatch",
    "LanguageModel",
    "NNsight",
    "TransformersModel",
    "CompiledGraphModule",
    "CustomPatch",
    "ExtractionError",
    "ExtractionOptions",
    "Explanation",
    "MultiplyInvokedModule",
    "NNBridgeError",
    "FallbackWarning",
    "NNBridgeWarning",
    "NodePath",
    "NodePathError",
    "OpPoint",
    "OpaqueGraphModule",
    "Patch",
    "PatchableGraph",
    "ProbePatch",
    "RecordPatch",
    "ReplacePatch",
    "SaveLoadError",
    "PassCheckError",
    "PatternError",
    "SurgeryError",
    "ZeroPatch",
    "bridge",
    "explain",
    "unbridge",
]


def _load() -> None:
    """Import the public API into this module, once, then let the graph runtime ask nnsight whether
    a running trace wants an op."""
    names = {name: getattr(importlib.import_module(module, __name__), name) for name, module in _EXPORTS.items()}
    from .envoys.routing import install

    install()
    globals().update(names)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
