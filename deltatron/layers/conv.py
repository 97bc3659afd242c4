"""Short causal depthwise convolution over time, for packed sequences and for decoding.

Every input row is seen as packed sequences (fixed-length batches as B sequences of T tokens): a token's
window never reaches into the sequence before it. Tokens before a sequence's start come from its conv
state, the last W - 1 inputs seen so far (zeros for a fresh sequence), so that prefill and token-by-token
decoding compute the same function."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn


def packed_positions(B: int, T: int, cu_seqlens: Optional[torch.Tensor], device):
    """For the B*T tokens of a [B, T] batch (B == 1 with cu_seqlens): (sequence index, position within the
    sequence) of each token, and the start offset and length of each of the N sequences."""
    tokens = torch.arange(B * T, device=device)
    if cu_seqlens is None:
        starts = torch.arange(B, device=device) * T
        lengths = torch.full((B,), T, device=device)
        seq = tokens // max(T, 1)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        starts, lengths = cu[:-1], cu[1:] - cu[:-1]
        seq = torch.searchsorted(cu[1:], tokens, right=True)
    return seq, tokens - starts[seq], starts, lengths


class ShortConvolution(nn.Module):
    """y_t = act(b + sum_i w_i x_{t - (W-1) + i}) per channel (depthwise), W = kernel_size, act = SiLU or none.

    forward(x [B, T, C], cu_seqlens=None, state=None, output_state=False) -> (y [B, T, C], state or None);
    state: [N, W - 1, C], the last W - 1 inputs of each of the N sequences (N = B, or len(cu_seqlens) - 1)."""

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = False, activation: Optional[str] = "silu"):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be at least 1, got {kernel_size}")
        if activation not in ("silu", None):
            raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
        self.channels, self.kernel_size, self.activation = channels, kernel_size, activation
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1 / math.sqrt(self.kernel_size)  # nn.Conv1d's default for a depthwise kernel (fan_in = W)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                state: Optional[torch.Tensor] = None, output_state: bool = False
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        B, T, C = x.shape
        W = self.kernel_size
        seq, pos, starts, lengths = packed_positions(B, T, cu_seqlens, x.device)
        N = starts.shape[0]
        if state is None:
            state = x.new_zeros(N, W - 1, C)
        elif state.shape != (N, W - 1, C):
            raise ValueError(f"conv state must have shape [N, W-1, C] = [{N}, {W - 1}, {C}], got {list(state.shape)}")
        # One buffer holds every history row, then every token: a gather reads either.
        history = N * (W - 1)
        buf = torch.cat([state.to(x.dtype).reshape(history, C), x.reshape(B * T, C)])

        def source(back, seq_of: torch.Tensor, pos_of: torch.Tensor) -> torch.Tensor:
            """Row of buf holding the input `back` steps before position pos_of of sequence seq_of: a token
            when that lies inside the sequence, else one of the sequence's state rows."""
            from_token = history + starts[seq_of] + pos_of - back
            from_state = seq_of * (W - 1) + (W - 1) + pos_of - back
            return torch.where(pos_of >= back, from_token, from_state)

        weight = self.weight.to(x.dtype)
        y = x.reshape(B * T, C) * weight[:, W - 1]
        for back in range(1, W):
            y = y + buf[source(back, seq, pos)] * weight[:, W - 1 - back]
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        if self.activation == "silu":
            y = F.silu(y)
        y = y.view(B, T, C)
        if not output_state:
            return y, None
        # The new state: the last W - 1 inputs of each sequence, reading into the old state when it is short.
        back = torch.arange(W - 1, 0, -1, device=x.device)  # W-1 .. 1 steps before the end
        rows = source(back[None, :], torch.arange(N, device=x.device)[:, None], lengths[:, None])
        return y, buf[rows]
