"""PyTorch modules built on deltatron's ops: the DeltaNet, Gated DeltaNet and Kimi Delta Attention layers and their
parts."""
from .cache import DeltaNetCache, LayerState
from .conv import ShortConvolution
from .delta_net import DeltaNet
from .gated_delta_net import GatedDeltaNet
from .kda import KimiDeltaAttention
from .norm import GatedRMSNorm

__all__ = ["DeltaNet", "GatedDeltaNet", "KimiDeltaAttention", "DeltaNetCache", "LayerState", "ShortConvolution",
           "GatedRMSNorm"]
