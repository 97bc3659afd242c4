"""parallel_delta_rule in Triton: the whole sequence as one chunk (O(T^2) work and memory; DESIGN.md §5).

Per (sequence, head), rows stacked over all L tokens, Q~ = scale Q, L = I + A, A = tril(diag(beta) K K^T, -1):
    V' = L^{-1} diag(beta) (V - K S0)  (= U - W S0 of DESIGN.md §2, the sequence as the chunk),
    o = Q~ S0 + (Q~ K^T ⊙ M) V',   S_final = S0 + K^T V',   P = (Q~ K^T ⊙ M) L^{-1} diag(beta).
The tokens are cut into row blocks of BT; only the diagonal blocks Tinv_ii of L^{-1} are formed (solve_tril's
tril_inverse, from K and beta), and everything else is a blocked triangular solve: V' by forward substitution over
row blocks (vnew kernel, serial over blocks), o parallel over row blocks (output kernel), P row block by row block
(attention kernel: the rank-K structure of A turns the update sum_{m>j} P~_im A_mj into R K_j^T). Backward: dX =
L^{-T} dV' by back substitution (dx kernel, also dv = diag(beta) dX and dS0), then dA = strictly_lower(-dX V'^T)
(DESIGN.md §4's dA with the sequence as the chunk) and dq, dk, dbeta parallel over row blocks (dqk kernel).

The forward saves Tinv_ii and V' (fp32); there are no atomics, so results are deterministic."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk.portable.solve_tril import tril_inverse
from .launch import launch
from .utils import cdiv, chunk_span, dot_precision, head_block, load_tile, mm, store_tile, tril_precision

# No software pipelining: on the H200 (triton 3.6) depths 2 and 3 run out of shared memory at K = 64-128
# in 16-bit, and 1 is right for these kernels.
NUM_STAGES = 1


def block_size(K: int) -> int:
    """Row block BT (a chunk size of solve_tril): 64, or 32 when a row of K no longer fits next to it."""
    return 64 if head_block(K) <= 128 else 32


# ---- tile access: a row view x[L, D] of one (sequence, head), `stride` elements per row ------------------

@triton.jit
def load_beta(beta, row0, n_rows, H, BT: tl.constexpr):
    rows = row0 + tl.arange(0, BT)
    return tl.load(beta + rows.to(tl.int64) * H, mask=rows < n_rows, other=0.0).to(tl.float32)


@triton.jit
def load_tinv(tinv, i, n_rows, H, BT: tl.constexpr):
    """Tinv_ii = (I + A_ii)^{-1} of row block i (lower triangular; zero outside the sequence)."""
    rows = i * BT + tl.arange(0, BT)
    cols = i * BT + tl.arange(0, BT)
    mask = (rows[:, None] < n_rows) & (cols[None, :] <= rows[:, None])
    offs = rows[:, None].to(tl.int64) * (H * BT) + tl.arange(0, BT)[None, :]
    return tl.load(tinv + offs, mask=mask, other=0.0)


@triton.jit
def causal(i, j, BT: tl.constexpr, STRICT: tl.constexpr):
    """Mask of block (i, j): token of row >= token of column (> when STRICT)."""
    rows = i * BT + tl.arange(0, BT)
    cols = j * BT + tl.arange(0, BT)
    if STRICT:
        return rows[:, None] > cols[None, :]
    else:
        return rows[:, None] >= cols[None, :]


@triton.jit
def sequence(cu_seqlens, i_n):
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return bos, (eos - bos).to(tl.int32)


# ---- forward ---------------------------------------------------------------------------------------------

@triton.jit
def parallel_fwd_tinv_kernel(k, beta, tinv, cu_seqlens, chunk_indices, H: tl.constexpr, K: tl.constexpr,
                             BT: tl.constexpr, BK: tl.constexpr, KKT_PREC: tl.constexpr, TRIL_PREC: tl.constexpr,
                             NEWTON: tl.constexpr):
    """Tinv_ii = (I + A_ii)^{-1} of one row block, [BT, BT] fp32 stored at the rows of its tokens."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start, n = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    # FROM_K=True: A_ii is built on chip from k and beta, the a and gam arguments are unused (k stands in)
    b_t = tril_inverse(k, k + start * H * K + i_h * K, beta + start * H + i_h, k, n, H, H, BT, K, BK, True, False,
                       False, KKT_PREC, TRIL_PREC, NEWTON)
    rows = tl.arange(0, BT)
    tl.store(tinv + (start + rows[:, None]) * (H * BT) + i_h * BT + rows[None, :], b_t, mask=rows[:, None] < n)


