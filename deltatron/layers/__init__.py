"""PyTorch modules built on deltatron's ops: the DeltaNet and Gated DeltaNet layers and their parts."""
from .cache import DeltaNetCache, LayerState
from .conv import ShortConvolution
from .delta_net import DeltaNet
from .gated_delta_net import GatedDeltaNet
from .norm import GatedRMSNorm

__all__ = ["DeltaNet", "GatedDeltaNet", "DeltaNetCache", "LayerState", "ShortConvolution", "GatedRMSNorm"]
