"""A = tril(diag(beta) K K^T, -1) per chunk (DESIGN.md §2).

Gated (USE_G, DESIGN.md §11): A_ij = beta_i exp(γ_i - γ_j) k_i^T k_j; per-channel gate (USE_GK, KDA, DESIGN.md §12):
A_ij = beta_i sum_c k_ic k_jc exp(Γ_i - Γ_j)[c], by gate.channel_scores over sub-chunks. Grouped value heads: A is per
value head (beta and γ are), from the keys of its key head. A is [B, T, H, C] fp32 (packed: [1, TT, H, C]): row i of
a chunk holds A[i, :] at the row of token i. The forward does not launch this stage: wy.wy_fwd builds A on chip
through kkt_tile and never stores it (the tests launch it apart to check each stage:
tests/kernels/chunk/portable/stages.py)."""
from __future__ import annotations

import triton
import triton.language as tl

from ...utils import mm
from .gate import SUM_PLANES, channel_score_pair, channel_scores, decay_matrix


@triton.jit
def kkt_tile(k, beta, gam, n, H: tl.constexpr, HK: tl.constexpr, I0: tl.constexpr, J0: tl.constexpr,
             BI: tl.constexpr, BJ: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
             USE_G: tl.constexpr, USE_GK: tl.constexpr):
    """Rows I0..I0+BI, columns J0..J0+BJ of A = tril(diag(beta) K K^T, -1) of one chunk, fp32 (USE_G: times
    exp(γ_i - γ_j); USE_GK: the per-channel decays inside the sum over channels, gam then pointing at the gate's
    planes, gate.gate_rows).

    k points at the chunk's first token and its key head (HK heads), beta and gam (γ, USE_G) at its value head (H
    heads); rows and columns at or past n (the end of the sequence) are zero, so a short last chunk leaves A zero
    there. Diagonal tiles (I0 == J0) keep i > j."""
    i = I0 + tl.arange(0, BI)
    j = J0 + tl.arange(0, BJ)
    if USE_GK:
        tl.static_assert(I0 == 0 and J0 == 0 and BI == BJ, "the per-channel gate's A is built a whole chunk at once")
        acc = channel_scores(None, k, gam, n, HK * K, HK * K, SUM_PLANES * H * K, K, BI, False, PRECISION)
    else:
        acc = tl.zeros([BI, BJ], dtype=tl.float32)
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            b_ki = tl.load(k + i[:, None] * (HK * K) + cols[None, :], mask=(i[:, None] < n) & (cols[None, :] < K),
                           other=0.0)
            if I0 == J0:
                b_kj = b_ki
            else:
                b_kj = tl.load(k + j[:, None] * (HK * K) + cols[None, :],
                               mask=(j[:, None] < n) & (cols[None, :] < K), other=0.0)
            acc += mm(b_ki, tl.trans(b_kj), PRECISION)
    acc = beta_rows(acc, beta, i, n, H)
    if USE_G:
        acc *= decay_matrix(tl.load(gam + i * H, mask=i < n, other=0.0), tl.load(gam + j * H, mask=j < n, other=0.0))
    if I0 == J0:
        acc = tl.where(i[:, None] > j[None, :], acc, 0.0)
    return acc


@triton.jit
def beta_rows(acc, beta, i, n, H: tl.constexpr):
    """diag(beta) acc for the rows i of a tile: beta scales rows after the fp32 dot, so 16-bit inputs are not rounded
    twice."""
    return acc * tl.load(beta + i * H, mask=i < n, other=0.0).to(tl.float32)[:, None]


@triton.jit
def kkt_scores_tile(k, q, beta, gs, n, H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                    PRECISION: tl.constexpr):
    """KDA's A of one chunk (kkt_tile's, USE_GK) and the output's scores P = sum_c q_ic k_jc exp(Γ_i - Γ_j)[c] for
    j <= i (0 above), both [C, C] fp32 from one pass over the channels (gate.channel_score_pair: K's decayed columns
    formed once for both). q points as k does (its key head); gs at the gate's planes (gate.gate_rows)."""
    b_a, b_p = channel_score_pair(None, q, k, gs, n, HK * K, HK * K, HK * K, SUM_PLANES * H * K, K, C, True, PRECISION)
    i = tl.arange(0, C)
    b_a = tl.where(i[:, None] > i[None, :], beta_rows(b_a, beta, i, n, H), 0.0)
    return b_a, tl.where(i[:, None] >= i[None, :], b_p, 0.0)
