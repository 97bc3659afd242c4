"""Stage 2 of the chunk forward: Tinv = (I + A)^{-1} per chunk, A strictly lower triangular (DESIGN.md §2).

The C x C inverse is built from 16 x 16 pieces: each diagonal 16-block is inverted by forward
substitution (cheap elementwise work on a small tile), then pairs of inverses are merged into 32 x 32 and
64 x 64 inverses by the block formula

    [[L11, 0], [A21, L22]]^{-1} = [[T11, 0], [T21, T22]],   T21 = -T22 A21 T11,

which is all matrix products. Everything stays fp32; the merge products run at tril_precision().

The jit helpers (invert_unit_lower_16, merge_lower, tril_inverse) work on register tiles so that fused
kernels can use them: tril_inverse(FROM_K=True) builds the A tiles it needs straight from K and beta and
never materializes A (wy.wy_fwd does this)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import PIPELINE_STAGES, SeqInfo, mm, tril_precision
from .kkt import chunk_span, kkt_tile


@triton.jit
def invert_unit_lower_16(a):
    """(I + a)^{-1} for a strictly lower triangular [16, 16] fp32 tile, by forward substitution:
    row i of the inverse is e_i - sum_{j<i} a_ij t_j, and rows j < i are final when row i is formed."""
    r = tl.arange(0, 16)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    t = eye
    for i in range(1, 16):
        a_i = tl.sum(tl.where(r[:, None] == i, a, 0.0), axis=0)  # row i of a, indexed by j
        t_i = tl.sum(a_i[:, None] * t, axis=0)  # sum_j a_ij t_j
        t = tl.where(r[:, None] == i, eye - t_i[None, :], t)
    return t


@triton.jit
def hcat(x, y):
    """[x, y] side by side."""
    return tl.reshape(tl.permute(tl.join(x, y), (0, 2, 1)), (x.shape[0], 2 * x.shape[1]))


@triton.jit
def vcat(x, y):
    """[x; y] stacked."""
    return tl.reshape(tl.permute(tl.join(x, y), (2, 0, 1)), (2 * x.shape[0], x.shape[1]))


@triton.jit
def merge_lower(t11, t22, a21, PRECISION: tl.constexpr):
    """Inverse of the unit lower triangular [[I + A11, 0], [A21, I + A22]] from t11 = (I + A11)^{-1} and
    t22 = (I + A22)^{-1}: [[t11, 0], [-t22 a21 t11, t22]], a tile twice the size."""
    t21 = -mm(t22, mm(a21, t11, PRECISION), PRECISION)
    return vcat(hcat(t11, tl.zeros_like(t11)), hcat(t21, t22))


@triton.jit
def a_tile(a, k, beta, n, H: tl.constexpr, I0: tl.constexpr, J0: tl.constexpr, B: tl.constexpr,
           C: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, FROM_K: tl.constexpr, KKT_PREC: tl.constexpr):
    """The [B, B] tile of A at rows I0, columns J0 of one chunk: computed from k and beta (FROM_K) or
    loaded from a; zero at rows and columns >= n, strictly lower on the diagonal."""
    if FROM_K:
        tile = kkt_tile(k, beta, n, H, I0, J0, B, B, K, BK, KKT_PREC)
    else:
        i = I0 + tl.arange(0, B)
        j = J0 + tl.arange(0, B)
        mask = (i[:, None] < n) & (j[None, :] < n)
        if I0 == J0:
            mask = mask & (i[:, None] > j[None, :])
        tile = tl.load(a + i[:, None] * (H * C) + j[None, :], mask=mask, other=0.0)
    return tile


@triton.jit
def inverse_16(a, k, beta, n, H: tl.constexpr, I0: tl.constexpr, C: tl.constexpr, K: tl.constexpr,
               BK: tl.constexpr, FROM_K: tl.constexpr, KKT_PREC: tl.constexpr):
    """Inverse of the diagonal 16-block of I + A at row I0."""
    return invert_unit_lower_16(a_tile(a, k, beta, n, H, I0, I0, 16, C, K, BK, FROM_K, KKT_PREC))


@triton.jit
def inverse_32(a, k, beta, n, H: tl.constexpr, I0: tl.constexpr, C: tl.constexpr, K: tl.constexpr,
               BK: tl.constexpr, FROM_K: tl.constexpr, KKT_PREC: tl.constexpr, TRIL_PREC: tl.constexpr):
    """Inverse of the diagonal 32-block of I + A at row I0."""
    t11 = inverse_16(a, k, beta, n, H, I0, C, K, BK, FROM_K, KKT_PREC)
    t22 = inverse_16(a, k, beta, n, H, I0 + 16, C, K, BK, FROM_K, KKT_PREC)
    a21 = a_tile(a, k, beta, n, H, I0 + 16, I0, 16, C, K, BK, FROM_K, KKT_PREC)
    return merge_lower(t11, t22, a21, TRIL_PREC)


@triton.jit
def tril_inverse(a, k, beta, n, H: tl.constexpr, C: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                 FROM_K: tl.constexpr, KKT_PREC: tl.constexpr, TRIL_PREC: tl.constexpr):
    """(I + A)^{-1} of one chunk as a [C, C] fp32 tile (C = 16, 32 or 64). a (or k and beta, FROM_K) point
    at the chunk's first token and its head; n = tokens in the chunk: rows past n come out as identity.
    KKT_PREC: dot precision of K K^T (FROM_K); TRIL_PREC: precision of the merge products."""
    if C == 16:
        t = inverse_16(a, k, beta, n, H, 0, C, K, BK, FROM_K, KKT_PREC)
    elif C == 32:
        t = inverse_32(a, k, beta, n, H, 0, C, K, BK, FROM_K, KKT_PREC, TRIL_PREC)
    else:
        tl.static_assert(C == 64, "chunk size must be 16, 32 or 64")
        t11 = inverse_32(a, k, beta, n, H, 0, C, K, BK, FROM_K, KKT_PREC, TRIL_PREC)
        t22 = inverse_32(a, k, beta, n, H, 32, C, K, BK, FROM_K, KKT_PREC, TRIL_PREC)
        a21 = a_tile(a, k, beta, n, H, 32, 0, 32, C, K, BK, FROM_K, KKT_PREC)
        t = merge_lower(t11, t22, a21, TRIL_PREC)
    return t


@triton.jit
def solve_tril_kernel(a, tinv, cu_seqlens, chunk_indices, H: tl.constexpr, C: tl.constexpr,
                      TRIL_PREC: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start, n = chunk_span(cu_seqlens, chunk_indices, i_c, C)
    offset = start * H * C + i_h * C
    # FROM_K=False: k, beta and K are unused, a stands in for them
    b_t = tril_inverse(a + offset, a, a, n, H, C, 16, 16, False, "ieee", TRIL_PREC)
    rows = tl.arange(0, C)
    tl.store(tinv + offset + rows[:, None] * (H * C) + rows[None, :], b_t, mask=rows[:, None] < n)


def solve_tril(A: torch.Tensor, info: SeqInfo, chunk_size: int) -> torch.Tensor:
    """Tinv = (I + A)^{-1} per chunk from A [B, T, H, C] fp32 (strictly lower; entries on and above the
    diagonal are ignored). Returns [B, T, H, C] fp32; in a short last chunk the columns past the sequence
    end are zero."""
    H = A.shape[2]
    tinv = torch.empty_like(A)
    chunks = info.chunks(chunk_size)
    if chunks.num_chunks:
        solve_tril_kernel[(chunks.num_chunks, H)](
            A, tinv, info.cu_seqlens, chunks.chunk_indices, H, chunk_size, tril_precision(),
            num_warps=4, num_stages=PIPELINE_STAGES,
        )
    return tinv
