"""The Gated DeltaNet token mixer (Yang et al., 2025) as Qwen3-Next builds it, on deltatron's gated delta-rule ops, and
the parts it shares with the KDA token mixer (layers/kda.py)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..api import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from ..context_parallel import preceding_tokens
from .cache import DeltaNetCache, LayerState
from .conv import ShortConvolution
from .mixer import run_mixer
from .norm import GatedRMSNorm

MODES = ("chunk", "fused_recurrent")


class GatedMixer(nn.Module):
    """What the Gated DeltaNet and KDA token mixers share: the argument checks, the short convolution over
    [q | k | v], the decay's A_log and dt_bias, the gated output norm and projection, and the call of the rule's ops
    with the cache (prefill, in-place decode steps). A subclass registers its input projections, calls _add_parts
    and defines _project(x) -> (qkv, z, a, b): the conv's input, the output gate, the gate's raw projection (the
    shape its op takes) and beta's logits."""

    OPS: tuple = ()  # (chunk op, fused_recurrent op)

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 mode: str, allow_neg_eigval: bool, layer_idx: Optional[int]):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if min(num_k_heads, num_v_heads, head_k_dim, head_v_dim) < 1:
            raise ValueError(f"head counts and sizes must be positive: num_k_heads = {num_k_heads}, num_v_heads = "
                             f"{num_v_heads}, head_k_dim = {head_k_dim}, head_v_dim = {head_v_dim}")
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads = {num_v_heads} must be a multiple of num_k_heads = {num_k_heads}")
        if not isinstance(allow_neg_eigval, bool):
            raise TypeError(f"allow_neg_eigval must be a bool, got {allow_neg_eigval!r}")
        self.hidden_size, self.mode, self.layer_idx = hidden_size, mode, layer_idx
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.allow_neg_eigval = allow_neg_eigval

    def _add_parts(self, conv_size: int, conv_bias: bool, dt_bias_size: int, norm_eps: float,
                   norm_activation: str) -> None:
        self.conv1d = ShortConvolution(2 * self.key_dim + self.value_dim, conv_size, conv_bias)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(dt_bias_size))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps, activation=norm_activation)
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)
        self.reset_gate_parameters()

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                cache: Optional[DeltaNetCache] = None, cp_group=None) -> torch.Tensor:
        return run_mixer(self, hidden_states, cu_seqlens, cache, cp_group)

    def _forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor], cache: Optional[DeltaNetCache],
                 cp_group):
        B, T, _ = x.shape
        Hk, Hv, K, V = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        past = cache[self.layer_idx] if cache is not None else None
        qkv, z, a, b = self._project(x)
        conv_cu, old = cu_seqlens, past.conv_state[0] if past is not None else None
        if cp_group is not None:  # the convolution's tokens before the shard
            conv_cu, old = preceding_tokens(qkv, self.conv1d.kernel_size - 1, cu_seqlens, cp_group)
        qkv, conv_state = self.conv1d(qkv, conv_cu, old, cache is not None)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = q.reshape(B, T, Hk, K), k.reshape(B, T, Hk, K), v.reshape(B, T, Hv, V)
        gate = dict(use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias, use_beta_sigmoid_in_kernel=True,
                    allow_neg_eigval=self.allow_neg_eigval, use_qk_l2norm_in_kernel=True)

        if cache is None:
            sharded = {} if cp_group is None else {"cp_group": cp_group}
            o, _ = self._attend(q, k, v, a, b, None, False, cu_seqlens, {**gate, **sharded})
        elif past is not None and cu_seqlens is None and T == 1:
            # decode step: the state is updated in place, no allocation
            o, state = self.OPS[1](q, k, v, a, b, initial_state=past.recurrent_state, inplace_final_state=True,
                                   **gate)
            cache[self.layer_idx] = LayerState(state, (conv_state,))
        else:
            o, state = self._attend(q, k, v, a, b, None if past is None else past.recurrent_state, True, cu_seqlens,
                                    gate)
            cache[self.layer_idx] = LayerState(state, (conv_state,))

        o = self.norm(o, z.reshape(B, T, Hv, V))
        return self.out_proj(o.reshape(B, T, self.value_dim))

    def _attend(self, q, k, v, a, b, initial_state, output_final_state: bool, cu_seqlens, gate):
        """The sequence mixer proper: (o [B, T, Hv, V], final state [N, Hv, K, V] or None)."""
        fn = self.OPS[0] if self.mode == "chunk" else self.OPS[1]
        return fn(q, k, v, a, b, initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens, **gate)

    def extra_repr(self) -> str:
        return (f"mode={self.mode!r}, num_k_heads={self.num_k_heads}, num_v_heads={self.num_v_heads}, "
                f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, "
                f"allow_neg_eigval={self.allow_neg_eigval}, layer_idx={self.layer_idx}")


