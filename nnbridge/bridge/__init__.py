"""Graph layer: a module becomes a hierarchy of fx graphs whose every node is a patchable point.

Pipeline: :func:`extract` exports the module with ``torch.export`` (non-strict, every submodule's
call signature preserved), unflattens it into one graph per submodule invocation, cleans and names
the nodes per graph, and mirrors the module hierarchy with :class:`CompiledGraphModule`,
:class:`OpaqueGraphModule` and :class:`MultiplyInvokedModule`. Each node has an :class:`OpPoint`;
the generated code routes a node through it only while something listens. :class:`PatchableGraph`
puts NodePaths, patches and inspection on top, as graphpatch did::

    pg = PatchableGraph(model, input_ids)
    with pg.patch({"transformer.h_0.attn.softmax": ZeroPatch()}):
        logits = pg(input_ids).logits
"""

import sys
import types
from typing import Any

import torch

from .dispatcher import GraphDispatcher as GraphDispatcher
from .in_place import bridge as bridge
from .in_place import bridge_of as bridge_of
from .in_place import unbridge as unbridge
from .extraction import Extraction as Extraction
from .dispatcher import extract as extract
from .graph_module import CompiledGraphModule as CompiledGraphModule
from .graph_module import MultiplyInvokedModule as MultiplyInvokedModule
from .graph_module import OpaqueGraphModule as OpaqueGraphModule
from .node_path import NodePath as NodePath
from .op_point import OpPoint as OpPoint
from .options import ExtractionOptions as ExtractionOptions
from .patchable_graph import PatchableGraph as PatchableGraph
from .patches import AddPatch as AddPatch
from .patches import CustomPatch as CustomPatch
from .patches import Patch as Patch
from .patches import ProbePatch as ProbePatch
from .patches import RecordPatch as RecordPatch
from .patches import ReplacePatch as ReplacePatch
from .patches import ZeroPatch as ZeroPatch


class _CallablePackage(types.ModuleType):
    """The ``nnbridge.bridge`` package, callable as :func:`~.in_place.bridge`.

    ``nnbridge.bridge(model, *inputs)`` is the in-place bridge (the README's spelling) and
    ``nnbridge.bridge`` is still only this package: ``import nnbridge.bridge.extraction as ex``
    and ``import nnbridge.bridge as b; b.PatchableGraph`` both work, and ``nnbridge.bridge`` is
    never a function that hides the package.
    """

    def __call__(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        return bridge(model, *args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
