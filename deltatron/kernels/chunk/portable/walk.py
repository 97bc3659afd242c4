"""The walk: the chunk forward's serial pass over chunks (DESIGN.md §2, §5), portable Triton, one kernel in variants.

One program per (V-block, sequence, head) walks the chunks of its sequence with S [K, BV] in fp32 registers. Per
chunk, with S the state entering it: V' = U - W S (S and V' rounded to the input dtype), S <- S + K^T V'.
Variants (constexprs of state_fwd_kernel):
    state_fwd         writes h[chunk] = S and V' for output.py and the backward: the plan's unfused walk and the
                      backward's two-launch recompute;
    state_output_fwd  FUSE_OUTPUT: writes O = scale (Q S + (Q K^T ⊙ M) V') while S and V' are on chip, neither h nor
                      V' (Q K^T is recomputed by every V-block program of a head: the price of V-blocking);
    state_wy_fwd      WY_ON_CHIP: W and U computed per chunk from the stored T~ with wy.py's products (the same bits
                      as recompute_w_u), so U never reaches HBM; the V-block-0 programs write W for the reverse pass.
                      The backward's one-launch recompute, where plan.wy_on_chip holds.
Gated (USE_G, DESIGN.md §11): S <- exp(γ_C) S + K^T (exp(γ_C - γ) ⊙ V'), O = scale (exp(γ) ⊙ Q S + (Q K^T ⊙ E ⊙ M)
V'), and W's pair on chip takes exp(γ). Per-channel gate (USE_GK, KDA, DESIGN.md §12; the forward's variants only):
S <- diag(exp(Γ_C)) S + (exp(Γ_C - Γ) ⊙ K)^T V', O = scale ((exp(Γ) ⊙ Q) S + P V') with P from gate.channel_scores,
every exponent a sum within sub-chunks (gate.channel_decays); the decayed K and exp(Γ_C) (gate.ChannelDecays) come
from the WY stage, which writes them beside W, or from gate.channel_decay_stage, made in parallel over chunks before the
walk either way, so the serial chain does no exponent work.
Grouped value heads: a program walks a value head, reading q, k of its key head. The loads do not depend on S, so the
compiler fetches the next chunk's tiles while the current chunk's products run. Launches (V-block, warps) come from the plan (plan.walk_launch)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...launch import launch as launch_kernel
from ..plan import Launch, walk_launch
from ...utils import PIPELINE_STAGES, SeqInfo, cdiv, dot_precision, head_block, load_rows, mm, state_offsets
from .gate import SUM_PLANES, channel_decays, channel_scores, decay_matrix, gate_rows, load_gamma, serial_decays
from .output import causal_output
from .wy import tinv_beta_pair, wy_product


@triton.jit
def state_fwd_kernel(q, k, v, beta, gam, kd, dc, tinv, w, u, h0, h, v_new, o, ht, scale, cu_seqlens, chunk_offsets,
                     H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                     FUSE_OUTPUT: tl.constexpr, WY_ON_CHIP: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr,
                     SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    """FUSE_OUTPUT: writes o (from q, scale); else h and v_new (q, o, scale unused).
    WY_ON_CHIP: W and U's V-block computed from tinv, beta, k, v (SPLIT: Tinv diag(beta) as a 16-bit
    pair, wy.tinv_beta_pair), W written to w by the V-block-0 programs, u unused; else W, U read from w, u
    (v, beta, tinv unused). H value heads, HK key heads (q, k); USE_G: gated by γ (gam); USE_GK: by KDA's g
    (gam: its planes, gate.gate_rows), the state's update from gate.channel_decay_stage's decayed K (kd) and chunk
    decays (dc), the planes for the fused output's scores only."""
    tl.static_assert(not (USE_GK and WY_ON_CHIP), "the per-channel gate's walk is the forward's")
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    first_chunk = tl.load(chunk_offsets + i_n).to(tl.int64)

    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    o_kv, m_kv = state_offsets(i_nh, 0, i_v * BV, K, V, BK, BV)  # this program's [K, BV] state slice
    if HAS_H0:
        b_s = tl.load(h0 + o_kv, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_s = tl.zeros([BK, BV], dtype=tl.float32)

    num_chunks = tl.cdiv(eos - bos, C).to(tl.int32)
    for i_t in range(0, num_chunks):
        start = bos + i_t * C
        m_rows = rows < eos - start
        if not FUSE_OUTPUT:
            h_kv, _ = state_offsets((first_chunk + i_t) * H + i_h, 0, i_v * BV, K, V, BK, BV)
            tl.store(h + h_kv, b_s.to(h.dtype.element_ty), mask=m_kv)

        o_qk = (start + rows[:, None]) * (HK * K) + i_hk * K + ck[None, :]
        o_w = (start + rows[:, None]) * (H * K) + i_h * K + ck[None, :]
        m_qk = m_rows[:, None] & (ck[None, :] < K)
        if USE_GK:  # K^T [BK, C] decayed to the chunk's end (the decay stage's, rounded as K is), loaded transposed
            b_kt = tl.load(kd + (start + rows[None, :]) * (H * K) + i_h * K + ck[:, None],
                           mask=(ck[:, None] < K) & m_rows[None, :], other=0.0)
        else:  # K^T [BK, C], loaded transposed
            b_kt = tl.load(k + (start + rows[None, :]) * (HK * K) + i_hk * K + ck[:, None],
                           mask=(ck[:, None] < K) & m_rows[None, :], other=0.0)
        b_decay = tl.zeros([C], dtype=tl.float32)
        if USE_G:
            b_gam, b_gam_last = load_gamma(gam, start, eos - start, i_h, H, C)
            b_decay = tl.exp(b_gam)
        if USE_GK:
            g_c = gate_rows(gam, start, i_h, H, K)
            if FUSE_OUTPUT:
                b_gam, _, _ = channel_decays(g_c, eos - start, SUM_PLANES * H * K, 0, K, C, BK)
        o_uv = (start + rows[:, None]) * (H * V) + i_h * V + cv[None, :]
        m_uv = m_rows[:, None] & (cv[None, :] < V)
        if WY_ON_CHIP:
            # W = (Tinv diag(beta)) K and U's V-block = (Tinv diag(beta)) V, by wy.py's products (the same
            # bits as recompute_w_u's W, U). They do not depend on S: off the chain S -> V' -> S
            dt = k.dtype.element_ty
            b_t = load_rows(tinv, start, eos - start, i_h, 0, H, C, C, C)
            b_tb_hi, b_tb_lo = tinv_beta_pair(b_t, beta + start * H + i_h, b_decay, eos - start, H, C, dt, False)
            b_v = tl.load(v + o_uv, mask=m_uv, other=0.0)
            b_u = wy_product(b_tb_hi, b_tb_lo, b_v, SPLIT, PRECISION).to(dt)
            if USE_G:
                b_tb_hi, b_tb_lo = tinv_beta_pair(b_t, beta + start * H + i_h, b_decay, eos - start, H, C, dt, True)
            b_w = wy_product(b_tb_hi, b_tb_lo, tl.trans(b_kt), SPLIT, PRECISION).to(dt)
            if i_v == 0:  # W is the same in every V-block program; the reverse pass reads it
                tl.store(w + o_w, b_w, mask=m_qk)
        else:
            b_w = tl.load(w + o_w, mask=m_qk, other=0.0)
            b_u = tl.load(u + o_uv, mask=m_uv, other=0.0)

        # S in the input dtype: what h holds for the unfused output stage
        b_sd = b_s.to(b_w.dtype)
        b_vn = b_u.to(tl.float32) - mm(b_w, b_sd, PRECISION)
        b_vn = b_vn.to(b_u.dtype)
        if FUSE_OUTPUT:
            # Q S with the S entering the chunk; the rest of O after S moves on (fewer registers live at
            # once than with the whole of O first)
            b_q = tl.load(q + o_qk, mask=m_qk, other=0.0)
            if USE_GK:  # (exp(Γ) ⊙ Q) S, the decayed Q rounded as Q is
                b_qs = mm((b_q.to(tl.float32) * tl.exp(b_gam)).to(b_q.dtype), b_sd, PRECISION)
            else:
                b_qs = mm(b_q, b_sd, PRECISION)
        else:
            tl.store(v_new + o_uv, b_vn, mask=m_uv)
        if USE_G:  # S <- exp(γ_C) S + K^T (exp(γ_C - γ) ⊙ V'); the decayed V' rounded as V' is
            b_s = b_s * tl.exp(b_gam_last) + mm(b_kt, (b_vn.to(tl.float32) * tl.exp(b_gam_last - b_gam)[:, None])
                                                .to(b_vn.dtype), PRECISION)
        elif USE_GK:  # S <- diag(exp(Γ_C)) S + (exp(Γ_C - Γ) ⊙ K)^T V'
            b_ec = tl.load(dc + ((first_chunk + i_t) * H + i_h) * K + ck, mask=ck < K, other=0.0)
            b_s = b_s * b_ec[:, None] + mm(b_kt, b_vn, PRECISION)
        else:
            b_s += mm(b_kt, b_vn, PRECISION)
        if FUSE_OUTPUT:
            if USE_GK:
                b_qk = channel_scores(q + start * HK * K + i_hk * K, k + start * HK * K + i_hk * K, g_c, eos - start,
                                      HK * K, HK * K, SUM_PLANES * H * K, K, C, True, PRECISION)
            else:
                b_qk = mm(b_q, b_kt, PRECISION)
            if USE_G:
                b_qs *= b_decay[:, None]
                b_qk *= decay_matrix(b_gam, b_gam)
            b_o = causal_output(b_qs, b_qk, b_vn, scale, C, PRECISION)
            tl.store(o + o_uv, b_o.to(o.dtype.element_ty), mask=m_uv)

    if STORE_HT:
        tl.store(ht + o_kv, b_s, mask=m_kv)


def _walk(q, k, w, u, wy_inputs, scale, initial_state, output_final_state, info, chunk_size, h, v_new, o,
          cfg: Optional[Launch], gam: Optional[torch.Tensor] = None, gk=None):
    """Launches the walk: fused when o is given (then h, v_new are None), else plain; with wy_inputs = (v, beta,
    tinv), W and U computed on chip (W written to w, u None). gam: the gated rule's γ; gk: KDA's g, or its
    gate.ChannelDecays (made here from g otherwise). Returns the final state [N, H, K, V] fp32 (H value heads: w's),
    or None."""
    decays = serial_decays(gk, k, info, chunk_size)
    v, beta, tinv = (None, None, None) if wy_inputs is None else wy_inputs
    HK, K = k.shape[2], k.shape[3]
    H, V = w.shape[2], (u if v is None else v).shape[3]
    N = info.num_seqs
    final_state = k.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    fused = o is not None
    if cfg is None:
        cfg = walk_launch(K, V, N * H, k.element_size(), fused)
    if N * H:
        launch_kernel(
            state_fwd_kernel, (N * H, cdiv(V, cfg.block_v)),
            q, k, v, beta, decays.sums if decays else gam, decays and decays.k, decays and decays.chunk, tinv, w, u,
            initial_state, h, v_new, o, final_state, scale,
            info.cu_seqlens, info.chunks(chunk_size).chunk_offsets, H, HK, K, V, chunk_size, head_block(K), cfg.block_v,
            initial_state is not None, output_final_state, fused, wy_inputs is not None, gam is not None,
            decays is not None, k.dtype != torch.float32, dot_precision(k.dtype), num_warps=cfg.warps,
            num_stages=PIPELINE_STAGES,
        )
    return final_state


def state_fwd(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, initial_state: Optional[torch.Tensor],
              output_final_state: bool, info: SeqInfo, chunk_size: int, cfg: Optional[Launch] = None,
              gam: Optional[torch.Tensor] = None, states_dtype: Optional[torch.dtype] = None,
              gk=None) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(h [NT, H, K, V]: the state entering each chunk, in the input dtype (or states_dtype: fp32 for
    output_chunk_states); v_new = U - W S in the input dtype; final_state [N, H, K, V] fp32 or None). A sequence of
    length 0 passes its initial state (or zeros) through. gam: the gated rule's γ; gk: KDA's g or its
    gate.ChannelDecays."""
    H, K, V = w.shape[2], k.shape[3], u.shape[3]
    h = k.new_empty(info.chunks(chunk_size).num_chunks, H, K, V, dtype=states_dtype or k.dtype)
    v_new = torch.empty_like(u)
    final_state = _walk(None, k, w, u, None, None, initial_state, output_final_state, info, chunk_size, h, v_new,
                        None, cfg, gam, gk)
    return h, v_new, final_state


def state_wy_fwd(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, tinv: torch.Tensor,
                 initial_state: Optional[torch.Tensor], output_final_state: bool, info: SeqInfo, chunk_size: int,
                 cfg: Optional[Launch] = None, gam: Optional[torch.Tensor] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """wy.recompute_w_u and state_fwd in one launch: (w: recompute_w_u's W bit for bit; h, v_new, final_state as
    state_fwd's)."""
    H, K, V = v.shape[2], k.shape[3], v.shape[3]
    w = k.new_empty(*k.shape[:2], H, K)
    h = k.new_empty(info.chunks(chunk_size).num_chunks, H, K, V)
    v_new = torch.empty_like(v)
    final_state = _walk(None, k, w, None, (v, beta, tinv), None, initial_state, output_final_state, info,
                        chunk_size, h, v_new, None, cfg, gam)
    return w, h, v_new, final_state


def state_output_fwd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, scale: float,
                     initial_state: Optional[torch.Tensor], output_final_state: bool, info: SeqInfo,
                     chunk_size: int, cfg: Optional[Launch] = None, gam: Optional[torch.Tensor] = None,
                     gk=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The walk with the output fused in: (o in the input dtype, final_state as state_fwd's); the same o as
    output.output_fwd on state_fwd's h and v_new, up to the order of fp32 sums over K."""
    o = torch.empty_like(u)
    final_state = _walk(q, k, w, u, None, scale, initial_state, output_final_state, info, chunk_size, None, None, o,
                        cfg, gam, gk)
    return o, final_state
