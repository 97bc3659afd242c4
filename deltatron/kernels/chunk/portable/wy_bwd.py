"""The WY backward (DESIGN.md §4): dK, dV and dbeta from dW and dU through W = T~ (beta K), U = T~ (beta V),
T~ = (I + A)^{-1}, A = tril(diag(beta) K K^T, -1):

    dT~ = dW (beta K)^T + dU (beta V)^T,   dKb = T~^T dW,   dVb = T~^T dU,   dA = strictly_lower(-T~^T dT~ T~^T)
    dK  = dK_direct + beta (dKb + dA K) + dA^T (beta K),   dV = beta dVb
    dbeta = rowsum(dVb ⊙ V) + rowsum((dKb + dA K) ⊙ K)

Gated (USE_G, DESIGN.md §11): W = T~ (beta exp(γ) K) and A carries E = exp(γ_i - γ_j), so (beta K) becomes
(beta exp(γ) K) in dT~ and dKb takes exp(γ); dA becomes dA ⊙ E in dK and dbeta; this kernel's share of the log
decays' gradient, dγ through W's exp(γ) and A's E, goes to gate.gate_grad with grads.dqkw's. Per-channel gate (USE_GK,
KDA, DESIGN.md §12): W = T~ diag(beta) (exp(Γ) ⊙ K) and A's decay sits inside its sum over channels, so dA's products
with K are gate.channel_mix's, and dΓ per channel goes to gate.channel_gate_grad. Grouped value heads: k of
the value head's key head; one launch a member of the key heads' groups, in value head order, each adding its value
heads' dK into an fp32 sum of k's shape that the last rounds once into the key heads' gradient.

One program per (chunk, head): the chunk's C x C matrices stay in fp32 registers, K and V are looped over in tiles.
Products whose result is a gradient of 16-bit data take 16-bit operands (dT~ from dW, dU and the rounded beta K,
beta V; T~^T dW, T~^T dU with T~ rounded); dA and its two products with K keep fp32 operands (dot_precision): dT~
is an fp32 sum, and dA's products cancel when keys are nearly parallel. Near beta = 2 in bf16 this stage's error
stays below what the 16-bit U and V' already put there (DESIGN.md §8), so a hi + lo T~ would pay only with those
fixed too."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...launch import launch
from ...utils import (WY_PIPELINE_STAGES, chunk_span, dot_precision, group_members, load_rows, mm, store_group_sum,
                     store_rows)
from ..plan import Launch, wy_bwd_launch
from .gate import (SCORE_TILE, SUM_PLANES, channel_decays, channel_mix, channel_sums, decay_matrix, decays_of_sums,
                   gate_rows, gate_sums, load_gamma)


@triton.jit
def load_tinv_t(tinv, start, n, i_h, H: tl.constexpr, C: tl.constexpr):
    """T~^T [C, C] (fp32) of the chunk. T~ is unit lower triangular: only its support is read, so padding
    rows and columns are exact zeros."""
    r = tl.arange(0, C)
    valid = r < n
    t_offs = ((start + r)[:, None] * H + i_h) * C + r[None, :]
    return tl.trans(tl.load(tinv + t_offs, mask=valid[:, None] & (r[None, :] <= r[:, None]), other=0.0))


@triton.jit
def wy_dv_tile(b_dt, b_tt_in, b_du, b_v, b_beta, PRECISION: tl.constexpr):
    """One V tile of the WY backward: (dT~ + dU (beta V)^T, dV = beta T~^T dU, rowsum(dVb ⊙ V) for dbeta).
    b_du in the input dtype, b_v as loaded."""
    b_vb = (b_v.to(tl.float32) * b_beta[:, None]).to(b_du.dtype)
    b_dt += mm(b_du, tl.trans(b_vb), PRECISION)
    b_dvb = mm(b_tt_in, b_du, PRECISION)
    return b_dt, b_dvb * b_beta[:, None], tl.sum(b_dvb * b_v.to(tl.float32), axis=1)


@triton.jit
def wy_da(b_tt, b_dt, C: tl.constexpr, PRECISION: tl.constexpr):
    """dA = strictly_lower(-T~^T dT~ T~^T): d(L^{-1}) = -L^{-T} d(.) L^{-T}, and A only lives strictly below
    the diagonal."""
    r = tl.arange(0, C)
    b_da = -mm(mm(b_tt, b_dt, PRECISION), b_tt, PRECISION)
    return tl.where(r[:, None] > r[None, :], b_da, 0.0)


@triton.jit
def wy_dk_tile(b_dw, b_k, b_beta, b_tt_in, b_da, b_dat, PRECISION: tl.constexpr):
    """One K tile of the WY terms of dK, beta (dKb + dA K) + dA^T (beta K) (fp32; dK = dK_direct + these),
    and rowsum((dKb + dA K) ⊙ K) for dbeta. b_dw in the input dtype, b_k fp32, b_dat = (beta dA)^T."""
    # dKb + dA K: both multiply beta_i k_i in A and W
    b_dkb = mm(b_tt_in, b_dw, PRECISION) + mm(b_da, b_k, PRECISION)
    return b_beta[:, None] * b_dkb + mm(b_dat, b_k, PRECISION), tl.sum(b_dkb * b_k, axis=1)


@triton.jit
def wy_bwd_kernel(k, v, beta, gam, tinv, dw, du, dk_direct, dk, dk_group, dv, dbeta, dgam, chunk_indices,
                  cu_seqlens, member, H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr, USE_G: tl.constexpr,
                  USE_GK: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr):
    """H value heads, HK key heads (k, dk). A launch runs one member of each key head's group of value heads (value
    head i_hk * G + member; utils.group_members): the sum over the group goes through dk_group ([.., TT, HK, K] fp32)
    into dk (utils.store_group_sum). USE_G: gated by γ
    (gam); this kernel's dγ share to dgam [TT, H] fp32. USE_GK: by KDA's g (gam [.., H, K]); its dΓ share to dgam
    [TT, H, K] fp32."""
    i_t, i_hk = tl.program_id(0), tl.program_id(1)
    i_h = i_hk * (H // HK) + member
    start, n = chunk_span(cu_seqlens, chunk_indices, i_t, C)
    r = tl.arange(0, C)
    rows = start + r
    valid = r < n
    b_beta = tl.load(beta + rows * H + i_h, mask=valid, other=0.0).to(tl.float32)
    b_wbeta = b_beta  # the row factor of K in W: beta, gated beta exp(γ)
    if USE_G:
        b_gam, _ = load_gamma(gam, start, n, i_h, H, C)
        b_wbeta = b_beta * tl.exp(b_gam)
    if USE_GK:
        g_c = gate_rows(gam, start, i_h, H, K)
    GS: tl.constexpr = SUM_PLANES * H * K  # (USE_GK) the planes' row stride
    b_tt = load_tinv_t(tinv, start, n, i_h, H, C)
    dt = k.dtype.element_ty
    b_tt_in = b_tt.to(dt)  # (fp32 inputs: unchanged)

    b_dt = tl.zeros([C, C], dtype=tl.float32)
    b_dbeta = tl.zeros([C], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        b_k = load_rows(k, start, n, i_hk, i_k * BK, HK, K, C, BK)
        b_dw = load_rows(dw, start, n, i_h, i_k * BK, H, K, C, BK).to(dt)
        b_kb = b_k.to(tl.float32) * b_wbeta[:, None]
        if USE_GK:  # W's K takes exp(Γ) per channel
            b_kb *= tl.exp(channel_decays(g_c, n, GS, i_k * BK, K, C, BK)[0])
        b_dt += mm(b_dw, tl.trans(b_kb.to(dt)), PRECISION)
    for i_v in range(tl.cdiv(V, BV)):
        b_v = load_rows(v, start, n, i_h, i_v * BV, H, V, C, BV)
        b_du = load_rows(du, start, n, i_h, i_v * BV, H, V, C, BV).to(dt)
        b_dt, b_dv, b_dbeta_v = wy_dv_tile(b_dt, b_tt_in, b_du, b_v, b_beta, PRECISION)
        store_rows(dv, b_dv, start, n, i_h, i_v * BV, H, V, C, BV)
        b_dbeta += b_dbeta_v

    b_da = wy_da(b_tt, b_dt, C, PRECISION)
    if USE_G:
        b_da *= decay_matrix(b_gam, b_gam)  # the gradient of the ungated entries beta_i k_i^T k_j
        b_kk = tl.zeros([C, C], dtype=tl.float32)  # K K^T, for A's share of the decays' gradient
        b_dgam = tl.zeros([C], dtype=tl.float32)
    b_dat = tl.trans(b_beta[:, None] * b_da)  # dA^T (beta K) = (beta dA)^T K: beta scales dA once, not each K tile
    for i_k in range(tl.cdiv(K, BK)):
        b_k = load_rows(k, start, n, i_hk, i_k * BK, HK, K, C, BK).to(tl.float32)
        b_dw = load_rows(dw, start, n, i_h, i_k * BK, H, K, C, BK).to(dt)
        if USE_GK:
            # dA's products with K under the decays: rows (sum_j dA_ij k_j D_ij, beta_i on the row) and columns
            # (sum_i beta_i dA_ij k_i D_ij); T~^T dW's row i takes exp(Γ_i) per channel in dK, dbeta and dΓ
            sums = channel_sums(g_c, n, GS, i_k * BK, K, C, BK)  # the tile's, for exp(Γ) and channel_mix
            b_e = tl.exp(decays_of_sums(sums, C)[0])
            b_tdw = mm(b_tt_in, b_dw, PRECISION)
            b_ya = channel_mix(b_da, b_k, g_c, sums, n, GS, i_k * BK, K, C, BK, False, PRECISION)
            b_za = channel_mix(tl.trans(b_dat), b_k, g_c, sums, n, GS, i_k * BK, K, C, BK, True, PRECISION)
            b_dkb = b_tdw * b_e + b_ya
            b_dk_wy = b_beta[:, None] * b_dkb + b_za
            b_dbeta_k = tl.sum(b_dkb * b_k, axis=1)
            ck = i_k * BK + tl.arange(0, BK)
            tl.store(dgam + (rows[:, None] * H + i_h) * K + ck[None, :], b_k * (b_beta[:, None] * b_dkb - b_za),
                     mask=valid[:, None] & (ck[None, :] < K))
        elif USE_G:
            # K K^T from the fp32 copy of the tile (exact under tf32 for 16-bit keys). On the H200 (triton 3.6) the
            # product of the pipelined 16-bit tile with its own transpose, in the first K loop, differed from run
            # to run, and so did dg, by up to 0.2; from this copy it is bitwise repeatable
            b_kk += mm(b_k, tl.trans(b_k), PRECISION)
            # W through exp(γ): dγ_i += beta_i exp(γ_i) k_i^T (T~^T dW)_i, and T~^T dW's row i takes exp(γ_i) in dK
            b_tdw = mm(b_tt_in, b_dw, PRECISION)
            b_dgam += b_wbeta * tl.sum(b_tdw * b_k, axis=1)
            b_dkb = b_tdw * tl.exp(b_gam)[:, None] + mm(b_da, b_k, PRECISION)
            b_dk_wy = b_beta[:, None] * b_dkb + mm(b_dat, b_k, PRECISION)
            b_dbeta_k = tl.sum(b_dkb * b_k, axis=1)
        else:
            b_dk_wy, b_dbeta_k = wy_dk_tile(b_dw, b_k, b_beta, b_tt_in, b_da, b_dat, PRECISION)
        b_dk = load_rows(dk_direct, start, n, i_h, i_k * BK, H, K, C, BK).to(tl.float32) + b_dk_wy
        store_group_sum(dk, dk_group, b_dk, start, n, i_hk, i_k * BK, HK, K, C, BK, FIRST, LAST)
        b_dbeta += b_dbeta_k
    tl.store(dbeta + rows * H + i_h, b_dbeta.to(dbeta.dtype.element_ty), mask=valid)  # fp32 sum, rounded once
    if USE_G:
        # A through E: dγ_i += sum_j (dA ⊙ A)_ij - sum_l (dA ⊙ A)_li, strictly lower (b_da is)
        b_daa = b_da * b_beta[:, None] * b_kk
        b_dgam += tl.sum(b_daa, axis=1) - tl.sum(tl.trans(b_daa), axis=1)  # column sums as row sums: see gate.py
        tl.store(dgam + rows * H + i_h, b_dgam, mask=valid)


def wy_bwd(k, v, beta, tinv, dw, du, dk_direct, info, chunk_size: int, out=None, cfg: Optional[Launch] = None,
           gam=None, gk=None):
    """Returns (dk in k's dtype, dv in v's dtype, dbeta in beta's dtype [.., TT, H]: summed in fp32 and rounded once
    in the kernel, so that the API returns it without a conversion launch; for the gated rule this stage's share of
    the log decays' gradient, dγ [.., TT, H] fp32 for gate.gate_grad, else None).

    tinv: [1, TT, H, C] fp32 (I + A)^{-1}; dw, du: gradients of W and U; dk_direct: the part of dK from
    the output and the state update (k's dtype, as grads.dqkw stores it; added in fp32). out: (dk, dv,
    dbeta) to write into (those shapes and dtypes, contiguous: the segmented backward passes its segment's
    views of the batch's), else new tensors. gam: the gated rule's γ; gk: KDA's g or its planes (gate.gate_sums; dΓ
    then [.., TT, H, K]). With
    grouped value heads (beta's heads more than k's) dk_direct is per value head and dk each key head's, summed over
    its group in fp32 and rounded once."""
    HK, H, K, V = k.shape[-2], beta.shape[-1], k.shape[-1], v.shape[-1]
    chunks = info.chunks(chunk_size)
    if out is None:
        out = torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta)
    dk, dv, dbeta = out
    dk_group = k.new_empty(k.shape, dtype=torch.float32) if H != HK else None
    dgam = None
    gk = gate_sums(gk, info, chunk_size)
    if gam is not None or gk is not None:
        dgam = torch.empty(beta.shape if gk is None else (*beta.shape, K), dtype=torch.float32, device=beta.device)
    if cfg is None:
        cfg = wy_bwd_launch(K, V, k.element_size(), gk is not None, gam is not None)
    tile_k = cfg.tile_k if gk is None else min(cfg.tile_k, SCORE_TILE.value)  # channel_mix's tiles, as grads.dqkw's
    precision = dot_precision(k.dtype)
    for member, first, last in group_members(H, HK) if chunks.num_chunks else ():
        launch(
            wy_bwd_kernel, (chunks.num_chunks, HK),
            k, v, beta, gk if gam is None else gam, tinv, dw, du, dk_direct, dk, dk_group, dv, dbeta, dgam,
            chunks.chunk_indices, info.cu_seqlens, member, H, HK, K, V, chunk_size, tile_k, cfg.tile_v, precision,
            gam is not None, gk is not None, first, last,
            num_warps=cfg.warps, num_stages=WY_PIPELINE_STAGES, **cfg.options(),
        )
    return dk, dv, dbeta, dgam
