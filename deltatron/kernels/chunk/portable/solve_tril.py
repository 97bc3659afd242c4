"""T~ = (I + A)^{-1} per chunk, A strictly lower triangular, grown by doubling in registers (DESIGN.md §2).

If T inverts the S-block diagonal part of I + A, then T - T E T (E: the blocks of A below the diagonal S-blocks
inside each diagonal 2S-block) inverts the 2S-block diagonal part. From T = I: S = 1, 2, 4, 8 on the C/16 diagonal
16-blocks taken out as a batch [C/16, 16, 16] (S = 1 needs no product: T = I - E), then S = 16, 32 on the whole
tile: 6 dependent levels instead of C - 1 row steps, all fp32. With tril_precision's tf32_newton (the 16-bit
default) the levels run in tf32 and one Newton step T <- T + T (I - (I + A) T) follows, its residual at fp32
accuracy (utils.mm_split_tf32); fp32 inputs run ieee (DESIGN.md §2, §8).

The kernel's time follows its instruction count more than its products: hence the product-free first level, the
one-compare block masks and the bit-mask split. tril_inverse works on register tiles so that fused kernels use it:
with FROM_K it builds A from K and beta and never stores it (wy.wy_fwd, parallel.py); without, it reads a stored fp32
A (ieee), as the tests' standalone stage does (tests/kernels/chunk/portable/stages.py)."""
from __future__ import annotations

import triton
import triton.language as tl

from ...utils import mm, mm_split_tf32, place_diagonal_blocks, take_diagonal_blocks
from .kkt import kkt_tile


@triton.jit
def below_diagonal_blocks(idx, S: tl.constexpr):
    """Mask [n, n] of the entries (idx[i], idx[j]) of a tile that lie below the diagonal S-blocks inside a diagonal
    2S-block: row S-block 2m + 1, column S-block 2m. One compare an entry (an odd row block against the column
    block + 1)."""
    block = idx // S
    odd_block = tl.where(block % 2 == 1, block, -1)
    return odd_block[:, None] == (block + 1)[None, :]


@triton.jit
def invert_diagonal_blocks(a, C: tl.constexpr, B: tl.constexpr, PRECISION: tl.constexpr):
    """(I + D)^{-1}, D the diagonal B-blocks of the strictly lower [C, C] fp32 tile a, as a block diagonal
    [C, C] tile. The C/B blocks are taken out as a batch [C/B, B, B] and inverted together by the same
    doubling as merge_diagonal_blocks (1-blocks are identities; each level T <- T - T E T doubles the
    block size), with batched products: log2(B) dependent levels, no per-row steps."""
    tl.static_assert(B == 16, "diagonal blocks are 16 x 16: four doubling levels")
    i = tl.arange(0, B)
    d = take_diagonal_blocks(a, B)
    # the first level (S = 1) needs no product: from T = I it gives T = I - E
    t = tl.where(i[:, None] == i[None, :], 1.0, 0.0)[None, :, :] - tl.where(below_diagonal_blocks(i, 1), d, 0.0)
    S: tl.constexpr = 2
    for _ in tl.static_range(0, 3):  # S = 2, 4, 8
        t = t - mm(t, mm(tl.where(below_diagonal_blocks(i, S), d, 0.0), t, PRECISION), PRECISION)
        S = S * 2
    return place_diagonal_blocks(t, C)


@triton.jit
def merge_diagonal_blocks(t, a, C: tl.constexpr, S: tl.constexpr, PRECISION: tl.constexpr):
    """From t = inverse of the S-block diagonal part of I + a to that of its 2S-block diagonal part:
    t - t e t, e = the blocks of a below the diagonal S-blocks inside each diagonal 2S-block."""
    r = tl.arange(0, C)
    return t - mm(t, mm(tl.where(below_diagonal_blocks(r, S), a, 0.0), t, PRECISION), PRECISION)


@triton.jit
def tril_inverse(a, k, beta, gam, n, H: tl.constexpr, HK: tl.constexpr, C: tl.constexpr, K: tl.constexpr,
                 BK: tl.constexpr, FROM_K: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr,
                 KKT_PREC: tl.constexpr, TRIL_PREC: tl.constexpr, NEWTON: tl.constexpr):
    """(I + A)^{-1} of one chunk as a [C, C] fp32 tile (C = 16, 32 or 64). a (or k, beta and, USE_G, gam: γ; USE_GK,
    gam: KDA's g: FROM_K) point at the chunk's first token and its head (k: its key head of HK); n = tokens in the
    chunk: rows past n come out as identity. KKT_PREC: dot precision of K K^T (FROM_K); TRIL_PREC: precision of the
    doubling products; NEWTON: one Newton step after them (tril_precision gives both)."""
    if FROM_K:
        b_a = kkt_tile(k, beta, gam, n, H, HK, 0, 0, C, C, K, BK, KKT_PREC, USE_G, USE_GK)
    else:
        r = tl.arange(0, C)
        b_a = tl.load(a + r[:, None] * (H * C) + r[None, :],
                      mask=(r[:, None] < n) & (r[None, :] < n) & (r[:, None] > r[None, :]), other=0.0)
    return unit_lower_inverse(b_a, C, TRIL_PREC, NEWTON)


@triton.jit
def unit_lower_inverse(b_a, C: tl.constexpr, TRIL_PREC: tl.constexpr, NEWTON: tl.constexpr):
    """(I + A)^{-1} of one chunk's strictly lower A [C, C] fp32 (a register tile), as tril_inverse says."""
    tl.static_assert(C == 16 or C == 32 or C == 64, "chunk size must be 16, 32 or 64")
    t = invert_diagonal_blocks(b_a, C, 16, TRIL_PREC)
    if C >= 32:
        t = merge_diagonal_blocks(t, b_a, C, 16, TRIL_PREC)
    if C == 64:
        t = merge_diagonal_blocks(t, b_a, C, 32, TRIL_PREC)
    if NEWTON:
        # T <- T + T R, R = I - (I + A) T: squares T's relative error. R is a small difference of O(1)
        # terms, so (I + A) T needs fp32 accuracy (three tf32 products); T R, a small correction, does not.
        r = tl.arange(0, C)
        residual = tl.where(r[:, None] == r[None, :], 1.0, 0.0) - t - mm_split_tf32(b_a, t)
        t = t + mm(t, residual, TRIL_PREC)
    return t
