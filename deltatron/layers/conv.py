"""Short causal depthwise convolution over time, for packed sequences and for decoding.

A [B, T, C] batch is B sequences; with cu_seqlens (B = 1) the row packs several, and a token's window
never reaches into the sequence before it. Tokens before a sequence's start come from its conv
state, the last W - 1 inputs seen so far (zeros for a fresh sequence), so that prefill and token-by-token
decoding compute the same function."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn


def packed_positions(T: int, cu_seqlens: torch.Tensor, device):
    """For the T tokens of packed sequences: (sequence index, position within the sequence) of each token,
    and the start offset and length of each sequence. Gathers only, no slices of cu_seqlens: inductor in
    torch 2.11 fails on slices of it feeding searchsorted or an index (NotImplementedError: SliceView)."""
    tokens = torch.arange(T, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    seqs = torch.arange(cu.shape[0] - 1, device=device)
    starts, ends = cu[seqs], cu[seqs + 1]
    # the last start at or before each token (empty sequences share a start and are skipped by right=True)
    seq = torch.searchsorted(cu, tokens, right=True) - 1
    return seq, tokens - cu[seq], starts, ends - starts


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
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if state is None:
            state = x.new_zeros(N, W - 1, C)
        elif state.shape != (N, W - 1, C):
            raise ValueError(f"conv state must have shape [N, W-1, C] = [{N}, {W - 1}, {C}], got {list(state.shape)}")
        state = state.to(x.dtype)
        weight = self.weight.to(x.dtype)
        if cu_seqlens is None:
            # each row is one sequence: put its state in front and slide the window
            xs = torch.cat([state, x], dim=1)
            y = sum(xs[:, i:i + T] * weight[:, i] for i in range(W))
            new_state = xs[:, T:]
        else:
            y, new_state = self._packed(x, cu_seqlens, state, weight)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        if self.activation == "silu":
            y = F.silu(y)
        return y, (new_state.contiguous() if output_state else None)

    @staticmethod
    def _packed(x, cu_seqlens, state, weight):
        """The window over packed sequences: one buffer holds every state row, then every token, and each
        tap gathers, per token, either the token `back` steps before it or, before its sequence's start,
        a row of that sequence's state."""
        _, T, C = x.shape
        N, W = state.shape[0], weight.shape[1]
        seq, pos, starts, lengths = packed_positions(T, cu_seqlens, x.device)
        history = N * (W - 1)
        buf = torch.cat([state.reshape(history, C), x[0]])

        def source(back, seq_of: torch.Tensor, pos_of: torch.Tensor) -> torch.Tensor:
            from_token = history + starts[seq_of] + pos_of - back
            from_state = seq_of * (W - 1) + (W - 1) + pos_of - back
            return torch.where(pos_of >= back, from_token, from_state)

        y = x[0] * weight[:, W - 1]
        for back in range(1, W):
            y = y + buf[source(back, seq, pos)] * weight[:, W - 1 - back]
        # the new state: the last W - 1 inputs of each sequence (partly the old state when it is short)
        back = torch.arange(W - 1, 0, -1, device=x.device)
        rows = source(back[None, :], torch.arange(N, device=x.device)[:, None], lengths[:, None])
        return y[None], buf[rows]
