"""The nnsight front-end: nnsight's model classes over bridged models, with an op envoy per node.

``nnbridge.NNsight``, ``LanguageModel`` and ``TransformersModel`` are nnsight 0.8's classes over a
model bridged in place (:mod:`nnbridge.inplace`): every module envoy also has an *op envoy* per
graph node (``model.transformer.h[0].attn.softmax.output``), read and written inside a trace as
nnsight reads module outputs. A trace that reads only module inputs and outputs runs the model
as is. :func:`.routing.install` tells the graph runtime when a running trace wants an op; the
package root calls it once (``nnbridge/__init__``), and importing this package changes no class.
"""

from .envoy import BridgeEnvoy as BridgeEnvoy
from .envoy import node_path as node_path
from .models import LanguageModel as LanguageModel
from .models import NNsight as NNsight
from .models import TransformersModel as TransformersModel
