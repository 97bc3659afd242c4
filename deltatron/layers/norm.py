"""RMSNorm with a SiLU output gate: the output normalization of a DeltaNet layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight * silu(g) over the last dimension, computed in fp32 (float64
    stays float64) and returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        compute = torch.promote_types(dtype, torch.float32)
        x = x.to(compute)
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight.to(compute)
        return (y * F.silu(g.to(compute))).to(dtype)
