"""The gated rule's log decays inside a chunk (DESIGN.md §11): γ, the cumulative sum of g from the chunk's start, and
the decay factors the stages take from it under their USE_G constexpr.

Every factor is exp of a sum of g over a span of tokens, formed as a difference of γ before exponentiating, so no
exponent is positive: exp(γ_i) (the span (0, i]), E_ij = exp(γ_i - γ_j) for j <= i, exp(γ_C - γ_i) and exp(γ_C). A
gate of -20 a token takes a chunk's γ to -1280; exp(γ_i) exp(-γ_j) would overflow there."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...launch import launch
from ...utils import SeqInfo, chunk_span


@triton.jit
def chunk_gamma_kernel(g, gam, cu_seqlens, chunk_indices, H: tl.constexpr, C: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start, n = chunk_span(cu_seqlens, chunk_indices, i_c, C)
    r = tl.arange(0, C)
    b_g = tl.load(g + (start + r) * H + i_h, mask=r < n, other=0.0).to(tl.float32)
    tl.store(gam + (start + r) * H + i_h, tl.cumsum(b_g, axis=0), mask=r < n)


def chunk_gamma(g: torch.Tensor, info: SeqInfo, chunk_size: int) -> torch.Tensor:
    """γ [.., TT, H] fp32: g summed from each chunk's first token to the token (chunks as the kernels cut them)."""
    gam = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    chunks = info.chunks(chunk_size)
    if chunks.num_chunks:
        launch(chunk_gamma_kernel, (chunks.num_chunks, g.shape[-1]), g, gam, info.cu_seqlens,
               chunks.chunk_indices, g.shape[-1], chunk_size, num_warps=1)
    return gam


@triton.jit
def load_gamma(gam, start, n, i_h, H: tl.constexpr, C: tl.constexpr):
    """(γ [C] of the chunk's rows, 0 past its end; γ_C, the last valid row's γ: the decay over the whole chunk).
    n: the tokens left in the sequence from start (C or more: a whole chunk)."""
    r = tl.arange(0, C)
    b_gam = tl.load(gam + (start + r) * H + i_h, mask=r < n, other=0.0)
    return b_gam, tl.sum(tl.where(r == tl.minimum(n, C) - 1, b_gam, 0.0), axis=0)


@triton.jit
def decay_matrix(b_gam_i, b_gam_j):
    """E_ij = exp(γ_i - γ_j) for j <= i; above the diagonal exp(0) = 1, which every caller masks away (clamping the
    exponent, not the result, keeps exp from overflowing there)."""
    return tl.exp(tl.minimum(b_gam_i[:, None] - b_gam_j[None, :], 0.0))
