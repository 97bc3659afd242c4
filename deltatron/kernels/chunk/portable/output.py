"""O = scale (Q S + (Q K^T ⊙ M) V') per chunk (DESIGN.md §2), M keeping j <= i, from the walk's h (the state entering
each chunk) and V'. Every (chunk, head, V-block) is independent.

Gated (USE_G, DESIGN.md §11): O = scale (exp(γ) ⊙ Q S + (Q K^T ⊙ E ⊙ M) V'); q, k are read from the value head's
key head. Per-channel gate (USE_GK, KDA, DESIGN.md §12): O = scale ((exp(Γ) ⊙ Q) S + P V'), P from
gate.channel_scores (the decay inside the sum over channels). The forward launches this stage only where the plan runs
the walk without its output (K = 256, fp32, narrow V-blocks; DESIGN.md §6); elsewhere the walk computes O itself
through causal_output, so both round alike."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...launch import launch
from ...utils import (PIPELINE_STAGES, SeqInfo, cdiv, chunk_span, dot_precision, head_tile, mm, next_power_of_2,
                      store_rows)
from .gate import SUM_PLANES, channel_decays, channel_scores, decay_matrix, gate_rows, gate_sums, load_gamma
from .grads import causal_scores_t


@triton.jit
def causal_output(b_qs, b_qk, b_vn, scale, C: tl.constexpr, PRECISION: tl.constexpr):
    """scale (Q S + (Q K^T ⊙ M) V') of one chunk, fp32 [C, BV], from Q S and Q K^T (fp32) and V' (in the
    input dtype). Q K^T is masked here and rounded to the dtype of V' for the product, as fla does. Shared
    with walk.state_output_fwd, so that both paths round alike."""
    rows = tl.arange(0, C)
    b_qk = tl.where(rows[:, None] >= rows[None, :], b_qk, 0.0)
    return (b_qs + mm(b_qk.to(b_vn.dtype), b_vn, PRECISION)) * scale


@triton.jit
def output_fwd_kernel(q, k, gam, v_new, h, o, scores, scale, cu_seqlens, chunk_indices, H: tl.constexpr,
                      HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr, STORE_SCORES: tl.constexpr,
                      PRECISION: tl.constexpr):
    """STORE_SCORES (USE_GK, one V-block): the chunk's (scale P)^T, masked to j <= i and rounded to the input dtype
    (grads.causal_scores_t), into scores [.., TT, H, C] (row j, column i): the operand of grads.dv_local's product."""
    # V-blocks of one chunk are neighbours in the grid: they share the Q and K tiles in L2
    NV = (V + BV - 1) // BV
    i_cv, i_h = tl.program_id(0), tl.program_id(1)
    i_c, i_v = i_cv // NV, i_cv % NV
    i_hk = i_h // (H // HK)
    start, n = chunk_span(cu_seqlens, chunk_indices, i_c, C)
    rows = tl.arange(0, C)
    cv = i_v * BV + tl.arange(0, BV)
    m_rows = rows < n
    h_c = h + (i_c.to(tl.int64) * H + i_h) * K * V
    q_c = q + start * HK * K + i_hk * K
    k_c = k + start * HK * K + i_hk * K
    if USE_GK:
        g_c = gate_rows(gam, start, i_h, H, K)

    b_qs = tl.zeros([C, BV], dtype=tl.float32)
    b_qk = tl.zeros([C, C], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ck = k0 + tl.arange(0, BK)
        m_k = ck < K
        b_q = tl.load(q_c + rows[:, None] * (HK * K) + ck[None, :], mask=m_rows[:, None] & m_k[None, :], other=0.0)
        # (h may be fp32, output_chunk_states: rounded here as the walk rounds it into an input-dtype h)
        b_s = tl.load(h_c + ck[:, None] * V + cv[None, :], mask=m_k[:, None] & (cv[None, :] < V),
                      other=0.0).to(b_q.dtype)
        if USE_GK:  # (exp(Γ) ⊙ Q) S, the decayed Q rounded as Q is
            b_gam, _, _ = channel_decays(g_c, n, SUM_PLANES * H * K, k0, K, C, BK)
            b_qs += mm((b_q.to(tl.float32) * tl.exp(b_gam)).to(b_q.dtype), b_s, PRECISION)
        else:
            b_kt = tl.load(k_c + rows[None, :] * (HK * K) + ck[:, None], mask=m_k[:, None] & m_rows[None, :],
                           other=0.0)
            b_qs += mm(b_q, b_s, PRECISION)
            b_qk += mm(b_q, b_kt, PRECISION)
    if USE_GK:
        b_qk = channel_scores(q_c, k_c, g_c, n, HK * K, HK * K, SUM_PLANES * H * K, K, C, True, PRECISION)
        if STORE_SCORES:  # dv_local's operand, as it would form it
            store_rows(scores, causal_scores_t(tl.trans(b_qk), scale, C, scores.dtype.element_ty), start, n, i_h, 0,
                       H, C, C, C)

    o_v = (start + rows[:, None]) * (H * V) + i_h * V + cv[None, :]
    m_v = m_rows[:, None] & (cv[None, :] < V)
    b_vn = tl.load(v_new + o_v, mask=m_v, other=0.0)
    if USE_G:
        b_gam, _ = load_gamma(gam, start, n, i_h, H, C)
        b_qs *= tl.exp(b_gam)[:, None]
        b_qk *= decay_matrix(b_gam, b_gam)
    b_o = causal_output(b_qs, b_qk, b_vn, scale, C, PRECISION)
    tl.store(o + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


def output_fwd(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, h: torch.Tensor, scale: float,
               info: SeqInfo, chunk_size: int, gam=None, gk=None, scores=None) -> torch.Tensor:
    """o [B, T, H, V] in the input dtype from q, k [B, T, HK, K], v_new [B, T, H, V] and the per-chunk
    states h [NT, H, K, V]; gam: the gated rule's γ; gk: KDA's per-channel g [.., H, K] or its planes
    (gate.gate_sums). scores (with gk): where the chunks' (scale P)^T goes for the backward (v_new's leading
    dimensions and dtype, then C: grads.dv_local's operand, the bits it would form itself)."""
    if scores is not None and gk is None:
        raise ValueError("output_fwd: scores are stored under KDA's per-channel gate only")
    HK, H, K, V = q.shape[2], v_new.shape[2], q.shape[3], v_new.shape[3]
    gk = gate_sums(gk, info, chunk_size)
    o = torch.empty_like(v_new)
    chunks = info.chunks(chunk_size)
    # KDA: the whole V in one program, so that P (gate.channel_scores) is computed once a chunk and head rather than
    # once a V-block; 4 warps: on the H200 at B = 8, T = 2048, H = 16, K = V = 128 the stage took 0.618 ms against
    # 1.071 at 8 warps (1 block an SM)
    BV, warps = (head_tile(V), 4) if gk is None else (next_power_of_2(V), 4)
    if chunks.num_chunks:
        launch(
            output_fwd_kernel, (chunks.num_chunks * cdiv(V, BV), H),
            q, k, gk if gam is None else gam, v_new, h, o, scores, scale, info.cu_seqlens, chunks.chunk_indices, H, HK,
            K, V, chunk_size, head_tile(K), BV, gam is not None, gk is not None, scores is not None,
            dot_precision(q.dtype), num_warps=warps,
            num_stages=PIPELINE_STAGES,
        )
    return o