class GatedDeltaNet(GatedMixer):
    """Gated delta-rule linear attention with grouped value heads, as a token mixer: [B, T, hidden_size] -> same.

        q, k, v, z = x W_qkvz                            q, k: Hk heads of K; v, z: Hv heads of V
        b, a       = x W_ba                              Hv each
        q, k, v    = SiLU(short causal depthwise conv of [q | k | v])
        beta       = sigmoid(b)   (times 2 with allow_neg_eigval)
        g          = -exp(A_log) softplus(a + dt_bias)   per value head, the log decay
        o          = gated delta rule, value head h reading q, k head h // (Hv / Hk); q, k L2-normalized in the op
        y          = (RMSNorm(o) * silu(z)) W_o           per value head

    The op computes beta and g itself (use_beta_sigmoid_in_kernel, use_gate_in_kernel with A_log and dt_bias),
    so their gradients come from it. Initialization follows Qwen3-Next: A_log = log(uniform(0, 16)),
    dt_bias = 1. The fused projections hold their parts in contiguous blocks, in_proj_qkvz = [q | k | v | z]
    and in_proj_ba = [b | a] (Hugging Face's Qwen3-Next interleaves them per key-head group: permute its rows
    to load its weights).

    Args:
        hidden_size: model width.
        num_k_heads, num_v_heads: query/key heads Hk and value heads Hv (a multiple of Hk).
        head_k_dim, head_v_dim: K and V.
        mode: "chunk" (training, prefill) or "fused_recurrent"; decode steps always use fused_recurrent.
        conv_size, conv_bias: the short convolution over q, k and v.
        allow_neg_eigval: beta in (0, 2) instead of (0, 1).
        norm_eps: the output RMSNorm's epsilon.
        layer_idx: this layer's key in a DeltaNetCache (needed for decoding).

    forward(hidden_states, cu_seqlens=None, cache=None, cp_group=None): as DeltaNet's. cu_seqlens packs
    variable-length sequences along T (B = 1); with a cache the call is inference (no gradients), the first call
    storing each sequence's conv and recurrent ([N, Hv, K, V] fp32) states, and a call with one token per sequence
    (x [N, 1, hidden_size]) is a decode step that updates the recurrent state in place; cp_group as DeltaNet's."""

    OPS = (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)

    def __init__(self, hidden_size: int = 2048, num_k_heads: int = 16, num_v_heads: int = 32, head_k_dim: int = 128,
                 head_v_dim: int = 128, mode: str = "chunk", conv_size: int = 4, conv_bias: bool = False,
                 allow_neg_eigval: bool = False, norm_eps: float = 1e-6, layer_idx: Optional[int] = None):
        super().__init__(hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim, mode, allow_neg_eigval,
                         layer_idx)
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        self._add_parts(conv_size, conv_bias, num_v_heads, norm_eps, "silu")

    def reset_gate_parameters(self) -> None:
        """Qwen3-Next's initialization of the decay: A = uniform(0, 16) (A_log = log A), dt_bias = 1."""
        with torch.no_grad():
            self.A_log.uniform_(0, 16).log_()
            self.dt_bias.fill_(1.0)

    def _project(self, x: torch.Tensor):
        qkv, z = self.in_proj_qkvz(x).split([2 * self.key_dim + self.value_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).split([self.num_v_heads] * 2, dim=-1)
        return qkv, z, a, b
