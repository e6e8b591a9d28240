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
"""

from .compat import registry as _registry

_registry.check_versions()  # a correctness patch not verified on the installed versions refuses here

from .patching.patches import AddPatch as AddPatch  # noqa: E402
from .graph.graph_module import CompiledGraphModule as CompiledGraphModule
from .patching.patches import CustomPatch as CustomPatch
from .extract.options import ExtractionOptions as ExtractionOptions
from .graph.graph_module import MultiplyInvokedModule as MultiplyInvokedModule
from .graph.node_path import NodePath as NodePath
from .graph.graph_module import OpaqueGraphModule as OpaqueGraphModule
from .graph.op_point import OpPoint as OpPoint
from .patching.patches import Patch as Patch
from .patching.patchable_graph import PatchableGraph as PatchableGraph
from .patching.patches import ProbePatch as ProbePatch
from .patching.patches import RecordPatch as RecordPatch
from .patching.patches import ReplacePatch as ReplacePatch
from .patching.patches import ZeroPatch as ZeroPatch
from .errors import ExtractionError as ExtractionError
from .errors import NNBridgeError as NNBridgeError
from .errors import NNBridgeWarning as NNBridgeWarning
from .errors import NodePathError as NodePathError
from .errors import SaveLoadError as SaveLoadError

from .inplace.bridging import bridge as bridge  # noqa: E402
from .inplace.bridging import unbridge as unbridge  # noqa: E402
from .patching.explain import Explanation as Explanation  # noqa: E402
from .patching.explain import explain as explain  # noqa: E402
from .envoys import LanguageModel as LanguageModel  # noqa: E402
from .envoys import NNsight as NNsight  # noqa: E402
from .envoys import TransformersModel as TransformersModel  # noqa: E402
from .envoys.routing import install as _install_routing  # noqa: E402

_install_routing()  # the graph runtime asks nnsight whether a running trace wants an op

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
    "ZeroPatch",
    "bridge",
    "explain",
    "unbridge",
]
