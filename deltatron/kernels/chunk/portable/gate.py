"""The gated rule's log decays inside a chunk (DESIGN.md §11): γ, the cumulative sum of g from the chunk's start, the
decay factors the stages take from it under their USE_G constexpr, and the gradient of g back through the sum.

The stages write their shares of that gradient per row and per K-tile, and the sums across tiles happen here in a
fixed order, so that dg is bitwise the same from run to run, as every other gradient is.

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


@triton.jit
def gate_grad_kernel(dgam, dg_rows, dg_chunks, dg, cu_seqlens, chunk_indices, TT, NT, H: tl.constexpr,
                     C: tl.constexpr, NK: tl.constexpr, NS: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start, n = chunk_span(cu_seqlens, chunk_indices, i_c, C)
    r = tl.arange(0, C)
    rows = start + r
    valid = r < n
    b_dgam = tl.load(dgam + rows * H + i_h, mask=valid, other=0.0)
    b_x = tl.zeros([C], dtype=tl.float32)
    b_state = tl.zeros([NS], dtype=tl.float32)
    for i_k in tl.static_range(NK):  # grads.dqkw's K-tile shares, in a fixed order
        b_dgam += tl.load(dg_rows + ((i_k * 2) * TT + rows) * H + i_h, mask=valid, other=0.0)
        b_x += tl.load(dg_rows + ((i_k * 2 + 1) * TT + rows) * H + i_h, mask=valid, other=0.0)
        b_state += tl.load(dg_chunks + ((i_k * NT + i_c) * H + i_h) * NS + tl.arange(0, NS))
    # dg_j = sum_{i >= j} dγ_i + exp(γ_C) <S, dS_next> + sum_{i < j} x_i
    b_dg = tl.cumsum(b_dgam, axis=0, reverse=True) + tl.sum(b_state, axis=0) + (tl.cumsum(b_x, axis=0) - b_x)
    tl.store(dg + rows * H + i_h, b_dg, mask=valid)


def gate_grad(dgam: torch.Tensor, shares, info: SeqInfo, chunk_size: int) -> torch.Tensor:
    """dg [.., TT, H] fp32: the gradient of g, from the per-row dγ (portable.wy_bwd's share, dgam) and grads.dqkw's
    K-tile shares (dg_rows [NK, 2, TT, H]: dγ and x_i = exp(γ_C - γ_i) k_i^T dS_next v'_i; dg_chunks [NK, NT, H, NS]:
    exp(γ_C) <S, dS_next> in NS parts), by DESIGN.md §11: the reverse sum of dγ along the chunk (γ_i sums g_j for
    j <= i), the state's share for every token, and x_i for the tokens after i."""
    dg_rows, dg_chunks = shares
    dg = torch.empty_like(dgam)
    chunks = info.chunks(chunk_size)
    if chunks.num_chunks:
        launch(gate_grad_kernel, (chunks.num_chunks, dgam.shape[-1]), dgam, dg_rows, dg_chunks, dg, info.cu_seqlens,
               chunks.chunk_indices, info.total_tokens, chunks.num_chunks, dgam.shape[-1], chunk_size,
               dg_rows.shape[0], dg_chunks.shape[-1], num_warps=1)
    return dg
