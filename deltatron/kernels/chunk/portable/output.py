"""O = scale (Q S + (Q K^T ⊙ M) V') per chunk (DESIGN.md §2), M keeping j <= i, from the walk's h (the state entering
each chunk) and V'. Every (chunk, head, V-block) is independent.

Gated (USE_G, DESIGN.md §11): O = scale (exp(γ) ⊙ Q S + (Q K^T ⊙ E ⊙ M) V'); q, k are read from the value head's
key head. Per-channel gate (KDA, DESIGN.md §12): O = scale (exp(Γ) ⊙ Q) S + (scale P) V', with exp(Γ) ⊙ Q and scale P
as the WY stage formed them beside A (SCORES: P's decay inside the sum over channels is the WY stage's work, so this
stage is the ungated one's products). The forward launches this stage where the plan runs the walk without its output
(KDA, K = 256, fp32, narrow V-blocks; DESIGN.md §6); elsewhere the walk computes O itself through causal_output, so
both round alike."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...launch import launch
from ...utils import PIPELINE_STAGES, SeqInfo, cdiv, chunk_span, dot_precision, head_tile, load_rows, mm
from .gate import decay_matrix, load_gamma


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
                      BV: tl.constexpr, USE_G: tl.constexpr, SCORES: tl.constexpr, PRECISION: tl.constexpr):
    """SCORES (KDA): q holds exp(Γ) ⊙ Q and the chunk's scale P comes from scores [.., TT, H, C] as the WY stage
    stored it (grads.causal_scores_t's layout: row j, column i); k is not read."""
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

    b_qs = tl.zeros([C, BV], dtype=tl.float32)
    b_qk = tl.zeros([C, C], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ck = k0 + tl.arange(0, BK)
        m_k = ck < K
        b_q = tl.load(q_c + rows[:, None] * (HK * K) + ck[None, :], mask=m_rows[:, None] & m_k[None, :], other=0.0)
        # (h may be fp32, output_chunk_states: rounded here as the walk rounds it into an input-dtype h)
        b_s = tl.load(h_c + ck[:, None] * V + cv[None, :], mask=m_k[:, None] & (cv[None, :] < V),
                      other=0.0).to(b_q.dtype)
        b_qs += mm(b_q, b_s, PRECISION)
        if not SCORES:
            b_kt = tl.load(k + start * HK * K + i_hk * K + rows[None, :] * (HK * K) + ck[:, None],
                           mask=m_k[:, None] & m_rows[None, :], other=0.0)
            b_qk += mm(b_q, b_kt, PRECISION)

    o_v = (start + rows[:, None]) * (H * V) + i_h * V + cv[None, :]
    m_v = m_rows[:, None] & (cv[None, :] < V)
    b_vn = tl.load(v_new + o_v, mask=m_v, other=0.0)
    if SCORES:
        b_ps = tl.trans(load_rows(scores, start, n, i_h, 0, H, C, C, C))
        b_o = b_qs * scale + mm(b_ps.to(b_vn.dtype), b_vn, PRECISION)
    else:
        if USE_G:
            b_gam, _ = load_gamma(gam, start, n, i_h, H, C)
            b_qs *= tl.exp(b_gam)[:, None]
            b_qk *= decay_matrix(b_gam, b_gam)
        b_o = causal_output(b_qs, b_qk, b_vn, scale, C, PRECISION)
    tl.store(o + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


def output_fwd(q: torch.Tensor, k: Optional[torch.Tensor], v_new: torch.Tensor, h: torch.Tensor, scale: float,
               info: SeqInfo, chunk_size: int, gam=None, scores=None) -> torch.Tensor:
    """o [B, T, H, V] in the input dtype from q, k [B, T, HK, K], v_new [B, T, H, V] and the per-chunk
    states h [NT, H, K, V]; gam: the gated rule's γ. scores (KDA): the chunks' (scale P)^T as the WY stage stored it
    (wy.wy_fwd), q then exp(Γ) ⊙ Q per value head (its decays' q) and k None."""
    if scores is not None and (gam is not None or k is not None):
        raise ValueError("output_fwd: with the WY stage's scores (KDA) q is the decayed Q, and neither k nor γ is read")
    HK, H, K, V = q.shape[2], v_new.shape[2], q.shape[3], v_new.shape[3]
    o = torch.empty_like(v_new)
    chunks = info.chunks(chunk_size)
    BV = head_tile(V)
    if chunks.num_chunks:
        launch(
            output_fwd_kernel, (chunks.num_chunks * cdiv(V, BV), H),
            q, k, gam, v_new, h, o, scores, scale, info.cu_seqlens, chunks.chunk_indices, H, HK, K, V, chunk_size,
            head_tile(K), BV, gam is not None, scores is not None, dot_precision(q.dtype), num_warps=4,
            num_stages=PIPELINE_STAGES,
        )
    return o
