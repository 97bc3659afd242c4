"""The Kimi Delta Attention (KDA) token mixer as Kimi Linear builds it, on deltatron's KDA ops (DESIGN.md §12)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..api import chunk_kda, fused_recurrent_kda
from .gated_delta_net import GatedMixer


class KimiDeltaAttention(GatedMixer):
    """Kimi Delta Attention, as a token mixer: [B, T, hidden_size] -> same. Gated DeltaNet with a log decay per key
    channel:

        q, k, v = x W_qkv                                 q, k: Hk heads of K; v: Hv heads of V
        q, k, v = SiLU(short causal depthwise conv of [q | k | v])
        beta    = sigmoid(x W_b)                          per value head (times 2 with allow_neg_eigval)
        g       = -exp(A_log) softplus(x W_fa W_fb + dt_bias)   per value head and key channel, the log decay
        z       = x W_ga W_gb                             the output gate (low rank: K, then Hv V)
        o       = KDA, value head h reading q, k head h // (Hv / Hk); q, k L2-normalized in the op
        y       = (RMSNorm(o) * sigmoid(z)) W_o           per value head

    The op computes beta and g itself (use_beta_sigmoid_in_kernel, use_gate_in_kernel with A_log [Hv] and dt_bias
    [Hv K]), so their gradients come from it. Initialization follows Kimi Linear: A = uniform(1, 16) (A_log = log A),
    dt_bias the inverse softplus of dt, log-uniform in [1e-3, 1e-1]. in_proj_qkv holds [q | k | v] in contiguous
    blocks (Kimi Linear's q_proj, k_proj and v_proj stacked; its conv1d's channels likewise); f_a_proj, f_b_proj,
    g_a_proj, g_b_proj and b_proj are Kimi Linear's (forget_gate.f_a_proj, ...), A_log its [1, 1, Hv, 1] flattened.

    Args:
        hidden_size: model width.
        num_heads, head_dim: query/key heads Hk and their size K.
        num_v_heads, head_v_dim: value heads Hv (a multiple of Hk) and V; default num_heads and head_dim.
        mode: "chunk" (training, prefill) or "fused_recurrent"; decode steps always use fused_recurrent. On the
            Triton backend "chunk" runs the chunkwise kernels, prefill and training (token-serial ones at head sizes
            above 128: chunk_kda's docstring).
        conv_size, conv_bias: the short convolution over q, k and v.
        allow_neg_eigval: beta in (0, 2) instead of (0, 1).
        norm_eps: the output RMSNorm's epsilon.
        layer_idx: this layer's key in a DeltaNetCache (needed for decoding).

    forward(hidden_states, cu_seqlens=None, cache=None, cp_group=None): as GatedDeltaNet's."""

    OPS = (chunk_kda, fused_recurrent_kda)

    def __init__(self, hidden_size: int = 2048, num_heads: int = 16, head_dim: int = 128,
                 num_v_heads: Optional[int] = None, head_v_dim: Optional[int] = None, mode: str = "chunk",
                 conv_size: int = 4, conv_bias: bool = False, allow_neg_eigval: bool = False, norm_eps: float = 1e-6,
                 layer_idx: Optional[int] = None):
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        head_v_dim = head_dim if head_v_dim is None else head_v_dim
        super().__init__(hidden_size, num_heads, num_v_heads, head_dim, head_v_dim, mode, allow_neg_eigval,
                         layer_idx)
        self.in_proj_qkv = nn.Linear(hidden_size, 2 * self.key_dim + self.value_dim, bias=False)
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, num_v_heads * head_dim, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, head_v_dim, bias=False)
        self.g_b_proj = nn.Linear(head_v_dim, self.value_dim, bias=False)
        self._add_parts(conv_size, conv_bias, num_v_heads * head_dim, norm_eps, "sigmoid")

    def reset_gate_parameters(self) -> None:
        """Kimi Linear's initialization of the decay: A = uniform(1, 16), dt log-uniform in [1e-3, 1e-1] and
        dt_bias = dt + log(-expm1(-dt)), the inverse of softplus."""
        with torch.no_grad():
            self.A_log.uniform_(1, 16).log_()
            dt = self.dt_bias.uniform_(math.log(1e-3), math.log(1e-1)).exp_().clamp_(min=1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def _project(self, x: torch.Tensor):
        B, T, _ = x.shape
        a = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, self.num_v_heads, self.head_k_dim)
        return self.in_proj_qkv(x), self.g_b_proj(self.g_a_proj(x)), a, self.b_proj(x)
