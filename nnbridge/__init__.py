"""nnbridge: every intermediate operation of a PyTorch model as a named, patchable point.

The graph layer (:mod:`nnbridge.bridge`) turns any ``nn.Module`` into a hierarchy of ``torch.fx``
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

from .bridge import AddPatch as AddPatch  # noqa: E402
from .bridge import CompiledGraphModule as CompiledGraphModule
from .bridge import CustomPatch as CustomPatch
from .bridge import ExtractionOptions as ExtractionOptions
from .bridge import MultiplyInvokedModule as MultiplyInvokedModule
from .bridge import NodePath as NodePath
from .bridge import OpaqueGraphModule as OpaqueGraphModule
from .bridge import OpPoint as OpPoint
from .bridge import Patch as Patch
from .bridge import PatchableGraph as PatchableGraph
from .bridge import ProbePatch as ProbePatch
from .bridge import RecordPatch as RecordPatch
from .bridge import ReplacePatch as ReplacePatch
from .bridge import ZeroPatch as ZeroPatch
from .errors import ExtractionError as ExtractionError
from .errors import NNBridgeError as NNBridgeError
from .errors import NNBridgeWarning as NNBridgeWarning
from .errors import NodePathError as NodePathError
from .errors import SaveLoadError as SaveLoadError

# ``nnbridge.bridge`` is the subpackage, callable as the in-place bridge (see its ``_CallablePackage``).
from . import bridge as bridge  # noqa: E402
from .bridge.in_place import unbridge as unbridge  # noqa: E402
from .bridge.explain import Explanation as Explanation  # noqa: E402
from .bridge.explain import explain as explain  # noqa: E402
from .envoys import LanguageModel as LanguageModel  # noqa: E402
from .envoys import NNsight as NNsight  # noqa: E402
from .envoys import TransformersModel as TransformersModel  # noqa: E402

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
