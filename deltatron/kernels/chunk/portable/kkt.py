"""A = tril(diag(beta) K K^T, -1) per chunk (DESIGN.md §2), and the chunk bookkeeping the portable kernels share.

A is [B, T, H, C] fp32 (packed: [1, TT, H, C]): row i of a chunk holds A[i, :] at the row of token i. The forward
does not launch this stage: wy.wy_fwd builds A on chip through kkt_tile and never stores it (the tests launch it
apart to check each stage: tests/kernels/chunk/portable/stages.py)."""
from __future__ import annotations

import triton
import triton.language as tl

from ...utils import mm


@triton.jit
def chunk_span(cu_seqlens, chunk_indices, i_c, C: tl.constexpr):
    """(first token, number of tokens) of global chunk i_c. Chunks never cross sequences: the last chunk
    of a sequence may hold fewer than C tokens."""
    seq = tl.load(chunk_indices + 2 * i_c)
    local = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    eos = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    start = bos + local * C
    return start, tl.minimum(eos - start, C)


@triton.jit
def kkt_tile(k, beta, n, H: tl.constexpr, I0: tl.constexpr, J0: tl.constexpr, BI: tl.constexpr,
             BJ: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    """Rows I0..I0+BI, columns J0..J0+BJ of A = tril(diag(beta) K K^T, -1) of one chunk, fp32.

    k, beta point at the chunk's first token and its head; rows and columns at or past n (the end of the
    sequence) are zero, so a short last chunk leaves A zero there. Diagonal tiles (I0 == J0) keep i > j."""
    i = I0 + tl.arange(0, BI)
    j = J0 + tl.arange(0, BJ)
    acc = tl.zeros([BI, BJ], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        b_ki = tl.load(k + i[:, None] * (H * K) + cols[None, :], mask=(i[:, None] < n) & (cols[None, :] < K),
                       other=0.0)
        if I0 == J0:
            b_kj = b_ki
        else:
            b_kj = tl.load(k + j[:, None] * (H * K) + cols[None, :],
                           mask=(j[:, None] < n) & (cols[None, :] < K), other=0.0)
        acc += mm(b_ki, tl.trans(b_kj), PRECISION)
    # beta scales rows after the fp32 dot, so 16-bit inputs are not rounded twice
    b_beta = tl.load(beta + i * H, mask=i < n, other=0.0).to(tl.float32)
    acc = acc * b_beta[:, None]
    if I0 == J0:
        acc = tl.where(i[:, None] > j[None, :], acc, 0.0)
    return acc
