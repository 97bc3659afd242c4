"""The backward's gradient stage (DESIGN.md §4, §5), parallel over chunks, in two kernels:

    dv_local: dV'_local = scale (Q K^T ⊙ M)^T dO          (where the plan keeps it apart, as for KDA; else the
                                                           reverse pass computes it itself, reverse.py)
    dqkw:     dQ = scale (dO S^T + (dO V'^T ⊙ M) K)
              dK = scale (dO V'^T ⊙ M)^T Q + V' dS_next^T  (the direct part; the WY backward adds the rest)
              dW = -dV' S^T                                 (after the reverse pass: needs dS_next and the full dV')

Gated (USE_G, DESIGN.md §11): dQ's state term takes exp(γ), dK's exp(γ_C - γ), the masked scores E; dqkw also
writes its share of the log decays' gradient, per K-tile of the program, for wy_bwd to finish: the per-row dγ from
Q S and the scores, x_i = exp(γ_C - γ_i) k_i^T dS_next v'_i, and exp(γ_C) <S, dS_next> per chunk. Per-channel gate
(USE_GK, KDA, DESIGN.md §12): the same terms per key channel, the scores' products with the decay inside the sum over
channels (gate.channel_mix), and the shares of dg per channel (each K-tile writes its own channels). Grouped value
heads: dqkw runs as one launch a member of the key heads' groups, in value head order, each adding its value heads' dQ
into an fp32 sum of the key heads' shape that the last rounds once; dK and dW come out per value head (the WY backward
sums dK likewise).

Every output element is written by one program of a launch, and a group's launches run in a fixed order
(deterministic)."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...launch import launch
from ...utils import (PIPELINE_STAGES, cdiv, chunk_span, dot_precision, group_members, head_tile, load_rows,
                     load_tile, mm, state_offsets, store_group_sum, store_rows)
from ..plan import DQKW_LAUNCH, Launch
from .gate import (SCORE_TILE, SUM_PLANES, channel_mix, channel_scores, channel_sums, decay_matrix, decays_of_sums,
                   gate_rows, gate_sums, load_gamma)


@triton.jit
def causal_scores_t(b_at, scale, C: tl.constexpr, dt: tl.constexpr):
    """scale (Q K^T ⊙ M)^T from A^T [C, C] = K Q^T (fp32): kept where j <= i (row j, column i), rounded to dt
    for its product with dO. Shared with the reverse state pass's fused dV'_local, so both round alike."""
    r = tl.arange(0, C)
    return tl.where(r[:, None] <= r[None, :], b_at * scale, 0.0).to(dt)


@triton.jit
def dv_local_kernel(q, k, gk, scores, dout, dv, chunk_indices, cu_seqlens, scale,
                    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, USE_GK: tl.constexpr, SCORES: tl.constexpr,
                    PRECISION: tl.constexpr):
    """H value heads (dout, dv), HK key heads (q, k). USE_GK: the scores under KDA's per-channel decays (gk).
    SCORES: the operand, causal_scores_t's, read from scores [.., TT, H, C] (the forward's WY stage stored it)
    instead of formed."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (H // HK)
    start, n = chunk_span(cu_seqlens, chunk_indices, i_t, C)
    # A^T[j, i] = k_j . q_i, kept for j <= i: the transposed causal scores of the chunk
    if SCORES:
        b_at = load_rows(scores, start, n, i_h, 0, H, C, C, C)
    elif USE_GK:
        b_at = tl.trans(channel_scores(q + start * HK * K + i_hk * K, k + start * HK * K + i_hk * K,
                                       gate_rows(gk, start, i_h, H, K), n, HK * K, HK * K, SUM_PLANES * H * K, K, C,
                                       True, PRECISION))
    else:
        b_at = tl.zeros([C, C], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            b_k = load_rows(k, start, n, i_hk, i_k * BK, HK, K, C, BK)
            b_q = load_rows(q, start, n, i_hk, i_k * BK, HK, K, C, BK)
            b_at += mm(b_k, tl.trans(b_q), PRECISION)
    if not SCORES:
        b_at = causal_scores_t(b_at, scale, C, dout.dtype.element_ty)
    for i_v in range(tl.cdiv(V, BV)):
        b_do = load_rows(dout, start, n, i_h, i_v * BV, H, V, C, BV)
        store_rows(dv, mm(b_at, b_do, PRECISION), start, n, i_h, i_v * BV, H, V, C, BV)


@triton.jit
def dqkw_kernel(q, k, gam, v_new, h, dh, dout, dv, dq, dq_group, dk, dw, dg_rows, dg_chunks, chunk_indices,
                cu_seqlens, scale, member, TT, NT, H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
                STATES_T: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr, FIRST: tl.constexpr,
                LAST: tl.constexpr):
    """STATES_T: h and v_new as the forward's Hopper walk keeps them (hopper.walk.states_buffers): S^T [NT, H, V, K]
    and V'^T [NT, H, V, C] per chunk; else h [NT, H, K, V] and v_new [1, TT, H, V] (walk.state_fwd's). H value heads
    (dk, dw are per value head), HK key heads (q, k, dq). A launch runs one member of each key head's group of value
    heads (value head i_hk * G + member; utils.group_members): the sum over the group goes through dq_group
    ([.., TT, HK, K] fp32) into dq (utils.store_group_sum). USE_G: gated by γ (gam); the K-tile's shares of the decays'
    gradient go to dg_rows [NK, 2, TT, H] (dγ, x) and dg_chunks [NK, NT, H, BV] (exp(γ_C) <S, dS_next> in BV parts),
    fp32. USE_GK: by KDA's g (gam [.., H, K]); the shares per channel to dg_rows [2, TT, H, K] and dg_chunks
    [NT, H, K]."""
    i_k, i_t, i_hk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hk * (H // HK) + member
    start, n = chunk_span(cu_seqlens, chunk_indices, i_t, C)
    dt = dout.dtype.element_ty
    i_s = (i_t * H + i_h).to(tl.int64)  # the chunk's state (and, STATES_T, its V'^T)
    b_dq = tl.zeros([C, BK], dtype=tl.float32)
    b_dk = tl.zeros([C, BK], dtype=tl.float32)
    b_dw = tl.zeros([C, BK], dtype=tl.float32)
    b_ds = tl.zeros([C, C], dtype=tl.float32)
    b_sds = tl.zeros([BV], dtype=tl.float32)  # <S, dS_next> over this K-tile, by rows of S^T (USE_G)
    b_sds_k = tl.zeros([BK], dtype=tl.float32)  # rowsum(S ⊙ dS_next) per key channel (USE_GK)
    if USE_GK:  # the tile's sums, for its decays and channel_mix: loaded before the products over V, which hide
        # their latency (first used after the loop, they were the stage's largest stall: docs/performance.md, KDA)
        g_c = gate_rows(gam, start, i_h, H, K)
        GS: tl.constexpr = SUM_PLANES * H * K
        sums = channel_sums(g_c, n, GS, i_k * BK, K, C, BK)
    # every term sums over V: loop over it here, in a fixed order
    for i_v in range(tl.cdiv(V, BV)):
        if STATES_T:  # V'^T rows of this V-block, whole: zero past the sequence's end (states_buffers), and a mask
            # on n along the contiguous dimension would turn the vector loads into scalar ones
            b_vn = tl.trans(load_tile(v_new, i_s * V + i_v * BV, (i_s + 1) * V, C, 0, C, BV, C)).to(dt)
        else:
            b_vn = load_rows(v_new, start, n, i_h, i_v * BV, H, V, C, BV).to(dt)
        b_do = load_rows(dout, start, n, i_h, i_v * BV, H, V, C, BV)
        b_dv = load_rows(dv, start, n, i_h, i_v * BV, H, V, C, BV).to(dt)
        s_offs, s_mask = state_offsets(i_s, i_k * BK, i_v * BV, K, V, BK, BV)
        # S^T of the state entering the chunk
        if STATES_T:
            b_st = load_tile(h, i_s * V + i_v * BV, (i_s + 1) * V, K, i_k * BK, K, BV, BK).to(dt)
        else:
            b_st = tl.trans(tl.load(h + s_offs, mask=s_mask, other=0.0).to(dt))
        b_dsn = tl.load(dh + s_offs, mask=s_mask, other=0.0).to(dt)  # gradient of the state leaving it
        if USE_G:
            b_sds += tl.sum(b_st.to(tl.float32) * tl.trans(b_dsn.to(tl.float32)), axis=1)
        if USE_GK:
            b_sds_k += tl.sum(b_st.to(tl.float32) * tl.trans(b_dsn.to(tl.float32)), axis=0)
        b_dq += mm(b_do, b_st, PRECISION)
        b_dk += mm(b_vn, tl.trans(b_dsn), PRECISION)
        b_dw -= mm(b_dv, b_st, PRECISION)
        b_ds += mm(b_do, tl.trans(b_vn), PRECISION)
    r = tl.arange(0, C)
    b_q = load_rows(q, start, n, i_hk, i_k * BK, HK, K, C, BK)
    b_k = load_rows(k, start, n, i_hk, i_k * BK, HK, K, C, BK)
    if USE_G:
        b_gam, b_gam_last = load_gamma(gam, start, n, i_h, H, C)
        b_dq *= tl.exp(b_gam)[:, None]  # dO S^T exp(γ): the entering state's term
        b_dk *= tl.exp(b_gam_last - b_gam)[:, None]  # exp(γ_C - γ) V' dS_next^T: the leaving state's
        b_ds = tl.where(r[:, None] >= r[None, :], b_ds * scale * decay_matrix(b_gam, b_gam), 0.0)
        # the decays' gradient: through exp(γ_i) of Q S, and through E of the scores (dP ⊙ P, strictly lower:
        # E_ii = 1 takes none) as dγ_i; x_i and the chunk's exp(γ_C) <S, dS_next> through the state update
        b_dgam = scale * tl.sum(b_q.to(tl.float32) * b_dq, axis=1)
        b_dpp = tl.where(r[:, None] > r[None, :], b_ds * mm(b_q, tl.trans(b_k), PRECISION), 0.0)
        b_dgam += tl.sum(b_dpp, axis=1) - tl.sum(tl.trans(b_dpp), axis=1)  # column sums as row sums: see gate.py
        b_x = tl.sum(b_k.to(tl.float32) * b_dk, axis=1)
        rows = start + r
        tl.store(dg_rows + ((i_k * 2) * TT + rows) * H + i_h, b_dgam, mask=r < n)
        tl.store(dg_rows + ((i_k * 2 + 1) * TT + rows) * H + i_h, b_x, mask=r < n)
        tl.store(dg_chunks + ((i_k * NT + i_t) * H + i_h) * BV + tl.arange(0, BV), b_sds * tl.exp(b_gam_last))
        b_ds = b_ds.to(dt)
    elif USE_GK:
        b_gam, b_rest, b_gam_last = decays_of_sums(sums, C)
        b_dq *= tl.exp(b_gam)  # (exp(Γ) ⊙ dO S^T): the entering state's term
        b_dk *= tl.exp(b_rest)  # (exp(Γ_C - Γ) ⊙ V' dS_next^T): the leaving state's
        # dP = scale dO V'^T, strictly lower through the decays; the diagonal (decay 1) apart
        b_dpd = scale * tl.sum(tl.where(r[:, None] == r[None, :], b_ds, 0.0), axis=1)
        b_dp = tl.where(r[:, None] > r[None, :], b_ds * scale, 0.0)
        b_qf, b_kf = b_q.to(tl.float32), b_k.to(tl.float32)
        b_y = channel_mix(b_dp, b_kf, g_c, sums, n, GS, i_k * BK, K, C, BK, False, PRECISION)
        b_z = channel_mix(b_dp, b_qf, g_c, sums, n, GS, i_k * BK, K, C, BK, True, PRECISION)
        # dΓ_i: through exp(Γ_i) of Q S, and through the scores' decays (row i as the later token, minus as the
        # earlier); x_i through exp(Γ_C - Γ_i) of the state update; exp(Γ_C) rowsum(S ⊙ dS_next) for the chunk
        c_offs = ((start + r)[:, None] * H + i_h) * K + i_k * BK + tl.arange(0, BK)[None, :]
        c_mask = (r[:, None] < n) & (i_k * BK + tl.arange(0, BK)[None, :] < K)
        tl.store(dg_rows + c_offs, scale * b_qf * b_dq + b_qf * b_y - b_kf * b_z, mask=c_mask)
        tl.store(dg_rows + TT * H * K + c_offs, b_kf * b_dk, mask=c_mask)
        ck = i_k * BK + tl.arange(0, BK)
        tl.store(dg_chunks + (i_t * H + i_h) * K + ck, b_sds_k * tl.exp(b_gam_last), mask=ck < K)
        b_dq = b_dq * scale + b_y + b_dpd[:, None] * b_kf
        b_dk += b_z + b_dpd[:, None] * b_qf
    else:
        b_ds = tl.where(r[:, None] >= r[None, :], b_ds * scale, 0.0).to(dt)
    if not USE_GK:
        b_dq = b_dq * scale + mm(b_ds, b_k, PRECISION)
        b_dk += mm(tl.trans(b_ds), b_q, PRECISION)
    store_group_sum(dq, dq_group, b_dq, start, n, i_hk, i_k * BK, HK, K, C, BK, FIRST, LAST)
    store_rows(dk, b_dk, start, n, i_h, i_k * BK, H, K, C, BK)
    store_rows(dw, b_dw, start, n, i_h, i_k * BK, H, K, C, BK)


def dv_local(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, scale: float, info, chunk_size: int,
             gk: Optional[torch.Tensor] = None, scores: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dV'_local = scale (Q K^T ⊙ M)^T dO per chunk, [1, TT, H, V] in do's dtype (H: do's value heads; q, k may
    have fewer, grouped). gk: KDA's per-channel g [.., TT, H, K] (or its planes, gate.gate_sums), the scores P of
    gate.channel_scores instead.
    scores: (scale P)^T as the forward's WY stage stored it (wy.wy_fwd's scores, do's dtype), read rather
    than formed: the same bits."""
    HK, H, K, V = q.shape[-2], do.shape[-2], q.shape[-1], do.shape[-1]
    chunks = info.chunks(chunk_size)
    if scores is not None and (scores.shape[-2:] != (H, chunk_size) or scores.dtype != do.dtype):
        raise ValueError(f"dv_local: scores [.., TT, {H}, {chunk_size}] in {do.dtype} expected, got "
                         f"{tuple(scores.shape)} in {scores.dtype}")
    dv = torch.empty_like(do)
    gk = None if scores is not None else gate_sums(gk, info, chunk_size)
    if chunks.num_chunks:
        launch(
            dv_local_kernel, (chunks.num_chunks, H),
            q, k, gk, scores, do, dv, chunks.chunk_indices, info.cu_seqlens, scale,
            H, HK, K, V, chunk_size, head_tile(K), head_tile(V), gk is not None, scores is not None,
            dot_precision(q.dtype), num_stages=PIPELINE_STAGES,
        )
    return dv


def dqkw(q, k, v_new, h, dh, do, dv, scale: float, info, chunk_size: int, dq=None, states_t: bool = False,
         gam=None, gk=None, cfg: Optional[Launch] = None):
    """(dQ (final, q's dtype), direct dK (k's dtype, completed by the WY backward), dW (q's dtype), and for the gated
    rule (gam: γ) or KDA's (gk: g or its planes, gate.gate_sums) the decays' gradient shares (dg_rows, dg_chunks) for
    gate.gate_grad or gate.channel_gate_grad, else None). With grouped value heads dQ is each key head's, summed over
    its group in fp32 and rounded once; the direct dK and dW are per value head (the WY backward sums dK over the
    group).

    The direct dK is stored in k's dtype, not fp32: for 16-bit inputs that halves its HBM round trip (written here,
    read and added in fp32 by the WY backward), for one 16-bit rounding of one summand (DESIGN.md §4).

    h: states entering each chunk, dh: gradients of the states leaving each chunk ([NT, H, K, V]);
    dv: the full dV' (= dU) from the reverse pass. states_t: h and v_new are the forward's kept S^T and V'^T
    (hopper.walk.states_buffers) instead. dq: where to write dQ (q's shape and dtype, contiguous: the segmented
    backward passes its segment's view of the batch's), else a new tensor. cfg: the launch (the plan's dqkw_launch;
    default plan.DQKW_LAUNCH)."""
    HK, H, K, V = q.shape[-2], do.shape[-2], q.shape[-1], do.shape[-1]
    chunks = info.chunks(chunk_size)
    gk = gate_sums(gk, info, chunk_size)
    if dq is None:
        dq = torch.empty_like(q)
    dk, dw = (k.new_empty(*q.shape[:-2], H, K) for _ in range(2))
    # KDA: K-tiles as channel_scores' channel tile (channel_mix's [C, BK] fp32 terms, one set a sub-chunk)
    BK = head_tile(K) if gk is None else min(head_tile(K), SCORE_TILE.value)
    TT, NT = info.total_tokens, chunks.num_chunks
    dg = None
    if gk is not None:
        dg = (q.new_empty(2, TT, H, K, dtype=torch.float32), q.new_empty(NT, H, K, dtype=torch.float32))
    elif gam is not None:
        dg = (q.new_empty(cdiv(K, BK), 2, TT, H, dtype=torch.float32),
              q.new_empty(cdiv(K, BK), NT, H, head_tile(V), dtype=torch.float32))
    dq_group = q.new_empty(q.shape, dtype=torch.float32) if H != HK else None
    for member, first, last in group_members(H, HK) if chunks.num_chunks else ():
        launch(
            dqkw_kernel, (cdiv(K, BK), chunks.num_chunks, HK),
            q, k, gk if gam is None else gam, v_new, h, dh, do, dv, dq, dq_group, dk, dw, *(dg or (None, None)),
            chunks.chunk_indices, info.cu_seqlens, scale, member, TT, NT, H, HK, K, V, chunk_size, BK, head_tile(V),
            dot_precision(q.dtype), states_t, gam is not None, gk is not None, first, last,
            num_warps=(cfg or DQKW_LAUNCH).warps, num_stages=PIPELINE_STAGES,
        )
    return dq, dk, dw, dg
