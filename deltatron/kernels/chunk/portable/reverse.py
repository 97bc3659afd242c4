"""The reverse pass of the chunk backward (DESIGN.md §4, §5): the state gradient runs backwards over the chunks of
each sequence, from dht (or zero) after the last chunk to dh0 before the first:

    dV' = dV'_local + K dS_next,    dS = scale Q^T dO + dS_next - W^T dV'     (dS: the state entering the chunk)

with dV'_local = scale (Q K^T ⊙ M)^T dO. Gated (USE_G, DESIGN.md §11): dV' = dV'_local + exp(γ_C - γ) ⊙ K dS_next with
(Q K^T ⊙ E ⊙ M) in dV'_local, dS = scale (exp(γ) ⊙ Q)^T dO + exp(γ_C) dS_next - W^T dV'. Per-channel gate (USE_GK,
KDA, DESIGN.md §12): dV' = scale P^T dO + (exp(Γ_C - Γ) ⊙ K) dS_next with P from gate.channel_scores, dS = scale
(exp(Γ) ⊙ Q)^T dO + diag(exp(Γ_C)) dS_next - W^T dV', the decayed K, Q and exp(Γ_C) from gate.ChannelDecays (the
recompute's WY stage writes them).
Grouped value heads: q, k of the value head's key head. One program per (V-block, sequence x head) keeps its [K, BV]
slice of the state gradient in fp32 registers for the whole sequence: the V columns are independent.

FUSE_DV_LOCAL (the plan's rule, but for KDA: plan.local_dv_apart) computes dV'_local from the Q, K and dO tiles the
pass loads anyway: A^T = K Q^T is recomputed by every V-block program of a head, in exchange for a launch and
dV'_local's HBM round trip. Unfused, dV'_local is read from grads.dv_local (the stage contract; KDA's rule, where P is
many products' work and would set the pace of this serial pass). Both round A^T alike (grads.causal_scores_t); the fused
pass keeps dV'_local in fp32, the unfused one has it rounded by its store. The plan chooses between this pass and
hopper/reverse.py and sets its launch (plan.reverse_launch)."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...launch import launch
from ..plan import Launch, reverse_launch
from ...utils import (PIPELINE_STAGES, cdiv, dot_precision, head_block, load_rows, mm, num_sms, state_offsets,
                     store_rows)
from .gate import SUM_PLANES, channel_scores, decay_matrix, gate_rows, load_gamma, serial_decays
from .grads import causal_scores_t


@triton.jit
def state_bwd_kernel(q, k, w, gam, kd, qd, dc, dout, dv_local, dht, dh, dv, dh0, cu_seqlens, chunk_offsets, scale,
                     H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                     FUSE_DV_LOCAL: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr, PRECISION: tl.constexpr):
    """FUSE_DV_LOCAL: dV'_local computed here from q, k, dout (dv_local unused); else read from dv_local (the
    ungated stage contract). H value heads, HK key heads (q, k); USE_G: gated by γ (gam); USE_GK: by KDA's g (gam:
    its planes) through gate.channel_decay_stage's decayed K and Q (kd, qd) and chunk decays (dc), the gate's planes
    (gate.gate_rows) for a fused local dV' only."""
    tl.static_assert(FUSE_DV_LOCAL or not USE_G, "the gated pass computes its local dV' itself")
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    first_chunk = tl.load(chunk_offsets + i_n)
    dt = dout.dtype.element_ty
    s_offs, s_mask = state_offsets(i_nh, 0, i_v * BV, K, V, BK, BV)
    b_dsn = tl.zeros([BK, BV], dtype=tl.float32)  # gradient of the state leaving the current chunk
    if USE_DHT:
        b_dsn += tl.load(dht + s_offs, mask=s_mask, other=0.0).to(tl.float32)
    num_chunks = tl.cdiv(eos - bos, C)
    for i in range(num_chunks):
        i_c = num_chunks - 1 - i
        start = bos + i_c * C
        n = eos - start  # tokens left in the sequence: rows from n on are masked
        c_offs, c_mask = state_offsets((first_chunk + i_c) * H + i_h, 0, i_v * BV, K, V, BK, BV)
        tl.store(dh + c_offs, b_dsn.to(dh.dtype.element_ty), mask=c_mask)
        b_do = load_rows(dout, start, n, i_h, i_v * BV, H, V, C, BV)
        if USE_GK:  # exp(Γ_C - Γ) ⊙ K and exp(Γ) ⊙ Q of the value head, as the forward's state update rounded them
            b_k = load_rows(kd, start, n, i_h, 0, H, K, C, BK)
            b_q = load_rows(qd, start, n, i_h, 0, H, K, C, BK)
        else:
            b_k = load_rows(k, start, n, i_hk, 0, HK, K, C, BK)
            b_q = load_rows(q, start, n, i_hk, 0, HK, K, C, BK)
        b_dv = mm(b_k, b_dsn.to(dt), PRECISION)
        if USE_G:
            b_gam, b_gam_last = load_gamma(gam, start, n, i_h, H, C)
            b_dv *= tl.exp(b_gam_last - b_gam)[:, None]
        if FUSE_DV_LOCAL:
            # Q and K are whole in K here, so A^T = K Q^T is one product; the local part stays in fp32
            if USE_GK:
                b_at = tl.trans(channel_scores(q + start * HK * K + i_hk * K, k + start * HK * K + i_hk * K,
                                               gate_rows(gam, start, i_h, H, K), n, HK * K, HK * K,
                                               SUM_PLANES * H * K, K, C, True, PRECISION))
            else:
                b_at = mm(b_k, tl.trans(b_q), PRECISION)
            if USE_G:
                b_at *= tl.trans(decay_matrix(b_gam, b_gam))
            b_dv += mm(causal_scores_t(b_at, scale, C, dt), b_do, PRECISION)
        else:
            b_dv += load_rows(dv_local, start, n, i_h, i_v * BV, H, V, C, BV).to(tl.float32)
        store_rows(dv, b_dv, start, n, i_h, i_v * BV, H, V, C, BV)
        b_w = load_rows(w, start, n, i_h, 0, H, K, C, BK).to(dt)
        if USE_G:  # exp(γ) Q: the entering state's share of the output; exp(γ_C): the state's decay over the chunk
            b_q = (b_q.to(tl.float32) * tl.exp(b_gam)[:, None]).to(dt)
            b_dsn *= tl.exp(b_gam_last)
        if USE_GK:  # per key channel: the state gradient's rows (Q came decayed)
            ck = tl.arange(0, BK)
            b_dsn *= tl.load(dc + ((first_chunk + i_c) * H + i_h) * K + ck, mask=ck < K, other=0.0)[:, None]
        b_dsn += scale * mm(tl.trans(b_q), b_do, PRECISION) - mm(tl.trans(b_w), b_dv.to(dt), PRECISION)
    if STORE_DH0:
        tl.store(dh0 + s_offs, b_dsn, mask=s_mask)


