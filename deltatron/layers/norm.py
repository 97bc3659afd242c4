"""RMSNorm with an output gate (SiLU, or sigmoid as Kimi Linear's): the output normalization of a DeltaNet layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}


class GatedRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight * act(g) over the last dimension, act = silu (default) or sigmoid,
    computed in fp32 (float64 stays float64) and returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5, activation: str = "silu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.eps, self.activation = eps, activation
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        compute = torch.promote_types(dtype, torch.float32)
        x = x.to(compute)
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight.to(compute)
        return (y * ACTIVATIONS[self.activation](g.to(compute))).to(dtype)
