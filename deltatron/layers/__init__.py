"""PyTorch modules built on deltatron's ops: the DeltaNet layer and its parts."""
from .cache import DeltaNetCache, LayerState
from .conv import ShortConvolution
from .delta_net import DeltaNet
from .norm import GatedRMSNorm

__all__ = ["DeltaNet", "DeltaNetCache", "LayerState", "ShortConvolution", "GatedRMSNorm"]