def state_bwd(q, k, w, do, dv_local: Optional[torch.Tensor], dht: Optional[torch.Tensor], scale: float,
              need_dh0: bool, info, chunk_size: int, cfg: Optional[Launch] = None, gam=None, gk=None):
    """(dh [NT, H, K, V]: gradient of the state leaving each chunk, in q's dtype (grads.dqkw rounds it to that dtype
    before its products anyway); dv [1, TT, H, V] in do's dtype: the full dV'; dh0 [N, H, K, V] fp32 or None).
    dv_local: the local dV' from grads.dv_local, or None to compute it in this pass (fused: the backward's path).
    gam: the gated rule's γ; gk: KDA's g or its gate.ChannelDecays with the decayed Q (made here from g otherwise).
    Value heads are do's, key heads q's."""
    decays = serial_decays(gk, k, info, chunk_size, q)
    if decays is not None and decays.q is None:
        raise ValueError("state_bwd: gk's ChannelDecays need the decayed q (channel_decay_stage(..., q=q))")
    HK, H, K, V = q.shape[-2], do.shape[-2], q.shape[-1], do.shape[-1]
    N = info.num_seqs
    chunks = info.chunks(chunk_size)
    dh = q.new_empty(chunks.num_chunks, H, K, V)
    dv = torch.empty_like(do)
    dh0 = q.new_empty(N, H, K, V, dtype=torch.float32) if need_dh0 else None
    if cfg is None:
        cfg = reverse_launch(K, V, N * H, q.element_size(), num_sms(q.device))
    if N:
        launch(
            state_bwd_kernel, (cdiv(V, cfg.block_v), N * H),
            q, k, w, decays.sums if decays else gam, decays and decays.k, decays and decays.q, decays and decays.chunk,
            do, dv_local, dht, dh, dv, dh0, info.cu_seqlens, chunks.chunk_offsets,
            scale,
            H, HK, K, V, chunk_size, head_block(K), cfg.block_v, dht is not None, need_dh0, dv_local is None,
            gam is not None, decays is not None, dot_precision(q.dtype), num_warps=cfg.warps, num_stages=PIPELINE_STAGES,
        )
    return dh, dv, dh0
