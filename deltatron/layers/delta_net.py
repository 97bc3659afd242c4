"""The DeltaNet token mixer (Yang et al., 2024), built on deltatron's delta-rule ops."""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..api import chunk_delta_rule, fused_recurrent_delta_rule
from ..context_parallel import preceding_tokens
from ..validation import LayoutWarning
from .cache import DeltaNetCache, LayerState
from .conv import ShortConvolution
from .mixer import run_mixer
from .norm import GatedRMSNorm

MODES = ("chunk", "fused_recurrent")


class DeltaNet(nn.Module):
    """Linear attention with the delta rule, as a drop-in token mixer: [B, T, hidden_size] -> same shape.

        q, k, v = short causal convolutions (with SiLU) of linear projections of x  (SiLU alone without them)
        beta    = sigmoid(x W_beta)                      per head (ones with use_beta=False)
        o       = delta rule over the heads, q and k L2-normalized inside the op
        y       = (RMSNorm(o) * silu(x W_g)) W_o          gated output norm per head (plain RMSNorm without the gate)

    Args:
        hidden_size: model width; num_heads: number of heads H.
        head_dim: key head size K (value head size V = head_dim * expand_v); by default K = hidden_size *
            expand_k / H and V = hidden_size * expand_v / H.
        mode: "chunk" (training, prefill) or "fused_recurrent"; decode steps always use fused_recurrent.
        save_states: chunk_delta_rule's (mode "chunk"): in training, keep the forward's per-chunk states for the
            backward (faster, more memory held from the forward to the backward).
        use_short_conv, conv_size, conv_bias: the short convolutions on q, k and v.
        use_gate: the SiLU output gate (g projection).
        layer_idx: this layer's key in a DeltaNetCache (needed for decoding).

    forward(hidden_states, cu_seqlens=None, cache=None, cp_group=None): cu_seqlens packs variable-length sequences
    along T (B = 1); convolutions and states never cross sequence boundaries. With cp_group (a torch.distributed
    ProcessGroup) hidden_states is this rank's shard of a stream sharded over the group, as chunk_delta_rule's
    cp_group takes it, and the layer equals the unsharded one (the convolutions read the tokens before the shard);
    mode "chunk", no cache. With a cache the call is inference (no gradients): the first call (prefill) stores each
    sequence's conv and recurrent states, later calls continue from them; a call with one token per sequence
    (x [N, 1, hidden_size]) is a decode step, run by fused_recurrent_delta_rule updating the recurrent state in
    place."""

    def __init__(self, hidden_size: int = 1024, num_heads: int = 4, head_dim: Optional[int] = None,
                 expand_k: float = 1.0, expand_v: float = 1.0, mode: str = "chunk", use_beta: bool = True,
                 use_short_conv: bool = True, conv_size: int = 4, conv_bias: bool = False, use_gate: bool = True,
                 norm_eps: float = 1e-5, layer_idx: Optional[int] = None, save_states: bool = False):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(save_states, bool):
            raise TypeError(f"save_states must be a bool, got {save_states!r}")
        self.save_states = save_states
        if head_dim is not None:
            head_k_dim, head_v_dim = head_dim, int(head_dim * expand_v)
        else:
            key_dim, value_dim = int(hidden_size * expand_k), int(hidden_size * expand_v)
            if key_dim % num_heads or value_dim % num_heads:
                raise ValueError(f"hidden_size * expand_k = {key_dim} and hidden_size * expand_v = {value_dim} "
                                 f"must be divisible by num_heads = {num_heads}")
            head_k_dim, head_v_dim = key_dim // num_heads, value_dim // num_heads
        self.hidden_size, self.num_heads, self.mode, self.layer_idx = hidden_size, num_heads, mode, layer_idx
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_heads * head_k_dim, num_heads * head_v_dim
        self.use_beta, self.use_short_conv, self.use_gate = use_beta, use_short_conv, use_gate

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if use_beta:
            self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, conv_bias)
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, conv_bias)
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, conv_bias)
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = GatedRMSNorm(head_v_dim, eps=norm_eps)
        else:
            self.o_norm = nn.RMSNorm(head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                cache: Optional[DeltaNetCache] = None, cp_group=None) -> torch.Tensor:
        return run_mixer(self, hidden_states, cu_seqlens, cache, cp_group)

    def _forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor], cache: Optional[DeltaNetCache],
                 cp_group):
        B, T, _ = x.shape
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        past = cache[self.layer_idx] if cache is not None else None
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        conv_state = None
        if self.use_short_conv:
            old = past.conv_state if past is not None else (None, None, None)
            conv_cu, keep = cu_seqlens, cache is not None
            if cp_group is not None:  # the three convolutions' tokens before the shard, in one exchange
                conv_cu, states = preceding_tokens(torch.cat([q, k, v], -1), self.q_conv1d.kernel_size - 1,
                                                   cu_seqlens, cp_group)
                old = states.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            q, cq = self.q_conv1d(q, conv_cu, old[0], keep)
            k, ck = self.k_conv1d(k, conv_cu, old[1], keep)
            v, cv = self.v_conv1d(v, conv_cu, old[2], keep)
            conv_state = (cq, ck, cv)
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V)
        beta = self.b_proj(x).sigmoid() if self.use_beta else q.new_ones(B, T, H)

        if cache is None:
            o, _ = self._attend(q, k, v, beta, None, False, cu_seqlens, cp_group)
        elif past is not None and cu_seqlens is None and T == 1:
            # decode step: the state is updated in place, no allocation
            o, state = fused_recurrent_delta_rule(q, k, v, beta, initial_state=past.recurrent_state,
                                                  use_qk_l2norm_in_kernel=True, inplace_final_state=True)
            cache[self.layer_idx] = LayerState(state, conv_state)
        else:
            o, state = self._attend(q, k, v, beta, None if past is None else past.recurrent_state, True, cu_seqlens)
            cache[self.layer_idx] = LayerState(state, conv_state)

        if self.use_gate:
            o = self.o_norm(o, self.g_proj(x).view(B, T, H, V))
        else:
            o = self.o_norm(o)
        return self.o_proj(o.reshape(B, T, self.value_dim))

    def _attend(self, q, k, v, beta, initial_state, output_final_state: bool, cu_seqlens, cp_group=None):
        """The sequence mixer proper: (o [B, T, H, V], final state [N, H, K, V] or None)."""
        options = dict(save_states=self.save_states) if self.mode == "chunk" else {}
        if cp_group is not None:
            options["cp_group"] = cp_group
        fn = chunk_delta_rule if self.mode == "chunk" else fused_recurrent_delta_rule
        call = dict(initial_state=initial_state, output_final_state=output_final_state, use_qk_l2norm_in_kernel=True,
                    cu_seqlens=cu_seqlens, **options)
        if 1 < q.shape[1] < q.shape[2] and not torch.compiler.is_compiling():
            # q is [B, T, H, K] by construction: a prompt shorter than the number of heads is no layout mistake
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", LayoutWarning)
                return fn(q, k, v, beta, **call)
        return fn(q, k, v, beta, **call)

    def extra_repr(self) -> str:
        return (f"mode={self.mode!r}, save_states={self.save_states}, num_heads={self.num_heads}, "
                f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, layer_idx={self.layer_idx}")
