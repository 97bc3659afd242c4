"""fused_recurrent_delta_rule in Triton: the recurrence of DESIGN.md §1, token by token (§5, other forms).

Forward: one program per (V-block, sequence, head) walks the tokens of its sequence with its [K, BV]
slice of the fp32 state in registers. V-blocks are independent: S^T k, the update k v'^T and S^T q
never mix columns of S. The same kernel is the decode step: with inplace_final_state it reads the
state once and writes it back over itself.

Backward: one reverse sweep per (V-block, sequence, head) carrying dS, with the state rebuilt token by
token, S_{t-1} = S_t - k_t v'_t^T. What the forward saves for it (only when a gradient is wanted): the
per-token error e_t = v_t - S_{t-1}^T k_t in fp32 (so v'_t = beta_t e_t is bit-for-bit the forward's), the
final state, and a checkpoint of the state every SEGMENT tokens. Rebuilding by subtraction adds an error of
about eps |S| per step; the sweep restarts from the exact checkpoint at each segment's start, so that error
spans at most SEGMENT tokens and not the whole sequence (a state that grows by orders of magnitude along a
long sequence would otherwise swamp dk). dq, dk and dbeta sum over all of V: each V-block writes its
partial sums and the host adds them in a fixed order (deterministic, no atomics).

Gated delta rule and grouped value heads (DESIGN.md §11), the constexpr USE_G of the same kernels: programs
run per value head (HV of them), reading q, k of key head i_h // (HV / HK); with USE_G the state decays,
S <- exp(g_t) S, before each token's write. dq, dk are written per value head and summed over each group of
G value heads on the host (a fixed order). The gated backward never steps the state back: S_{t-1} =
(S_t - k v'^T) / exp(g_t) divides by exp(-20) per token under strong gates. It rebuilds states forward from
the checkpoints instead (see fused_recurrent_bwd_kernel).

Kimi Delta Attention (DESIGN.md §12), the constexpr USE_GK with USE_G: g holds a log decay per key channel,
g [tokens, H, K], and the state's row c decays by exp(g_t[c]): S <- diag(exp(g_t)) S. The backward's gradient of
g_t is then per channel, dg_t[c] = sum_v S~_t[c, v] dS~_t[c, v] (a row sum instead of the whole tile's sum), the
V-blocks' partial sums added on the host as dbeta's."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.common import L2NORM_EPS
from .launch import launch
from .utils import INTERPRET, cdiv, head_block, next_power_of_2, num_sms, state_offsets, state_offsets_v_first

# Largest state tile a program keeps in registers (fp32 elements): the backward holds two (S and dS).
FWD_TILE = 8192
BWD_TILE = 4096
# [V, K] states (state_v_first): a program takes this many rows of V, each a whole contiguous row of K, on one warp:
# the fastest launch of the decode sweep at Qwen3-Next's layout, faster than the [K, V] rule's (docs/performance.md §2b)
V_FIRST_ROWS = 8
# Tokens between state checkpoints for the backward: one fp32 [K, V] per 64 tokens and head, K V / 16 bytes
# per token and head (e's size at K = 64, twice it at K = 128), the memory of the chunk form's states.
SEGMENT = 64
# Gated backward: tokens per sub-block of a segment, the unit of its forward rebuild (divides SEGMENT)
SUBSEGMENT = 8
QK_NORM_EPS = tl.constexpr(L2NORM_EPS)  # the in-kernel L2 norm's, kernels/l2norm.py's


@triton.jit
def fused_recurrent_fwd_kernel(q, k, v, beta, g, A_log, dt_bias, o, e, h, h0, ht, state_indices, num_accepted,
                               num_slots, indices_stride, token_buffer, token_rows, token_steps, num_buffer_rows,
                               cu_seqlens, segment_offsets, scale, beta_scale, softplus_beta, softplus_threshold,
                               H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr,
                               V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SEG: tl.constexpr,
                               USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
                               SAVE_FOR_BACKWARD: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr,
                               USE_INDICES: tl.constexpr,
                               FINAL_IN_POOL: tl.constexpr, TOKEN_STATES: tl.constexpr, SPEC: tl.constexpr,
                               TOKEN_BUFFER: tl.constexpr, GATE_IN_KERNEL: tl.constexpr,
                               BETA_SIGMOID: tl.constexpr, QK_L2NORM: tl.constexpr, V_FIRST: tl.constexpr):
    """H value heads (of v, beta, g, o, the state), HK key heads (of q, k; HK divides H). USE_G: g [tokens, H]
    log decays, S <- exp(g_t) S before each token's write; with USE_GK g [tokens, H, K], one per key channel (KDA),
    S <- diag(exp(g_t)) S. SAVE_FOR_BACKWARD: also e [tokens, H, V] (against
    the decayed state) and the state entering every SEG-token segment into h [segments, H, K, V]
    (segment_offsets: first global segment of each sequence). USE_INDICES: h0 is a pool of num_slots states and
    sequence n starts from slot state_indices[n]; a slot outside [0, num_slots) (-1: padding) reads and writes no
    state and outputs zeros; FINAL_IN_POOL: the final state goes back into the slot (ht is the pool). Speculative
    decoding: state_indices is [N, indices_stride], a slot per token; SPEC: the sequence starts from its column
    num_accepted[n] - 1 (else 0); TOKEN_STATES: the state after its token j goes into slot state_indices[n, j]
    (a slot outside the pool: not written). TOKEN_BUFFER (SGLang's verify layout): the state after token j of
    sequence n goes into token_buffer [num_buffer_rows, token_steps, H, K, V] at [token_rows[n], j], for j <
    token_steps (a row outside the buffer, -1, or a padding sequence: not written).
    Inference only (a serving engine's fused decode step): GATE_IN_KERNEL: g holds the raw projection a and
    g = -exp(A_log) softplus(a + dt_bias) per token (softplus with softplus_beta and softplus_threshold, as
    torch's); BETA_SIGMOID: beta holds logits, beta = beta_scale sigmoid(beta); QK_L2NORM: q and k L2-normalized
    per token (kernels/l2norm.py's formula); V_FIRST: h0, ht and the pool's slots hold states as [V, K] (vLLM's and
    FlashInfer's layout; the same [BK, BV] tiles, read and written transposed)."""
    tl.static_assert(not (SAVE_FOR_BACKWARD and (GATE_IN_KERNEL or BETA_SIGMOID or QK_L2NORM or V_FIRST)),
                     "the in-kernel gate, beta and norm and V-first states are for inference")
    tl.static_assert(not (V_FIRST and TOKEN_BUFFER), "the token buffer takes [K, V] states")
    tl.static_assert(USE_INDICES or not TOKEN_BUFFER, "the token buffer goes with a pool's slots")
    tl.static_assert(not (USE_GK and GATE_IN_KERNEL), "the in-kernel gate is the per-head one")
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_s = i_nh  # the state's row in h0 (and in ht with FINAL_IN_POOL)
    if USE_INDICES:
        first_col = 0
        if SPEC:
            first_col = tl.load(num_accepted + i_n).to(tl.int64) - 1
        slot = tl.load(state_indices + i_n * indices_stride + first_col).to(tl.int64)
        live = (slot >= 0) & (slot < num_slots)
        i_s = tl.where(live, slot, 0) * H + i_h
    # int64 token offsets: tokens * H * K may pass 2^31
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    # this program's [BK, BV] slice of the [K, V] state; rows of V contiguous (coalesced), or of K with V_FIRST
    p_S, m_S = _state_tile(i_nh, i_v, K, V, BK, BV, V_FIRST)
    p_S0, m_S0 = _state_tile(i_s, i_v, K, V, BK, BV, V_FIRST)
    if USE_INDICES:  # (a bound on the rows: Triton's interpreter rejects a mask combined with a scalar one)
        m_S0 = m_S0 & (tl.arange(0, BK)[:, None] < tl.where(live, BK, 0))
    if USE_INITIAL_STATE:
        b_S = tl.load(h0 + p_S0, mask=m_S0, other=0.0).to(tl.float32)
    else:
        b_S = tl.zeros([BK, BV], dtype=tl.float32)

    # pointers to the first token of the sequence, stepped by one token (H or HK rows) per iteration
    first = bos * H + i_h
    first_k = bos * HK + i_h // (H // HK)  # the value head's key head
    p_q = q + first_k * K + o_k
    p_k = k + first_k * K + o_k
    p_v = v + first * V + o_v
    p_o = o + first * V + o_v
    if SAVE_FOR_BACKWARD:
        p_e = e + first * V + o_v
        first_segment = tl.load(segment_offsets + i_n)
    p_beta = beta + first
    if TOKEN_BUFFER:
        b_row = tl.load(token_rows + i_n).to(tl.int64)
    if USE_GK:
        p_g = g + first * K + o_k
    elif USE_G:
        p_g = g + first
        if GATE_IN_KERNEL:
            b_decay_rate = -tl.exp(tl.load(A_log + i_h).to(tl.float32))
            b_dt_bias = tl.load(dt_bias + i_h).to(tl.float32)
    for t in range(bos, eos):
        if SAVE_FOR_BACKWARD:
            if (t - bos) % SEG == 0:  # checkpoint: the state entering this segment
                p_h, _ = state_offsets((first_segment + (t - bos) // SEG) * H + i_h, 0, i_v * BV, K, V, BK, BV)
                tl.store(h + p_h, b_S, mask=m_S)
        b_q = tl.load(p_q, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(p_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(p_v, mask=m_v, other=0.0).to(tl.float32)
        if QK_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 0) + QK_NORM_EPS)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 0) + QK_NORM_EPS)
        b_beta = tl.load(p_beta).to(tl.float32)
        if BETA_SIGMOID:
            b_beta = beta_scale * tl.sigmoid(b_beta)
        if USE_GK:
            b_S *= tl.exp(tl.load(p_g, mask=m_k, other=0.0).to(tl.float32))[:, None]  # S <- diag(exp(g)) S
            p_g += H * K
        elif USE_G:
            b_g = tl.load(p_g).to(tl.float32)
            if GATE_IN_KERNEL:  # g = -exp(A_log) softplus(a + dt_bias)
                b_x = b_g + b_dt_bias
                b_g = b_decay_rate * tl.where(softplus_beta * b_x <= softplus_threshold,
                                              tl.log(1.0 + tl.exp(softplus_beta * b_x)) / softplus_beta, b_x)
            b_S *= tl.exp(b_g)                                  # S <- exp(g) S
            p_g += H
        # both reductions read the state entering the token, so they do not wait on each other or on the
        # update: o = scale S_new^T q = scale (S^T q + (k . q) v') with v' = beta (v - S^T k)
        b_e = b_v - tl.sum(b_S * b_k[:, None], 0)              # v - S^T k
        b_sq = tl.sum(b_S * b_q[:, None], 0)                   # S^T q
        b_vn = b_beta * b_e
        b_S += b_k[:, None] * b_vn[None, :]                    # S += k v'^T
        b_o = scale * (b_sq + tl.sum(b_k * b_q, 0) * b_vn)
        if USE_INDICES:
            b_o *= tl.where(live, 1.0, 0.0)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v)
        if TOKEN_STATES:  # the state after this token into its own slot
            j = t - bos
            slot_t = tl.load(state_indices + i_n * indices_stride + j, mask=j < indices_stride, other=-1).to(tl.int64)
            ok = live & (slot_t >= 0) & (slot_t < num_slots)
            p_St, m_St = _state_tile(tl.where(ok, slot_t, 0) * H + i_h, i_v, K, V, BK, BV, V_FIRST)
            tl.store(h0 + p_St, b_S, mask=m_St & (tl.arange(0, BK)[:, None] < tl.where(ok, BK, 0)))
        if TOKEN_BUFFER:  # the state after this token into the sequence's buffer row, at step j
            j = t - bos
            ok = live & (b_row >= 0) & (b_row < num_buffer_rows) & (j < token_steps)
            p_St, m_St = state_offsets((tl.where(ok, b_row * token_steps + j, 0)) * H + i_h, 0, i_v * BV, K, V,
                                       BK, BV)
            tl.store(token_buffer + p_St, b_S, mask=m_St & (tl.arange(0, BK)[:, None] < tl.where(ok, BK, 0)))
        if SAVE_FOR_BACKWARD:
            tl.store(p_e, b_e, mask=m_v)
            p_e += H * V
        p_q += HK * K
        p_k += HK * K
        p_v += H * V
        p_o += H * V
        p_beta += H
    if STORE_FINAL_STATE:
        if FINAL_IN_POOL:
            tl.store(ht + p_S0, b_S, mask=m_S0)
        elif USE_INDICES:
            tl.store(ht + p_S, b_S * tl.where(live, 1.0, 0.0), mask=m_S)
        else:
            tl.store(ht + p_S, b_S, mask=m_S)


@triton.jit
def _state_tile(i_s, i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, V_FIRST: tl.constexpr):
    """Offsets and mask of V-block i_v's [BK, BV] tile of state i_s in a [*, K, V] tensor, or [*, V, K] (V_FIRST)."""
    if V_FIRST:
        offsets, mask = state_offsets_v_first(i_s, 0, i_v * BV, K, V, BK, BV)
    else:
        offsets, mask = state_offsets(i_s, 0, i_v * BV, K, V, BK, BV)
    return offsets, mask


@triton.jit
def _walk(b_S, u0, u1, k, e, beta, g, i_h, i_hk, H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr,
          V: tl.constexpr, o_k, o_v, m_k, m_v, USE_GK: tl.constexpr):
    """The gated state stepped forward over tokens [u0, u1): S <- exp(g_u) S + k_u (beta_u e_u)^T (diag(exp(g_u))
    per channel with USE_GK), the forward's own operations on its saved e (no reductions), so the forward's states
    come out."""
    for u in range(u0, u1):
        b_k = tl.load(k + (u * HK + i_hk) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_e = tl.load(e + (u * H + i_h) * V + o_v, mask=m_v, other=0.0)
        b_beta = tl.load(beta + u * H + i_h).to(tl.float32)
        if USE_GK:
            b_S *= tl.exp(tl.load(g + (u * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32))[:, None]
        else:
            b_S *= tl.exp(tl.load(g + u * H + i_h).to(tl.float32))
        b_S += b_k[:, None] * (b_beta * b_e)[None, :]
    return b_S


@triton.jit
def fused_recurrent_bwd_kernel(q, k, beta, g, e, h, do, ht, dht, dq, dk, dv, dbeta, dg, dh0, cu_seqlens,
                               segment_offsets, scale, num_tokens, H: tl.constexpr, HK: tl.constexpr,
                               K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                               SEG: tl.constexpr, SUB: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr,
                               USE_INITIAL_STATE: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr):
    """Reverse sweep. dq, dk [NV, tokens, H, K] (per value head), dbeta and dg [NV, tokens, H] ([NV, tokens, H, K]
    with USE_GK) receive this V-block's partial sums over V; dv [tokens, H, V] and dh0 are complete per V-block.

    The state each token's gradient needs: ungated, S_{t-1}, stepped back by subtraction from S_t (exact at a
    segment's first token: the checkpoint). Gated (USE_G), S_{t-1} rebuilt forward, never backward (dividing
    by exp(g_t) amplifies rounding by up to e^20 a token), with no memory beyond the forward's checkpoints and
    O(SEG / SUB + SUB) state steps a token, not O(SEG): a segment is cut into sub-blocks of SUB tokens. On
    entering a sub-block (at its last token), the state at its start is walked forward from the segment's
    checkpoint (at most SEG - SUB steps, once per sub-block); each token's S_{t-1} is then walked from that
    sub-block start (at most SUB - 1 steps). On average (SEG / SUB - 1) / 2 + (SUB - 1) / 2 = 7 steps a token
    at SEG = 64, SUB = 8, each one rank-1 update of the tile without reductions. Storing a segment's states
    instead would take SEG states per program; registers cannot be indexed by token."""
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)  # the value head's key head
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    p_S, m_S = state_offsets(i_nh, 0, i_v * BV, K, V, BK, BV)
    if USE_G:
        b_S = tl.zeros([BK, BV], dtype=tl.float32)
        b_Sb = tl.zeros([BK, BV], dtype=tl.float32)  # the state at the current sub-block's start
    else:
        b_S = tl.load(ht + p_S, mask=m_S, other=0.0)
    first_segment = tl.load(segment_offsets + i_n)
    if USE_FINAL_STATE_GRADIENT:
        b_dS = tl.load(dht + p_S, mask=m_S, other=0.0).to(tl.float32)
    else:
        b_dS = tl.zeros([BK, BV], dtype=tl.float32)

    # pointers to the last token of the sequence, stepped back one token per iteration
    last = (eos - 1) * H + i_h
    last_k = (eos - 1) * HK + i_hk
    part = i_v.to(tl.int64) * num_tokens * H  # this V-block's slice of the partial sums
    p_q = q + last_k * K + o_k
    p_k = k + last_k * K + o_k
    p_e = e + last * V + o_v
    p_do = do + last * V + o_v
    p_beta = beta + last
    p_dq = dq + (part + last) * K + o_k
    p_dk = dk + (part + last) * K + o_k
    p_dv = dv + last * V + o_v
    p_dbeta = dbeta + part + last
    if USE_GK:
        p_g = g + last * K + o_k
        p_dg = dg + (part + last) * K + o_k
    elif USE_G:
        p_g = g + last
        p_dg = dg + part + last
    for j in range(bos, eos):
        t = bos + eos - 1 - j  # the token of this step, from the last
        b_q = tl.load(p_q, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(p_k, mask=m_k, other=0.0).to(tl.float32)
        b_e = tl.load(p_e, mask=m_v, other=0.0)
        b_do = tl.load(p_do, mask=m_v, other=0.0).to(tl.float32)
        b_beta = tl.load(p_beta).to(tl.float32)
        b_vn = b_beta * b_e                                     # v'_t, bit-for-bit the forward's
        if USE_G:
            if USE_GK:  # one factor per row of the state
                b_gexp = tl.exp(tl.load(p_g, mask=m_k, other=0.0).to(tl.float32))[:, None]
            else:
                b_gexp = tl.exp(tl.load(p_g).to(tl.float32))
            rel = t - bos
            sub_start = bos + rel // SUB * SUB
            if (t == eos - 1) | ((rel + 1) % SUB == 0):  # entering a sub-block: its starting state
                p_h, _ = state_offsets((first_segment + rel // SEG) * H + i_h, 0, i_v * BV, K, V, BK, BV)
                b_Sb = _walk(tl.load(h + p_h, mask=m_S, other=0.0), bos + rel // SEG * SEG, sub_start,
                             k, e, beta, g, i_h, i_hk, H, HK, K, V, o_k, o_v, m_k, m_v, USE_GK)
            # b_S: the decayed state S~_t = exp(g_t) S_{t-1} that token t's write reads; S_t = S~_t + k v'^T
            b_S = b_gexp * _walk(b_Sb, sub_start, t, k, e, beta, g, i_h, i_hk, H, HK, K, V, o_k, o_v, m_k, m_v,
                                 USE_GK)
            b_dq = scale * (tl.sum(b_S * b_do[None, :], 1) + tl.sum(b_vn * b_do, 0) * b_k)
        else:
            # o_t = scale S_t^T q_t
            b_dq = scale * tl.sum(b_S * b_do[None, :], 1)
            # S_t = S_{t-1} + k_t v'_t^T: step the state back (exactly, from the checkpoint, at a segment's
            # first token)
            if (t - bos) % SEG == 0:
                p_h, _ = state_offsets((first_segment + (t - bos) // SEG) * H + i_h, 0, i_v * BV, K, V, BK, BV)
                b_S = tl.load(h + p_h, mask=m_S, other=0.0)
            else:
                b_S -= b_k[:, None] * b_vn[None, :]
        b_dS += (scale * b_q)[:, None] * b_do[None, :]          # dS_t
        # the write, against b_S (S_{t-1}, or S~_t gated)
        b_dvn = tl.sum(b_dS * b_k[:, None], 0)                  # dv' = dS_t^T k
        b_dv = b_beta * b_dvn                                   # v' = beta (v - b_S^T k)
        b_dk = tl.sum(b_dS * b_vn[None, :] - b_S * b_dv[None, :], 1)
        b_dbeta = tl.sum(b_dvn * b_e, 0)
        b_dS -= b_k[:, None] * b_dv[None, :]                    # dS_{t-1} (dS~_t gated)
        if USE_G:
            # S~_t = exp(g_t) S_{t-1}: dg_t = exp(g_t) <S_{t-1}, dS~_t> = <S~_t, dS~_t> (per row with USE_GK)
            if USE_GK:
                tl.store(p_dg, tl.sum(b_S * b_dS, 1), mask=m_k)
                p_g -= H * K
                p_dg -= H * K
            else:
                tl.store(p_dg, tl.sum(tl.sum(b_S * b_dS, 1), 0))
                p_g -= H
                p_dg -= H
            b_dS *= b_gexp                                      # dS_{t-1}
        tl.store(p_dq, b_dq, mask=m_k)
        tl.store(p_dk, b_dk, mask=m_k)
        tl.store(p_dv, b_dv.to(p_dv.dtype.element_ty), mask=m_v)
        tl.store(p_dbeta, b_dbeta)
        p_q -= HK * K
        p_k -= HK * K
        p_e -= H * V
        p_do -= H * V
        p_beta -= H
        p_dq -= H * K
        p_dk -= H * K
        p_dv -= H * V
        p_dbeta -= H
    if USE_INITIAL_STATE:
        tl.store(dh0 + p_S, b_dS, mask=m_S)


# the inference forward takes qk_l2norm (q and k normalized in its kernel), which autograd.run_form passes for
# use_qk_l2norm_in_kernel instead of launching the L2 norm on q and k first
NORMALIZES_QK = True


def _launch_config(V: int, BK: int, num_heads: int, max_tile: int, device: torch.device, v_first: bool = False):
    """(BV, num_warps): the widest V-block whose state tile fits max_tile, narrowed (down to 16) until
    there are at least two programs per SM, since each program is one serial walk over its tokens. v_first ([V, K]
    states): V_FIRST_ROWS rows on one warp, each a contiguous row of K."""
    if v_first:
        return min(V_FIRST_ROWS, next_power_of_2(V)), 1
    BV = min(next_power_of_2(V), max(16, max_tile // BK))
    while BV > 16 and cdiv(V, BV) * num_heads < 2 * num_sms(device):
        BV //= 2
    num_warps = 1 if INTERPRET else max(1, min(4, BK * BV // 1024))
    return BV, num_warps


def forward(q, k, v, beta, scale, initial_state, output_final_state, info, needs_backward=True,
            inplace_final_state=False, g=None, state_indices=None, raw_gate=None, beta_logits_scale=None,
            qk_l2norm=False, num_accepted_tokens=None, token_buffer=None, state_v_first=False):
    """Returns (o, final_state, saved, extras). q, k [B, T, Hk, K]; v [B, T, Hv, V]; beta and g (None: the
    ungated rule; log decays in any float dtype, read as fp32) [B, T, Hv], or [B, T, Hv, K] per key channel (KDA);
    Hk divides Hv. With
    needs_backward, saved = (e, per-segment states, final state) for the backward; without it (inference,
    decoding) nothing is saved or written beyond o and the final state. inplace_final_state writes the final
    state over initial_state (fp32, contiguous: checked by the api). state_indices [N] (inference): initial_state
    is a pool of states and sequence n's is slot state_indices[n] (api.fused_recurrent_delta_rule's
    ssm_state_indices); with inplace_final_state the final states go back into the slots. state_indices [N, W]
    (speculative decoding): a slot per token, the sequence starting from column num_accepted_tokens[n] - 1 (or 0),
    and with inplace_final_state each token's state written into its slot. Inference only:
    raw_gate = (A_log, dt_bias, softplus_beta, softplus_threshold): g holds the raw projection and the gate is made in
    the kernel; beta_logits_scale: beta holds logits, beta = beta_logits_scale sigmoid(beta); qk_l2norm: q, k
    normalized in the kernel; token_buffer = (buffer [R, steps, Hv, K, V] fp32, rows [N]): the state after token j
    of sequence n written into buffer[rows[n], j] (j < steps; rows[n] = -1: none); state_v_first (inference):
    initial_state and the final state (the pool with state_indices) hold states as [V, K]."""
    HK, K = k.shape[2], k.shape[3]
    H, V = v.shape[2], v.shape[3]
    assert H % HK == 0, f"the value heads ({H}) must be a multiple of the key heads ({HK})"
    N = info.num_seqs
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    token_states = state_indices is not None and state_indices.dim() == 2 and inplace_final_state
    if inplace_final_state:
        ht = initial_state
    elif output_final_state or needs_backward:  # the backward starts from the final state
        ht = torch.empty(N, H, *((V, K) if state_v_first else (K, V)), dtype=torch.float32, device=q.device)
    else:
        ht = None
    e = h = segment_offsets = None
    if needs_backward:
        segments = info.chunks(SEGMENT)
        e = torch.empty(v.shape, dtype=torch.float32, device=q.device)
        h = torch.empty(segments.num_chunks, H, K, V, dtype=torch.float32, device=q.device)
        segment_offsets = segments.chunk_offsets
    BK = head_block(K)
    BV, num_warps = _launch_config(V, BK, N * H, FWD_TILE, q.device, state_v_first)
    # sequences x heads on grid axis 0, which takes up to 2^31 - 1 programs (axis 1 only 65535)
    grid = (N * H, cdiv(V, BV))
    launch(
        fused_recurrent_fwd_kernel, grid,
        q, k, v, beta, g, *(raw_gate[:2] if raw_gate else (None, None)), o, e, h, initial_state, ht, state_indices,
        num_accepted_tokens, 0 if initial_state is None else initial_state.shape[0],
        1 if state_indices is None or state_indices.dim() == 1 else state_indices.shape[1],
        *(token_buffer if token_buffer else (None, None)),
        *((token_buffer[0].shape[1], token_buffer[0].shape[0]) if token_buffer else (1, 0)), info.cu_seqlens,
        segment_offsets, scale,
        1.0 if beta_logits_scale is None else float(beta_logits_scale),
        *((float(raw_gate[2]), float(raw_gate[3])) if raw_gate else (1.0, 20.0)),
        H=H, HK=HK, K=K, V=V, BK=BK, BV=BV, SEG=SEGMENT, USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=ht is not None and not token_states,  # (else every token's state went to its slot)
        SAVE_FOR_BACKWARD=needs_backward, USE_G=g is not None, USE_GK=g is not None and g.dim() == 4,
        USE_INDICES=state_indices is not None, SPEC=num_accepted_tokens is not None,
        FINAL_IN_POOL=state_indices is not None and state_indices.dim() == 1 and inplace_final_state,
        TOKEN_STATES=token_states, TOKEN_BUFFER=token_buffer is not None,
        GATE_IN_KERNEL=raw_gate is not None, BETA_SIGMOID=beta_logits_scale is not None, QK_L2NORM=qk_l2norm,
        V_FIRST=state_v_first, num_warps=num_warps,
    )
    saved = (e, h, ht) if needs_backward else ()
    return o, ht if output_final_state or inplace_final_state else None, saved, ()


def _sum_groups(dx: torch.Tensor, G: int) -> torch.Tensor:
    """[NV, B, T, Hv, K] partial sums -> [B, T, Hv / G, K]: over the V-blocks and over each key head's G value
    heads, in a fixed order (torch's reductions: deterministic)."""
    if G == 1:
        return dx.sum(0)
    NV, B, T, H, K = dx.shape
    return dx.view(NV, B, T, H // G, G, K).sum((0, 4))


def backward(q, k, v, beta, scale, initial_state, saved, do, dht, info, inplace_final_state=False, g=None):
    """Returns (dq, dk, dv, dbeta, dh0 or None, dg or None); dq, dk, dbeta, dg in fp32, dv in v's dtype."""
    e, h, ht = saved
    HK, K = k.shape[2], k.shape[3]
    H, V = v.shape[2], v.shape[3]
    G = H // HK
    N = info.num_seqs
    BK = head_block(K)
    BV, num_warps = _launch_config(V, BK, N * H, BWD_TILE, q.device)
    NV = cdiv(V, BV)
    dq = torch.empty(NV, *v.shape[:3], K, dtype=torch.float32, device=q.device)
    dk = torch.empty(NV, *v.shape[:3], K, dtype=torch.float32, device=q.device)
    dbeta = torch.empty(NV, *beta.shape, dtype=torch.float32, device=q.device)
    dg = None if g is None else torch.empty(NV, *g.shape, dtype=torch.float32, device=q.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=q.device)
    dh0 = None if initial_state is None else torch.empty(N, H, K, V, dtype=torch.float32, device=q.device)
    launch(
        fused_recurrent_bwd_kernel, (N * H, NV),
        q, k, beta, g, e, h, do, ht, dht, dq, dk, dv, dbeta, dg, dh0, info.cu_seqlens,
        info.chunks(SEGMENT).chunk_offsets, scale, info.total_tokens, H=H, HK=HK, K=K, V=V, BK=BK, BV=BV,
        SEG=SEGMENT, SUB=SUBSEGMENT, USE_FINAL_STATE_GRADIENT=dht is not None,
        USE_INITIAL_STATE=initial_state is not None, USE_G=g is not None, USE_GK=g is not None and g.dim() == 4,
        num_warps=num_warps,
    )
    # V-block (and value-head group) partial sums, added in a fixed order
    return (_sum_groups(dq, G), _sum_groups(dk, G), dv, dbeta.sum(0), dh0,
            None if dg is None else dg.sum(0))