@triton.jit
def parallel_fwd_vnew_kernel(
    k, v, beta, tinv, h0, v_new, ht, cu_seqlens,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PRECISION: tl.constexpr,
):
    """V'[:, block of V] of one (sequence, head) by forward substitution over row blocks, and S_final."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L = sequence(cu_seqlens, i_n)
    k += bos * H * K + i_h * K
    v += bos * H * V + i_h * V
    v_new += bos * H * V + i_h * V
    beta += bos * H + i_h
    tinv += bos * H * BT + i_h * BT
    c0 = i_v * BV

    b_s0 = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_s0 = load_tile(h0 + i_nh.to(tl.int64) * K * V, 0, K, V, c0, V, BK, BV).to(tl.float32)
    b_dS = tl.zeros([BK, BV], dtype=tl.float32)  # K^T V' so far
    for i in range(0, tl.cdiv(L, BT)):
        b_ki = load_tile(k, i * BT, L, H * K, 0, K, BT, BK)
        # R_i = V_i - K_i S0 - sum_{j<i} (K_i K_j^T) V'_j, then X_i - sum_j A_ij V'_j = beta_i R_i
        b_r = load_tile(v, i * BT, L, H * V, c0, V, BT, BV).to(tl.float32)
        if HAS_H0:
            b_r -= mm(b_ki.to(tl.float32), b_s0, PRECISION)
        for j in range(0, i):
            b_kk = mm(b_ki, tl.trans(load_tile(k, j * BT, L, H * K, 0, K, BT, BK)), PRECISION)
            b_r -= mm(b_kk, load_tile(v_new, j * BT, L, H * V, c0, V, BT, BV), PRECISION)
        b_x = load_beta(beta, i * BT, L, H, BT)[:, None] * b_r
        b_vn = mm(load_tinv(tinv, i, L, H, BT), b_x, PRECISION)
        store_tile(v_new, b_vn, i * BT, L, H * V, c0, V, BT, BV)
        # later blocks read this one back: make the stores visible to every thread of the program
        tl.debug_barrier()
        if STORE_HT:
            b_dS += mm(tl.trans(b_ki.to(tl.float32)), b_vn, PRECISION)
    if STORE_HT:
        store_tile(ht + i_nh.to(tl.int64) * K * V, b_s0 + b_dS, 0, K, V, c0, V, BK, BV)


@triton.jit
def parallel_fwd_o_kernel(
    q, k, v_new, h0, o, cu_seqlens, chunk_indices, scale,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, PRECISION: tl.constexpr,
):
    """o_i = scale (Q_i S0 + sum_{j<=i} (Q_i K_j^T ⊙ M) V'_j) for one row block and block of V."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n = tl.load(chunk_indices + 2 * i_c)
    i = tl.load(chunk_indices + 2 * i_c + 1)
    bos, L = sequence(cu_seqlens, i_n)
    q += bos * H * K + i_h * K
    k += bos * H * K + i_h * K
    v_new += bos * H * V + i_h * V
    o += bos * H * V + i_h * V
    c0 = i_v * BV

    b_qi = load_tile(q, i * BT, L, H * K, 0, K, BT, BK)
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    if HAS_H0:
        b_s0 = load_tile(h0 + (i_n * H + i_h).to(tl.int64) * K * V, 0, K, V, c0, V, BK, BV).to(tl.float32)
        b_o = mm(b_qi.to(tl.float32), b_s0, PRECISION)
    for j in range(0, i + 1):
        b_qk = mm(b_qi, tl.trans(load_tile(k, j * BT, L, H * K, 0, K, BT, BK)), PRECISION)
        b_qk = tl.where(causal(i, j, BT, False), b_qk, 0.0)
        b_o += mm(b_qk, load_tile(v_new, j * BT, L, H * V, c0, V, BT, BV), PRECISION)
    store_tile(o, scale * b_o, i * BT, L, H * V, c0, V, BT, BV)


@triton.jit
def parallel_fwd_attn_kernel(
    q, k, beta, tinv, attn, cu_seqlens, chunk_indices, scale, T,
    H, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    """Row block i of P = scale (Q K^T ⊙ M) L^{-1} diag(beta), i.e. of P~ L = scale (Q K^T ⊙ M), solved
    from the diagonal block leftwards: P~_ij = (scale (Q_i K_j^T ⊙ M) - R K_j^T) Tinv_jj with
    R = sum_{m>j} P_im K_m (A_mj = diag(beta_m) K_m K_j^T), P_ij = P~_ij diag(beta_j)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_c)
    i = tl.load(chunk_indices + 2 * i_c + 1)
    bos, L = sequence(cu_seqlens, i_n)
    q += bos * H * K + i_h * K
    k += bos * H * K + i_h * K
    beta += bos * H + i_h
    tinv += bos * H * BT + i_h * BT
    # P is [B, H, T, T]; the sequence is the diagonal block at (b, r0) with bos = b T + r0
    b = bos // T
    r0 = bos - b * T
    attn += (b * H + i_h) * T * T + r0 * T + r0

    b_qi = load_tile(q, i * BT, L, H * K, 0, K, BT, BK)
    b_r = tl.zeros([BT, BK], dtype=tl.float32)
    for jj in range(0, i + 1):
        j = i - jj
        b_kj = load_tile(k, j * BT, L, H * K, 0, K, BT, BK)
        b_g = scale * tl.where(causal(i, j, BT, False), mm(b_qi, tl.trans(b_kj), PRECISION), 0.0)
        b_kj = b_kj.to(tl.float32)
        b_g -= mm(b_r, tl.trans(b_kj), PRECISION)
        b_p = mm(b_g, load_tinv(tinv, j, L, H, BT), PRECISION) * load_beta(beta, j * BT, L, H, BT)[None, :]
        store_tile(attn, b_p, i * BT, L, T, j * BT, L, BT, BT)
        b_r += mm(b_p, b_kj, PRECISION)


# ---- backward --------------------------------------------------------------------------------------------

@triton.jit
def parallel_bwd_dx_kernel(
    q, k, beta, tinv, do, dht, dx, dv, dh0, cu_seqlens, scale,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PRECISION: tl.constexpr,
):
    """dX = L^{-T} dV' by back substitution over row blocks (one block of V), dv = diag(beta) dX and
    dS0 = dS_final + Q~^T dO - K^T diag(beta) dX."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L = sequence(cu_seqlens, i_n)
    q += bos * H * K + i_h * K
    k += bos * H * K + i_h * K
    beta += bos * H + i_h
    tinv += bos * H * BT + i_h * BT
    do += bos * H * V + i_h * V
    dx += bos * H * V + i_h * V
    dv += bos * H * V + i_h * V
    c0 = i_v * BV

    b_dht = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        b_dht = load_tile(dht + i_nh.to(tl.int64) * K * V, 0, K, V, c0, V, BK, BV)
    b_dh0 = b_dht
    nb = tl.cdiv(L, BT)
    for ii in range(0, nb):
        i = nb - 1 - ii
        b_ki = load_tile(k, i * BT, L, H * K, 0, K, BT, BK)
        b_qi = load_tile(q, i * BT, L, H * K, 0, K, BT, BK)
        b_doi = load_tile(do, i * BT, L, H * V, c0, V, BT, BV).to(tl.float32)
        # dV'_i = K_i dS_final + sum_{m>=i} (Q~_m K_i^T ⊙ M)^T dO_m; minus sum_{m>i} A_mi^T dX_m
        b_qk = scale * tl.where(causal(i, i, BT, False), mm(b_qi, tl.trans(b_ki), PRECISION), 0.0)
        b_r = mm(tl.trans(b_qk), b_doi, PRECISION)
        if HAS_DHT:
            b_r += mm(b_ki.to(tl.float32), b_dht, PRECISION)
        for m in range(i + 1, nb):
            b_km = load_tile(k, m * BT, L, H * K, 0, K, BT, BK)
            b_qk = scale * mm(load_tile(q, m * BT, L, H * K, 0, K, BT, BK), tl.trans(b_ki), PRECISION)
            b_r += mm(tl.trans(b_qk), load_tile(do, m * BT, L, H * V, c0, V, BT, BV).to(tl.float32), PRECISION)
            b_bdx = load_beta(beta, m * BT, L, H, BT)[:, None] * load_tile(dx, m * BT, L, H * V, c0, V, BT, BV)
            b_r -= mm(mm(b_ki, tl.trans(b_km), PRECISION), b_bdx, PRECISION)
        b_dx = mm(tl.trans(load_tinv(tinv, i, L, H, BT)), b_r, PRECISION)
        store_tile(dx, b_dx, i * BT, L, H * V, c0, V, BT, BV)
        # earlier blocks read this one back: make the stores visible to every thread of the program
        tl.debug_barrier()
        b_bdx = load_beta(beta, i * BT, L, H, BT)[:, None] * b_dx
        store_tile(dv, b_bdx, i * BT, L, H * V, c0, V, BT, BV)
        if STORE_DH0:
            b_dh0 += mm(tl.trans(scale * b_qi.to(tl.float32)), b_doi, PRECISION)
            b_dh0 -= mm(tl.trans(b_ki.to(tl.float32)), b_bdx, PRECISION)
    if STORE_DH0:
        store_tile(dh0 + i_nh.to(tl.int64) * K * V, b_dh0, 0, K, V, c0, V, BK, BV)


@triton.jit
def dots_over_v(x, y, z, a, b, L, stride, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                PRECISION: tl.constexpr):
    """(X_a Z_b^T, Y_a Z_b^T) for row blocks a of X, Y and b of Z ([L, V] row views), over V in steps of BV."""
    b_xz = tl.zeros([BT, BT], dtype=tl.float32)
    b_yz = tl.zeros([BT, BT], dtype=tl.float32)
    for c0 in range(0, V, BV):
        b_zt = tl.trans(load_tile(z, b * BT, L, stride, c0, V, BT, BV))
        b_xz += mm(load_tile(x, a * BT, L, stride, c0, V, BT, BV).to(tl.float32), b_zt, PRECISION)
        b_yz += mm(load_tile(y, a * BT, L, stride, c0, V, BT, BV), b_zt, PRECISION)
    return b_xz, b_yz


@triton.jit
def parallel_bwd_dqk_kernel(
    q, k, v, beta, v_new, do, dx, h0, dht, dq, dk, dbeta, cu_seqlens, chunk_indices, scale,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, HAS_DHT: tl.constexpr, PRECISION: tl.constexpr,
):
    """dq, dk, dbeta of row block i, pairing it with every block j of its sequence:
      j <= i: dQ~_i += (dO_i V'_j^T ⊙ M) K_j;  dA_ij = -(dX_i V'_j^T) strictly lower:
              dk_i += diag(beta_i) dA_ij K_j,  dbeta_i += rowsum(dA_ij ⊙ K_i K_j^T)
      j >= i: dk_i += (dO_j V'_i^T ⊙ M)^T Q~_j + (diag(beta_j) dA_ji)^T K_j
    plus the terms of S0 and dS_final: dQ~_i += dO_i S0^T, dk_i += V'_i dS_final^T - diag(beta_i) dX_i S0^T,
    dbeta_i += rowsum(dX_i ⊙ (V_i - K_i S0))."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_c)
    i = tl.load(chunk_indices + 2 * i_c + 1)
    bos, L = sequence(cu_seqlens, i_n)
    q += bos * H * K + i_h * K
    k += bos * H * K + i_h * K
    dq += bos * H * K + i_h * K
    dk += bos * H * K + i_h * K
    v += bos * H * V + i_h * V
    v_new += bos * H * V + i_h * V
    do += bos * H * V + i_h * V
    dx += bos * H * V + i_h * V
    beta += bos * H + i_h
    dbeta += bos * H + i_h
    i_nh = (i_n * H + i_h).to(tl.int64)

    b_ki = load_tile(k, i * BT, L, H * K, 0, K, BT, BK)
    b_bi = load_beta(beta, i * BT, L, H, BT)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for j in range(0, i + 1):
        b_kj = load_tile(k, j * BT, L, H * K, 0, K, BT, BK)
        b_dov, b_da = dots_over_v(do, dx, v_new, i, j, L, H * V, V, BT, BV, PRECISION)
        b_dov = tl.where(causal(i, j, BT, False), b_dov, 0.0)
        b_da = tl.where(causal(i, j, BT, True), -b_da, 0.0)
        b_dq += mm(b_dov, b_kj.to(tl.float32), PRECISION)
        b_dk += b_bi[:, None] * mm(b_da, b_kj.to(tl.float32), PRECISION)
        b_db += tl.sum(b_da * mm(b_ki, tl.trans(b_kj), PRECISION), axis=1)
    for j in range(i, tl.cdiv(L, BT)):
        b_kj = load_tile(k, j * BT, L, H * K, 0, K, BT, BK).to(tl.float32)
        b_qj = load_tile(q, j * BT, L, H * K, 0, K, BT, BK).to(tl.float32)
        b_dov, b_da = dots_over_v(do, dx, v_new, j, i, L, H * V, V, BT, BV, PRECISION)
        b_dov = tl.where(causal(j, i, BT, False), scale * b_dov, 0.0)
        b_da = tl.where(causal(j, i, BT, True), -load_beta(beta, j * BT, L, H, BT)[:, None] * b_da, 0.0)
        b_dk += mm(tl.trans(b_dov), b_qj, PRECISION) + mm(tl.trans(b_da), b_kj, PRECISION)
    # the state terms and beta's part in X, over V in steps of BV
    for c0 in range(0, V, BV):
        b_dxi = load_tile(dx, i * BT, L, H * V, c0, V, BT, BV)
        b_res = load_tile(v, i * BT, L, H * V, c0, V, BT, BV).to(tl.float32)
        if HAS_H0:
            b_s0 = load_tile(h0 + i_nh * K * V, 0, K, V, c0, V, BK, BV).to(tl.float32)
            b_doi = load_tile(do, i * BT, L, H * V, c0, V, BT, BV).to(tl.float32)
            b_dq += mm(b_doi, tl.trans(b_s0), PRECISION)
            b_dk -= b_bi[:, None] * mm(b_dxi, tl.trans(b_s0), PRECISION)
            b_res -= mm(b_ki.to(tl.float32), b_s0, PRECISION)
        if HAS_DHT:
            b_dht = load_tile(dht + i_nh * K * V, 0, K, V, c0, V, BK, BV)
            b_dk += mm(load_tile(v_new, i * BT, L, H * V, c0, V, BT, BV), tl.trans(b_dht), PRECISION)
        b_db += tl.sum(b_dxi * b_res, axis=1)
    store_tile(dq, scale * b_dq, i * BT, L, H * K, 0, K, BT, BK)
    store_tile(dk, b_dk, i * BT, L, H * K, 0, K, BT, BK)
    rows = i * BT + tl.arange(0, BT)
    tl.store(dbeta + rows.to(tl.int64) * H, b_db, mask=rows < L)


# ---- host side -------------------------------------------------------------------------------------------

def _config(q, v):
    """K, V, BK, BT, BV and the warps of the kernels that hold [BT, BK] or [BK, BV] fp32 accumulators."""
    K, V = q.shape[-1], v.shape[-1]
    BK = head_block(K)
    BV = min(64 if BK <= 128 else 32, head_block(V))
    return K, V, BK, block_size(K), BV, 4 if BK <= 64 else 8


def _precision(dtype: torch.dtype) -> str:
    """Precision of the dots with fp32 operands (16-bit tiles are widened to meet them). V', dX, the state
    and P are fp32 intermediates that feed long sums with cancellation (the state is much smaller than the
    sum of its |k v'^T| terms): at T = 256, rounding them to bf16 costs ~4e-3 relative error on the
    state and gradients, truncating them to tf32 ~1.5e-3 with fp16 inputs (bounds 1e-2 and 3e-3), against
    the output rounding alone with tf32x3, which keeps fp32 accuracy on the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32x3"


def forward(q, k, v, beta, scale, initial_state, output_final_state, info, needs_backward=True,
            output_attentions=False):
    """Contract of deltatron.autograd. Saves Tinv and V', both computed by the forward anyway (needs_backward
    changes nothing)."""
    B, T, H = q.shape[:3]
    K, V, BK, BT, BV, warps = _config(q, v)
    N = info.num_seqs
    precision = _precision(q.dtype)
    chunks = info.chunks(BT)
    tinv = k.new_empty(*k.shape[:3], BT, dtype=torch.float32)
    if chunks.num_chunks:
        launch(
            parallel_fwd_tinv_kernel, (chunks.num_chunks, H),
            k, beta, tinv, info.cu_seqlens, chunks.chunk_indices, H, K, BT, min(BK, 64),
            dot_precision(k.dtype), *tril_precision(k.dtype), num_warps=4, num_stages=NUM_STAGES,
        )
    v_new = v.new_empty(v.shape, dtype=torch.float32)
    final_state = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    launch(
        parallel_fwd_vnew_kernel, (cdiv(V, BV), N * H),
        k, v, beta, tinv, initial_state, v_new, final_state, info.cu_seqlens,
        H, K, V, BT, BK, BV, initial_state is not None, output_final_state, precision,
        num_warps=warps, num_stages=NUM_STAGES,
    )
    o = torch.empty_like(v)
    attn = torch.zeros(B, H, T, T, dtype=torch.float32, device=q.device) if output_attentions else None
    if chunks.num_chunks:
        launch(
            parallel_fwd_o_kernel, (cdiv(V, BV), chunks.num_chunks, H),
            q, k, v_new, initial_state, o, info.cu_seqlens, chunks.chunk_indices, scale,
            H, K, V, BT, BK, BV, initial_state is not None, precision, num_warps=4, num_stages=NUM_STAGES,
        )
        if output_attentions:
            launch(
                parallel_fwd_attn_kernel, (chunks.num_chunks, H),
                q, k, beta, tinv, attn, info.cu_seqlens, chunks.chunk_indices, scale, T,
                H, K, BT, BK, precision, num_warps=warps, num_stages=NUM_STAGES,
            )
    return o, final_state, (tinv, v_new), (attn,) if output_attentions else ()


def backward(q, k, v, beta, scale, initial_state, saved, do, dht, info, output_attentions=False):
    tinv, v_new = saved
    H = q.shape[2]
    K, V, BK, BT, BV, warps = _config(q, v)
    N = info.num_seqs
    precision = _precision(q.dtype)
    chunks = info.chunks(BT)
    dx = v.new_empty(v.shape, dtype=torch.float32)
    dv = torch.empty_like(v)
    dh0 = q.new_empty(N, H, K, V, dtype=torch.float32) if initial_state is not None else None
    launch(
        parallel_bwd_dx_kernel, (cdiv(V, BV), N * H),
        q, k, beta, tinv, do, dht, dx, dv, dh0, info.cu_seqlens, scale,
        H, K, V, BT, BK, BV, dht is not None, dh0 is not None, precision, num_warps=warps, num_stages=NUM_STAGES,
    )
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dbeta = beta.new_empty(beta.shape, dtype=torch.float32)
    if chunks.num_chunks:
        launch(
            parallel_bwd_dqk_kernel, (chunks.num_chunks, H),
            q, k, v, beta, v_new, do, dx, initial_state, dht, dq, dk, dbeta, info.cu_seqlens,
            chunks.chunk_indices, scale, H, K, V, BT, BK, BV, initial_state is not None, dht is not None,
            precision, num_warps=warps, num_stages=NUM_STAGES,
        )
    return dq, dk, dv, dbeta, dh0
