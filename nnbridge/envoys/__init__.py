"""Proxy layer: nnsight's model classes over bridged models, with op envoys for every graph node."""

from .envoy import BridgeEnvoy as BridgeEnvoy
from .envoy import node_path as node_path
from .models import LanguageModel as LanguageModel
from .models import NNsight as NNsight
from .models import TransformersModel as TransformersModel
from .routing import install as _install_routing

_install_routing()
