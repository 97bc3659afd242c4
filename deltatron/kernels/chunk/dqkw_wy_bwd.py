"""dQ/dK/dW and the WY backward in one launch (DESIGN.md §3): dQ, dK, dV, dbeta of a chunk from the states
h (entering it), dh (gradient of the state leaving it), V', dO, dU = dV' and T~, so that dW and the direct
part of dK never reach HBM (the unfused pair output_bwd.dqkw + wy_bwd.wy_bwd writes both, then reads them).

One program per (chunk, head). dK needs dA = strictly_lower(-T~^T dT~ T~^T), and dT~ = dW (beta K)^T +
dU (beta V)^T sums over all of K and V, so no dK tile can be finished before the last dW tile exists. A
program cannot keep every [C, BK] tile of dW and dK_direct (Triton loops carry fixed shapes; a whole-width
tile at K = 256 would not fit registers), so it goes over K twice:

    V tiles:        dT~ = dU (beta V)^T, dV = beta T~^T dU, dbeta's V part; (dO V'^T ⊙ M) for dQ and dK
    pass 1, K tiles: dQ = scale (dO S^T + (dO V'^T ⊙ M) K) (stored), dW = -dU S^T, dT~ += dW (beta K)^T
    dA
    pass 2, K tiles: dW = -dU S^T again (recomputed: the product is cheaper than a round trip of dW),
                     dK_direct = V' dS_next^T + (dO V'^T ⊙ M)^T Q, dK = dK_direct + the WY terms (stored)

The roundings are the pair's: dW is rounded to the input dtype before its products (the pair stores it so),
dK_direct stays fp32 (the pair stores it in fp32), the causal scores are rounded to it before theirs; only
the order of some fp32 sums differs (dT~ sums V before K)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import PIPELINE_STAGES, dot_precision, head_block, head_tile, load_rows, mm, state_offsets, store_rows
from .kkt import chunk_span
from .output_bwd import causal_scores_t
from .wy_bwd import load_tinv_t, wy_da, wy_dk_tile, wy_dv_tile


@triton.jit
def dqkw_wy_bwd_kernel(q, k, v, beta, tinv, v_new, h, dh, dout, du, dq, dk, dv, dbeta, chunk_indices,
                       cu_seqlens, scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    start, n = chunk_span(cu_seqlens, chunk_indices, i_t, C)
    dt = k.dtype.element_ty
    r = tl.arange(0, C)
    valid = r < n
    b_beta = tl.load(beta + (start + r) * H + i_h, mask=valid, other=0.0).to(tl.float32)
    b_tt_in = load_tinv_t(tinv, start, n, i_h, H, C).to(dt)  # (fp32 inputs: unchanged)

    # V tiles: dU's part of dT~, dV and dbeta's V part; the transposed causal scores dO V'^T
    b_dt = tl.zeros([C, C], dtype=tl.float32)
    b_dbeta = tl.zeros([C], dtype=tl.float32)
    b_dst = tl.zeros([C, C], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        b_v = load_rows(v, start, n, i_h, i_v * BV, H, V, C, BV)
        b_du = load_rows(du, start, n, i_h, i_v * BV, H, V, C, BV).to(dt)
        b_dt, b_dv, b_dbeta_v = wy_dv_tile(b_dt, b_tt_in, b_du, b_v, b_beta, PRECISION)
        store_rows(dv, b_dv, start, n, i_h, i_v * BV, H, V, C, BV)
        b_dbeta += b_dbeta_v
        b_vn = load_rows(v_new, start, n, i_h, i_v * BV, H, V, C, BV).to(dt)
        b_do = load_rows(dout, start, n, i_h, i_v * BV, H, V, C, BV)
        b_dst += mm(b_vn, tl.trans(b_do), PRECISION)
    b_dst = causal_scores_t(b_dst, scale, C, dt)  # scale (dO V'^T ⊙ M)^T, rounded as the pair does

    # pass 1: dQ, and dW's part of dT~
    for i_k in range(tl.cdiv(K, BK)):
        b_dq = tl.zeros([C, BK], dtype=tl.float32)
        b_dw = tl.zeros([C, BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            b_do = load_rows(dout, start, n, i_h, i_v * BV, H, V, C, BV)
            b_du = load_rows(du, start, n, i_h, i_v * BV, H, V, C, BV).to(dt)
            s_offs, s_mask = state_offsets(i_t * H + i_h, i_k * BK, i_v * BV, K, V, BK, BV)
            b_s = tl.load(h + s_offs, mask=s_mask, other=0.0).to(dt)
            b_dq += mm(b_do, tl.trans(b_s), PRECISION)
            b_dw -= mm(b_du, tl.trans(b_s), PRECISION)
        b_k = load_rows(k, start, n, i_h, i_k * BK, H, K, C, BK)
        b_dq = b_dq * scale + mm(tl.trans(b_dst), b_k, PRECISION)
        store_rows(dq, b_dq, start, n, i_h, i_k * BK, H, K, C, BK)
        b_kb = (b_k.to(tl.float32) * b_beta[:, None]).to(dt)
        b_dt += mm(b_dw.to(dt), tl.trans(b_kb), PRECISION)

    b_da = wy_da(load_tinv_t(tinv, start, n, i_h, H, C), b_dt, C, PRECISION)
    b_dat = tl.trans(b_da)
    # pass 2: dW again, the direct dK, and the WY terms of dK
    for i_k in range(tl.cdiv(K, BK)):
        b_dw = tl.zeros([C, BK], dtype=tl.float32)
        b_dk = tl.zeros([C, BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            b_du = load_rows(du, start, n, i_h, i_v * BV, H, V, C, BV).to(dt)
            b_vn = load_rows(v_new, start, n, i_h, i_v * BV, H, V, C, BV).to(dt)
            s_offs, s_mask = state_offsets(i_t * H + i_h, i_k * BK, i_v * BV, K, V, BK, BV)
            b_s = tl.load(h + s_offs, mask=s_mask, other=0.0).to(dt)
            b_dsn = tl.load(dh + s_offs, mask=s_mask, other=0.0).to(dt)
            b_dw -= mm(b_du, tl.trans(b_s), PRECISION)
            b_dk += mm(b_vn, tl.trans(b_dsn), PRECISION)
        b_q = load_rows(q, start, n, i_h, i_k * BK, H, K, C, BK)
        b_k = load_rows(k, start, n, i_h, i_k * BK, H, K, C, BK).to(tl.float32)
        b_dk += mm(b_dst, b_q, PRECISION)
        b_dk_wy, b_dbeta_k = wy_dk_tile(b_dw.to(dt), b_k, b_beta, b_tt_in, b_da, b_dat, PRECISION)
        b_dk += b_dk_wy
        store_rows(dk, b_dk, start, n, i_h, i_k * BK, H, K, C, BK)
        b_dbeta += b_dbeta_k
    tl.store(dbeta + (start + r) * H + i_h, b_dbeta, mask=valid)


def dqkw_wy_launch(K: int, V: int):
    """(K tile, V tile, pipeline stages) of the fused kernel, on 4 warps. Offline sm_90 (triton 3.6, bf16, 2 stages): 32-wide K
    tiles keep it within registers (K = V = 128: 234 registers, no spills, 64 KiB of shared memory, 2 blocks
    an SM; 64-wide K tiles take 255 and spill 132 B, on 8 warps 255 with no spills but 1 block an SM), with
    64-wide V tiles at heads of 64 and 128 (K = 64 the same: 234, none) and 32-wide ones elsewhere (K = 256:
    239 registers, no spills; K = 100: 255 and 4 B, 120 B with 64-wide V tiles). Not yet timed."""
    BK, BV = min(32, head_tile(K)), head_tile(V)
    if K != head_block(K) or V != head_block(V) or max(K, V) > 128:
        BV = min(32, BV)
    return BK, BV, PIPELINE_STAGES


def dqkw_wy_bwd(q, k, v, beta, tinv, v_new, h, dh, do, du, scale: float, info, chunk_size: int):
    """(dq in q's dtype, dk in k's dtype, dv in v's dtype, dbeta fp32 [.., TT, H]): what output_bwd.dqkw
    followed by wy_bwd.wy_bwd return, in one launch.

    h: states entering each chunk, dh: gradients of the states leaving each chunk ([NT, H, K, V]);
    du: the full dV' (= dU) from the reverse state pass; tinv: [1, TT, H, C] fp32 (I + A)^{-1}."""
    H, K, V = k.shape[-2], k.shape[-1], v.shape[-1]
    chunks = info.chunks(chunk_size)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dbeta = torch.empty_like(beta, dtype=torch.float32)
    BK, BV, stages = dqkw_wy_launch(K, V)
    if chunks.num_chunks:
        dqkw_wy_bwd_kernel[(chunks.num_chunks, H)](
            q, k, v, beta, tinv, v_new, h, dh, do, du, dq, dk, dv, dbeta, chunks.chunk_indices, info.cu_seqlens,
            scale, H, K, V, chunk_size, BK, BV, dot_precision(k.dtype), num_stages=stages, num_warps=4,
        )
    return dq, dk, dv, dbeta
