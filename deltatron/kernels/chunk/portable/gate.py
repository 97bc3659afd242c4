"""The gated rule's log decays inside a chunk (DESIGN.md §11): γ, the cumulative sum of g from the chunk's start, the
decay factors the stages take from it under their USE_G constexpr, and the gradient of g back through the sum; and
KDA's per-channel decays (DESIGN.md §12): the gate's sums within sub-chunks, made once a chunk by channel_sums_stage,
from which the stages form their exponents on chip under USE_GK with the helpers below (channel_sums, channel_decays,
channel_scores, channel_mix).

The stages write their shares of that gradient per row and per K-tile, and the sums across tiles happen here in a
fixed order, so that dg is bitwise the same from run to run, as every other gradient is.

Every factor is exp of a sum of g over a span of tokens, formed as a difference of γ before exponentiating, so no
exponent is positive: exp(γ_i) (the span (0, i]), E_ij = exp(γ_i - γ_j) for j <= i, exp(γ_C - γ_i) and exp(γ_C). A
gate of -20 a token takes a chunk's γ to -1280; exp(γ_i) exp(-γ_j) would overflow there."""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ...launch import launch
from ...utils import (SeqInfo, cdiv, chunk_span, mm, next_power_of_2, place_diagonal_blocks,
                      take_diagonal_blocks)


@triton.jit
def chunk_gamma_kernel(g, gam, cu_seqlens, chunk_indices, H: tl.constexpr, C: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start, n = chunk_span(cu_seqlens, chunk_indices, i_c, C)
    r = tl.arange(0, C)
    b_g = tl.load(g + (start + r) * H + i_h, mask=r < n, other=0.0).to(tl.float32)
    tl.store(gam + (start + r) * H + i_h, tl.cumsum(b_g, axis=0), mask=r < n)


def chunk_gamma(g: torch.Tensor, info: SeqInfo, chunk_size: int) -> torch.Tensor:
    """γ [.., TT, H] fp32: g summed from each chunk's first token to the token (chunks as the kernels cut them)."""
    gam = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    chunks = info.chunks(chunk_size)
    if chunks.num_chunks:
        launch(chunk_gamma_kernel, (chunks.num_chunks, g.shape[-1]), g, gam, info.cu_seqlens,
               chunks.chunk_indices, g.shape[-1], chunk_size, num_warps=1)
    return gam


def stage_gates(g: Optional[torch.Tensor], info: SeqInfo, chunk_size: int
                ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(γ, g_k): what the chunk stages take of a call's gate g. The per-head gate [.., TT, H] as γ (chunk_gamma:
    its sums along each chunk, USE_G); KDA's per-channel gate [.., TT, H, K] as its sums within sub-chunks
    (channel_sums_stage: USE_GK); no gate, neither."""
    if g is None:
        return None, None
    return (None, channel_sums_stage(g, info, chunk_size)) if g.dim() == 4 else (chunk_gamma(g, info, chunk_size), None)


@triton.jit
def load_gamma(gam, start, n, i_h, H: tl.constexpr, C: tl.constexpr):
    """(γ [C] of the chunk's rows, 0 past its end; γ_C, the last valid row's γ: the decay over the whole chunk).
    n: the tokens left in the sequence from start (C or more: a whole chunk)."""
    r = tl.arange(0, C)
    b_gam = tl.load(gam + (start + r) * H + i_h, mask=r < n, other=0.0)
    return b_gam, tl.sum(tl.where(r == tl.minimum(n, C) - 1, b_gam, 0.0), axis=0)


@triton.jit
def decay_matrix(b_gam_i, b_gam_j):
    """E_ij = exp(γ_i - γ_j) for j <= i; above the diagonal exp(0) = 1, which every caller masks away (clamping the
    exponent, not the result, keeps exp from overflowing there)."""
    return tl.exp(tl.minimum(b_gam_i[:, None] - b_gam_j[None, :], 0.0))


@triton.jit
def gate_grad_kernel(dgam, dg_rows, dg_chunks, dg, cu_seqlens, chunk_indices, TT, NT, H: tl.constexpr,
                     C: tl.constexpr, NK: tl.constexpr, NS: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start, n = chunk_span(cu_seqlens, chunk_indices, i_c, C)
    r = tl.arange(0, C)
    rows = start + r
    valid = r < n
    b_dgam = tl.load(dgam + rows * H + i_h, mask=valid, other=0.0)
    b_x = tl.zeros([C], dtype=tl.float32)  # x of the row before: sum_{i < j} x_i as a cumsum, see below
    b_state = tl.zeros([NS], dtype=tl.float32)
    for i_k in tl.static_range(NK):  # grads.dqkw's K-tile shares, in a fixed order
        b_dgam += tl.load(dg_rows + ((i_k * 2) * TT + rows) * H + i_h, mask=valid, other=0.0)
        b_x += tl.load(dg_rows + ((i_k * 2 + 1) * TT + rows - 1) * H + i_h, mask=valid & (r >= 1), other=0.0)
        b_state += tl.load(dg_chunks + ((i_k * NT + i_c) * H + i_h) * NS + tl.arange(0, NS))
    # dg_j = sum_{i >= j} dγ_i + exp(γ_C) <S, dS_next> + sum_{i < j} x_i. The last sum is the cumsum of x shifted by a
    # row, not the cumsum less x_j: the last row's x has the factor exp(γ_C - γ_C) = 1 and is of the state's size,
    # while under strong gates the others and dg are ~exp(g); subtracting it left dg's last row 10 % off (fp32)
    b_dg = tl.cumsum(b_dgam, axis=0, reverse=True) + tl.sum(b_state, axis=0) + tl.cumsum(b_x, axis=0)
    tl.store(dg + rows * H + i_h, b_dg, mask=valid)


def gate_grad(dgam: torch.Tensor, shares, info: SeqInfo, chunk_size: int) -> torch.Tensor:
    """dg [.., TT, H] fp32: the gradient of g, from the per-row dγ (portable.wy_bwd's share, dgam) and grads.dqkw's
    K-tile shares (dg_rows [NK, 2, TT, H]: dγ and x_i = exp(γ_C - γ_i) k_i^T dS_next v'_i; dg_chunks [NK, NT, H, NS]:
    exp(γ_C) <S, dS_next> in NS parts), by DESIGN.md §11: the reverse sum of dγ along the chunk (γ_i sums g_j for
    j <= i), the state's share for every token, and x_i for the tokens after i."""
    dg_rows, dg_chunks = shares
    dg = torch.empty_like(dgam)
    chunks = info.chunks(chunk_size)
    if chunks.num_chunks:
        launch(gate_grad_kernel, (chunks.num_chunks, dgam.shape[-1]), dgam, dg_rows, dg_chunks, dg, info.cu_seqlens,
               chunks.chunk_indices, info.total_tokens, chunks.num_chunks, dgam.shape[-1], chunk_size,
               dg_rows.shape[0], dg_chunks.shape[-1], num_warps=1)
    return dg


# KDA's per-channel gate (USE_GK, DESIGN.md §12): g [.., TT, H, K], a log decay per token, head and key channel. A
# chunk's cumulative sums reach -1280 under strong gates, where a difference of two of them carries ~1e-4 of fp32
# rounding in the exponent even when the difference is near 0. So every exponent here is a running sum of g over its
# own span, or a sum of such sums (one sign throughout: the rounding is relative to the result): the chunk is cut into
# sub-chunks of SUB tokens, each with its prefix sums, its suffix sums and its total, and a span that crosses
# sub-chunks adds the totals of those it passes. Every exponent is <= 0.
SUB = tl.constexpr(16)
# Within a sub-chunk whose total decay stays above e^-FACTOR_BOUND in every channel, exp(g summed over (j, i]) =
# exp(P_i) exp(-P_j) with both factors inside [e^-60, e^60] (no overflow in fp32), so the sub-chunk's block of scores
# is one product of scaled rows and columns instead of a loop over its columns. Each factor's exponent carries
# rounding ~ eps |P| <= 60 eps, so the pair's relative error is at most ~1e-5 whatever the span (DESIGN.md §12);
# a tile with a stronger sub-chunk takes the running sums, exact to ~eps |span|.
FACTOR_BOUND = tl.constexpr(60.0)
# the channel tile of channel_scores (16-wide product tiles gave wrong results on the H200 with triton 3.6: wy_launch)
SCORE_TILE = tl.constexpr(32)


# The stages read the gate as channel_sums_stage leaves it, once a chunk: [.., TT, H, SUM_PLANES, K] fp32 holding, per
# token, head and channel, g itself, P (g summed from the row's sub-chunk start through the row) and X (g summed over
# the rows after it to its sub-chunk's end). Formed in each stage instead, these scans and their reductions across
# threads were the largest share of every per-channel stage's instructions (docs/performance.md, KDA).
SUM_PLANES = tl.constexpr(3)


@triton.jit
def gate_rows(gs, start, i_h, H: tl.constexpr, K: tl.constexpr):
    """The planes' row of token start and head i_h (rows SUM_PLANES * H * K apart; g, P and X at 0, K and 2K)."""
    return gs + (start * H + i_h) * (SUM_PLANES * K)


@triton.jit
def scan_sub_chunks(g, n, GS: tl.constexpr, d0, D: tl.constexpr, C: tl.constexpr, BD: tl.constexpr):
    """Channels [d0, d0 + BD) of one chunk's g [C, BD] and its sums within sub-chunks (P, X [C, BD]), fp32: the scans
    channel_sums_stage stores. g points at the chunk's first token and its head, GS apart a row; rows from n on and
    channels from D on read as 0."""
    NS: tl.constexpr = C // SUB
    r = tl.arange(0, C)
    c = d0 + tl.arange(0, BD)
    b_g = tl.load(g + r[:, None] * GS + c[None, :], mask=(r[:, None] < n) & (c[None, :] < D), other=0.0).to(tl.float32)
    # the next row's g inside the sub-chunk: X as a running sum of its own terms, not as T - P
    nxt = r + 1
    b_gn = tl.load(g + nxt[:, None] * GS + c[None, :], mask=((nxt < n) & (nxt % SUB != 0))[:, None] & (c[None, :] < D),
                   other=0.0).to(tl.float32)
    p3 = tl.cumsum(tl.reshape(b_g, (NS, SUB, BD)), axis=1)
    x3 = tl.cumsum(tl.reshape(b_gn, (NS, SUB, BD)), axis=1, reverse=True)
    return b_g, tl.reshape(p3, (C, BD)), tl.reshape(x3, (C, BD))


@triton.jit
def channel_sums_kernel(g, gs, cu_seqlens, chunk_indices, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                        BK: tl.constexpr):
    i_c, i_h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, n = chunk_span(cu_seqlens, chunk_indices, i_c, C)
    r = tl.arange(0, C)
    c = i_k * BK + tl.arange(0, BK)
    b_g, b_p, b_x = scan_sub_chunks(g + start * H * K + i_h * K, n, H * K, i_k * BK, K, C, BK)
    dst = gate_rows(gs, start, i_h, H, K) + r[:, None] * (SUM_PLANES * H * K) + c[None, :]
    mask = (r[:, None] < n) & (c[None, :] < K)
    tl.store(dst, b_g, mask=mask)
    tl.store(dst + K, b_p, mask=mask)
    tl.store(dst + 2 * K, b_x, mask=mask)


def channel_sums_stage(g: torch.Tensor, info: SeqInfo, chunk_size: int) -> torch.Tensor:
    """KDA's gate g [.., TT, H, K] as the chunk stages read it: [.., TT, H, SUM_PLANES, K] fp32 holding g, P and X
    (gate_rows), formed once a chunk, in parallel over chunks, heads and 64 channels."""
    H, K = g.shape[-2], g.shape[-1]
    gs = g.new_empty(*g.shape[:-1], SUM_PLANES.value, K, dtype=torch.float32)
    chunks = info.chunks(chunk_size)
    BK = min(64, next_power_of_2(K))
    if chunks.num_chunks:
        launch(channel_sums_kernel, (chunks.num_chunks, H, cdiv(K, BK)), g, gs, info.cu_seqlens,
               chunks.chunk_indices, H, K, chunk_size, BK, num_warps=4)
    return gs


def gate_sums(gk: Optional[torch.Tensor], info: SeqInfo, chunk_size: int) -> Optional[torch.Tensor]:
    """KDA's gate as the stages take it: channel_sums_stage's planes, as given ([.., TT, H, SUM_PLANES, K]) or made
    from g [.., TT, H, K]; None stays None."""
    if gk is None or gk.dim() == 5:
        return gk
    return channel_sums_stage(gk, info, chunk_size)


@triton.jit
def channel_sums(gs, n, GS: tl.constexpr, d0, D: tl.constexpr, C: tl.constexpr, BD: tl.constexpr):
    """Channels [d0, d0 + BD) of one chunk's sums within sub-chunks, fp32, loaded from channel_sums_stage's planes:
    (P, X [C, BD]; T [C/SUB, BD]: each sub-chunk's total, P of its last row in the sequence). gs points at the
    chunk's first token and its head (gate_rows), GS apart a row; rows from n on and channels from D on read as 0."""
    NS: tl.constexpr = C // SUB
    r = tl.arange(0, C)
    c = d0 + tl.arange(0, BD)
    mask = (r[:, None] < n) & (c[None, :] < D)
    b_p = tl.load(gs + D + r[:, None] * GS + c[None, :], mask=mask, other=0.0)
    b_x = tl.load(gs + 2 * D + r[:, None] * GS + c[None, :], mask=mask, other=0.0)
    s = tl.arange(0, NS)
    last = tl.minimum(s * SUB + SUB - 1, n - 1)
    t = tl.load(gs + D + last[:, None] * GS + c[None, :], mask=(s * SUB < n)[:, None] & (c[None, :] < D), other=0.0)
    return b_p, b_x, t


@triton.jit
def sub_chunk_gates(gs, n, GS: tl.constexpr, d0, D: tl.constexpr, C: tl.constexpr, BD: tl.constexpr):
    """Channels [d0, d0 + BD) of one chunk's g as [C/SUB, SUB, BD] fp32 (the running sums of a tile that does not
    factor), from the planes as channel_sums reads them."""
    r = tl.arange(0, C)
    c = d0 + tl.arange(0, BD)
    b_g = tl.load(gs + r[:, None] * GS + c[None, :], mask=(r[:, None] < n) & (c[None, :] < D), other=0.0)
    return tl.reshape(b_g, (C // SUB, SUB, BD))


@triton.jit
def channel_decays(gs, n, GS: tl.constexpr, d0, D: tl.constexpr, C: tl.constexpr, BD: tl.constexpr):
    """Channels [d0, d0 + BD) of one chunk's decay exponents, fp32: (Γ [C, BD], g summed from the chunk's start
    through the row: exp(Γ) scales Q and W's K; B [C, BD], g summed over the rows after it to the chunk's end:
    exp(B) scales K in the state's update; Γ_C [BD], the whole chunk's sum: exp(Γ_C) decays the state). Arguments as
    channel_sums'."""
    return decays_of_sums(channel_sums(gs, n, GS, d0, D, C, BD), C)


@triton.jit
def decays_of_sums(sums, C: tl.constexpr):
    """channel_decays' (Γ, B, Γ_C) from a tile's channel_sums (P, X, T), as channel_mix takes them too: the totals of
    the sub-chunks before a row's added to P, those after it to X."""
    b_p, b_x, t = sums
    NS: tl.constexpr = C // SUB
    block = tl.arange(0, C) // SUB
    for s in tl.static_range(NS):
        t_s = sub_chunk_total(t, s)[None, :]
        b_p += tl.where((block > s)[:, None], t_s, 0.0)
        b_x += tl.where((block < s)[:, None], t_s, 0.0)
    return b_p, b_x, tl.sum(t, axis=0)


@triton.jit
def store_decays(b_k, q, decays, kd, qd, dc, src, dst, mask, c, D: tl.constexpr, STORE_Q: tl.constexpr):
    """One channel tile of channel_decay_stage's tensors, from the tile's channel_decays (decays): exp(Γ_C - Γ) ⊙ K
    (b_k, the tile as loaded) at kd + dst, exp(Γ_C) at dc + c (channels c < D), and with STORE_Q exp(Γ) ⊙ Q (loaded
    from q + src) at qd + dst; the decayed rows rounded to the input dtype."""
    b_gam, b_rest, b_last = decays
    tl.store(kd + dst, (b_k.to(tl.float32) * tl.exp(b_rest)).to(b_k.dtype), mask=mask)
    if STORE_Q:
        b_q = tl.load(q + src, mask=mask, other=0.0)
        tl.store(qd + dst, (b_q.to(tl.float32) * tl.exp(b_gam)).to(b_q.dtype), mask=mask)
    tl.store(dc + c, tl.exp(b_last), mask=c < D)


@triton.jit
def channel_decay_kernel(k, q, gs, kd, qd, dc, cu_seqlens, chunk_indices, H: tl.constexpr, HK: tl.constexpr,
                         K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, STORE_Q: tl.constexpr):
    i_c, i_h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, n = chunk_span(cu_seqlens, chunk_indices, i_c, C)
    i_hk = i_h // (H // HK)
    r = tl.arange(0, C)
    c = i_k * BK + tl.arange(0, BK)
    decays = channel_decays(gate_rows(gs, start, i_h, H, K), n, SUM_PLANES * H * K, i_k * BK, K, C, BK)
    mask = (r[:, None] < n) & (c[None, :] < K)
    src = (start + r[:, None]) * (HK * K) + i_hk * K + c[None, :]
    dst = (start + r[:, None]) * (H * K) + i_h * K + c[None, :]
    b_k = tl.load(k + src, mask=mask, other=0.0)
    store_decays(b_k, q, decays, kd, qd, dc + (i_c * H + i_h) * K, src, dst, mask, c, K, STORE_Q)


class ChannelDecays(NamedTuple):
    """KDA's per-channel decays as the serial passes take them (written by the WY stage beside W, or by
    channel_decay_stage): formed once a chunk, in parallel over chunks, rather than once a chunk in every V-block
    program of a walk."""
    sums: torch.Tensor           # the gate's planes (channel_sums_stage): the scores, where a pass forms them
    k: torch.Tensor              # exp(Γ_C - Γ) ⊙ K [.., TT, H, K] per value head, rounded to k's dtype
    q: Optional[torch.Tensor]    # exp(Γ) ⊙ Q likewise (the reverse pass), or None
    chunk: torch.Tensor          # exp(Γ_C) [NT, H, K] fp32: the state's decay over each chunk


def channel_decay_buffers(k: torch.Tensor, gk: torch.Tensor, info: SeqInfo, chunk_size: int,
                          with_q: bool = False) -> ChannelDecays:
    """ChannelDecays of KDA's gate (g or its planes: gate_sums) with its tensors allocated, not yet written: for
    channel_decay_stage, or for the WY stage to fill beside W (wy.wy_fwd, wy.recompute_w_u: decays=)."""
    gs = gate_sums(gk, info, chunk_size)
    H, K = gs.shape[-3], k.shape[-1]
    kd = k.new_empty(*k.shape[:-2], H, K)
    return ChannelDecays(gs, kd, torch.empty_like(kd) if with_q else None,
                         gs.new_empty(info.chunks(chunk_size).num_chunks, H, K))


def channel_decay_stage(k: torch.Tensor, gk: torch.Tensor, info: SeqInfo, chunk_size: int,
                        q: Optional[torch.Tensor] = None) -> ChannelDecays:
    """The decays of KDA's state updates (DESIGN.md §12): exp(Γ_C - Γ) ⊙ K, exp(Γ_C) per chunk, and with q
    exp(Γ) ⊙ Q, each factor from channel_decays (sums within sub-chunks), rounded as the passes did on chip. A launch
    of its own, for the passes called without the WY stage that makes them otherwise."""
    HK, K = k.shape[-2], k.shape[-1]
    chunks = info.chunks(chunk_size)
    decays = channel_decay_buffers(k, gk, info, chunk_size, q is not None)
    H = decays.k.shape[-2]
    BK = min(64, next_power_of_2(K))
    if chunks.num_chunks:
        launch(channel_decay_kernel, (chunks.num_chunks, H, cdiv(K, BK)), k, q, decays.sums, decays.k, decays.q,
               decays.chunk, info.cu_seqlens, chunks.chunk_indices, H, HK, K, chunk_size, BK, q is not None,
               num_warps=4)
    return decays


def serial_decays(gk, k: torch.Tensor, info: SeqInfo, chunk_size: int, q: Optional[torch.Tensor] = None
                  ) -> Optional[ChannelDecays]:
    """gk as the serial passes take it: None (no per-channel gate), ChannelDecays as given, or from KDA's g (or its
    planes)."""
    if gk is None or isinstance(gk, ChannelDecays):
        return gk
    return channel_decay_stage(k, gk, info, chunk_size, q)


@triton.jit
def factored(t):
    """Whether every sub-chunk total t [NS, BD] of a tile lets its within-sub-chunk decays factor (FACTOR_BOUND)."""
    return tl.min(tl.min(t, axis=1), axis=0) >= -FACTOR_BOUND


@triton.jit
def sub_chunk_total(t, s: tl.constexpr):
    """Sub-chunk s's totals [BD] of a tile's t [NS, BD]."""
    return tl.sum(tl.where((tl.arange(0, t.shape[0]) == s)[:, None], t, 0.0), axis=0)


@triton.jit
def decayed_operand(x, DT: tl.constexpr):
    """x [.., BD] fp32 as an operand of a product whose factors reach e^FACTOR_BOUND: in DT where DT has fp32's
    exponent range (bf16, fp32), else (fp16) in fp32, which the caller's precision (tf32 for 16-bit) multiplies."""
    if DT == tl.float16:
        y = x
    else:
        y = x.to(DT)
    return y


@triton.jit
def channel_scores(x, k, g, n, XS: tl.constexpr, KS: tl.constexpr, GS: tl.constexpr, K: tl.constexpr,
                   C: tl.constexpr, DIAG: tl.constexpr, PRECISION: tl.constexpr):
    """[C, C] fp32 scores of one chunk under the per-channel gate: sum_c x_ic k_jc exp(Γ_i - Γ_j)[c] for j < i (DIAG:
    j <= i), 0 elsewhere: A's (x = k, passed as None: the rows are k's own tile, loaded once) and the output's P
    (x = q). x, k point at the chunk's first token and their heads, g at its row of the gate's planes (gate_rows), XS,
    KS, GS apart a row; rows from n on are 0. How: channel_score_pair."""
    scores, _ = channel_score_pair(x, x, k, g, n, XS, XS, KS, GS, K, C, False, PRECISION)
    r = tl.arange(0, C)
    if DIAG:
        return tl.where(r[:, None] >= r[None, :], scores, 0.0)
    return tl.where(r[:, None] > r[None, :], scores, 0.0)


@triton.jit
def channel_score_pair(x, y, k, g, n, XS: tl.constexpr, YS: tl.constexpr, KS: tl.constexpr, GS: tl.constexpr,
                       K: tl.constexpr, C: tl.constexpr, PAIR: tl.constexpr, PRECISION: tl.constexpr):
    """The scores of x against k under the per-channel gate, [C, C] fp32, exact for j <= i (above the diagonal they
    hold what the products leave there: the caller masks), and with PAIR those of y against the same k from the same
    pass over the channels (the WY stage's A and P: k's decayed columns are formed once for both); without PAIR the
    second result is the first. y points as x does, YS apart a row; x None: the rows are k's (A's scores).

    The rows of sub-chunk I take their decays from I's start: exp(Γ_i - Γ_j) = exp(P_i) exp(X_j + the totals of the
    sub-chunks strictly between J and I) for a column j of an earlier sub-chunk J, both factors <= 1; within I, where
    the tile's sub-chunks all stay above e^-FACTOR_BOUND (factored), exp(P_i) exp(-P_j). So each row sub-chunk is one
    product of the decayed rows with the columns decayed to its start: C/SUB 2-D products per channel tile. A tile
    with a stronger sub-chunk keeps the decay inside the sum within the sub-chunks: D_ij = exp(g summed over (j, i]),
    a column j at a time ([C/SUB, SUB, channels]: a running sum down the rows from j), then the sum over c."""
    NS: tl.constexpr = C // SUB
    BK: tl.constexpr = SCORE_TILE
    r = tl.arange(0, C)
    block = r // SUB  # each row's sub-chunk
    s = tl.arange(0, SUB)
    DT: tl.constexpr = k.dtype.element_ty  # (x's and y's too)
    scores = tl.zeros([C, C], dtype=tl.float32)
    scores_y = tl.zeros([C, C], dtype=tl.float32)
    for k0 in range(0, K, BK):
        c = k0 + tl.arange(0, BK)
        m = (r[:, None] < n) & (c[None, :] < K)
        b_k = tl.load(k + r[:, None] * KS + c[None, :], mask=m, other=0.0).to(tl.float32)
        if x is None:
            b_x = b_k
        else:
            b_x = tl.load(x + r[:, None] * XS + c[None, :], mask=m, other=0.0).to(tl.float32)
        b_p, b_after, t = channel_sums(g, n, GS, k0, K, C, BK)
        fac = factored(t)
        fac_block = tl.where(fac, block, -1)  # the rows' sub-chunks where the tile factors within them, else none
        e_p = tl.exp(b_p)
        rows = decayed_operand(b_x * e_p, DT)
        if PAIR:
            b_y = tl.load(y + r[:, None] * YS + c[None, :], mask=m, other=0.0).to(tl.float32)
            rows_y = decayed_operand(b_y * e_p, DT)
        # the columns decayed to their sub-chunk's end by exp(X) (<= 1), and within a factored one from its start by
        # exp(-P); a column of an earlier sub-chunk takes exp(T) of each sub-chunk it then passes, one a step: a
        # product of factors <= 1, whose exponents keep their one sign, with one exp a column rather than one a step
        k_far = b_k * tl.exp(b_after)
        k_near = b_k * tl.exp(tl.where((fac_block >= 0)[:, None], -b_p, 0.0))
        for I in tl.static_range(NS):
            earlier = (block < I)[:, None]
            cols = tl.trans(decayed_operand(tl.where(earlier, k_far, tl.where((fac_block == I)[:, None], k_near, 0.0)),
                                            DT))
            scores += mm(tl.where((block == I)[:, None], rows, 0.0), cols, PRECISION)
            if PAIR:
                scores_y += mm(tl.where((block == I)[:, None], rows_y, 0.0), cols, PRECISION)
            if I < NS - 1:
                k_far = tl.where(earlier, k_far * tl.exp(sub_chunk_total(t, I))[None, :], k_far)
        if not fac:
            # within a sub-chunk, column j of every sub-chunk at a time: exponents g summed over (j, i], a running
            # sum down the rows from j. A loop, not unrolled: unrolled, the steps' [C/16, 16, BK] terms are live
            # together and spill on sm_90
            g3 = sub_chunk_gates(g, n, GS, k0, K, C, BK)
            x3 = tl.reshape(b_x, (NS, SUB, BK))
            k3 = tl.reshape(b_k, (NS, SUB, BK))
            diag = tl.zeros([NS, SUB, SUB], dtype=tl.float32)
            diag_y = tl.zeros([NS, SUB, SUB], dtype=tl.float32)
            y3 = x3
            if PAIR:
                y3 = tl.reshape(b_y, (NS, SUB, BK))
            for j in range(SUB):
                span = tl.cumsum(tl.where((s > j)[None, :, None], g3, 0.0), axis=1)
                decay = tl.where((s >= j)[None, :, None], tl.exp(span), 0.0)
                k_j = tl.sum(tl.where((s == j)[None, :, None], k3, 0.0), axis=1)  # [NS, BK]
                d_j = tl.sum(x3 * k_j[:, None, :] * decay, axis=2)  # [NS, SUB]: rows i, column j
                diag += tl.where((s == j)[None, None, :], d_j[:, :, None], 0.0)
                if PAIR:
                    d_j = tl.sum(y3 * k_j[:, None, :] * decay, axis=2)
                    diag_y += tl.where((s == j)[None, None, :], d_j[:, :, None], 0.0)
            scores += place_diagonal_blocks(diag, C)
            if PAIR:
                scores_y += place_diagonal_blocks(diag_y, C)
    if not PAIR:
        scores_y = scores
    return scores, scores_y


@triton.jit
def channel_mix(m, b_x, gs, sums, n, GS: tl.constexpr, d0, D: tl.constexpr, C: tl.constexpr, BD: tl.constexpr,
                TRANS: tl.constexpr, PRECISION: tl.constexpr):
    """Channels [d0, d0 + BD) of one chunk's product of a score gradient m [C, C] (fp32, strictly lower: rows i,
    columns j < i) with rows of x under the per-channel decays, [C, BD] fp32: sum_j m_ij x_jc exp(Γ_i - Γ_j)[c] (row
    i), or TRANS: sum_i m_ij x_ic exp(Γ_i - Γ_j)[c] (row j). The backward's counterpart of channel_scores, with its
    decays: the result's rows of sub-chunk I take them from I's start, exp(P_i) on the result and exp(X_j + the
    totals between J and I) on the rows j of x of earlier sub-chunks, exp(-P_j) within I where the tile is factored
    (TRANS: from the end of the result row's sub-chunk J, exp(X_j) on the result and exp(P_i + the totals between),
    within J exp(-X_i), on x's later rows): one 2-D product of m (or m^T) with decayed x a sub-chunk, fp32 operands at
    PRECISION (16-bit operands left the gate's gradient 1.05e-2 off in bf16, where its bound is 1e-2). A tile
    with a stronger sub-chunk keeps the decay inside the sum within the sub-chunks, exp(g summed over (j, i]) per
    channel in fp32, a column j at a time. sums: channel_sums of the tile's channels (shared with the caller's
    decays), from the gate's planes at gs (gate_rows, GS apart a row: g itself for such a tile); b_x: x's tile
    [C, BD] fp32 as the caller loaded it for its own terms, zero in rows from n on and channels from D on."""
    NS: tl.constexpr = C // SUB
    r = tl.arange(0, C)
    block = r // SUB
    s = tl.arange(0, SUB)
    b_p, b_after, t = sums
    fac = factored(t)
    fac_block = tl.where(fac, block, -1)
    # mix: the result's sub-chunks I in order, x's rows of earlier sub-chunks decayed to I's start by exp(X + the
    # totals between), I's own by exp(-P), the result's rows by exp(P). mixᵀ mirrors it: the result's sub-chunks from
    # the last, x's rows of later sub-chunks decayed to its end by exp(P + the totals between), its own by exp(-X),
    # the result's rows by exp(X)
    b_m = tl.trans(m) if TRANS else m
    b_near = b_after if TRANS else b_p  # the exponent inside the result's own sub-chunk
    b_far = b_p if TRANS else b_after  # the exponent of x's rows of the other sub-chunks, to their boundary
    # as channel_scores' columns: x's rows decayed to their boundary once, then by exp(T) of each sub-chunk passed
    y_far = b_x * tl.exp(b_far)
    y_near = b_x * tl.exp(tl.where((fac_block >= 0)[:, None], -b_near, 0.0))
    out = tl.zeros([C, BD], dtype=tl.float32)
    for step in tl.static_range(NS):
        I = NS - 1 - step if TRANS else step  # the result's sub-chunk
        other = ((block > I) if TRANS else (block < I))[:, None]  # x's rows on the far side of I's boundary
        b_y = tl.where(other, y_far, tl.where((fac_block == I)[:, None], y_near, 0.0))
        out += tl.where((block == I)[:, None], mm(b_m, b_y, PRECISION), 0.0)
        if step < NS - 1:
            y_far = tl.where(other, y_far * tl.exp(sub_chunk_total(t, I))[None, :], y_far)
    out *= tl.exp(b_near)
    if not fac:
        g3 = sub_chunk_gates(gs, n, GS, d0, D, C, BD)
        x3 = tl.reshape(b_x, (NS, SUB, BD))
        m_diag = take_diagonal_blocks(m, SUB)  # [sub-chunk, i, j]
        inner = tl.zeros([NS, SUB, BD], dtype=tl.float32)
        for j in range(SUB):
            # column j of every sub-chunk: exp(g summed over (j, i]) on rows i > j, a running sum down the rows
            later_rows = (s > j)[None, :, None]
            decay = tl.where(later_rows, tl.exp(tl.cumsum(tl.where(later_rows, g3, 0.0), axis=1)), 0.0)
            m_j = tl.sum(tl.where((s == j)[None, None, :], m_diag, 0.0), axis=2)  # [sub-chunk, i]
            if TRANS:
                row = tl.sum(m_j[:, :, None] * x3 * decay, axis=1)  # result row j
                inner += tl.where((s == j)[None, :, None], row[:, None, :], 0.0)
            else:
                x_j = tl.sum(tl.where((s == j)[None, :, None], x3, 0.0), axis=1)
                inner += m_j[:, :, None] * x_j[:, None, :] * decay
        out += tl.reshape(inner, (C, BD))
    return out


@triton.jit
def channel_gate_grad_kernel(dgam, dg_rows, dg_chunks, dg, cu_seqlens, chunk_indices, TT, H: tl.constexpr,
                             K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    i_c, i_h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, n = chunk_span(cu_seqlens, chunk_indices, i_c, C)
    r = tl.arange(0, C)
    ck = i_k * BK + tl.arange(0, BK)
    offs = ((start + r)[:, None] * H + i_h) * K + ck[None, :]
    mask = (r[:, None] < n) & (ck[None, :] < K)
    b_dgam = (tl.load(dgam + offs, mask=mask, other=0.0) + tl.load(dg_rows + offs, mask=mask, other=0.0))
    b_x = tl.load(dg_rows + TT * H * K + offs - H * K, mask=mask & (r[:, None] >= 1), other=0.0)  # the row before's
    b_state = tl.load(dg_chunks + (i_c * H + i_h) * K + ck, mask=ck < K, other=0.0)
    # dg_j = sum_{i >= j} dΓ_i + exp(Γ_C) ⊙ rowsum(S ⊙ dS_next) + sum_{i < j} x_i, per channel (the last sum as
    # gate_grad_kernel's: a cumsum of x shifted by a row)
    b_dg = tl.cumsum(b_dgam, axis=0, reverse=True) + b_state[None, :] + tl.cumsum(b_x, axis=0)
    tl.store(dg + offs, b_dg, mask=mask)


def channel_gate_grad(dgam: torch.Tensor, shares, info: SeqInfo, chunk_size: int) -> torch.Tensor:
    """dg [.., TT, H, K] fp32, the gradient of KDA's g: gate_grad per key channel (DESIGN.md §12), from wy_bwd's dΓ
    (dgam [.., TT, H, K]) and grads.dqkw's shares (dg_rows [2, TT, H, K]: dΓ and x_i = exp(Γ_C - Γ_i) ⊙ k_i ⊙
    (dS_next v'_i); dg_chunks [NT, H, K]: exp(Γ_C) ⊙ rowsum(S ⊙ dS_next))."""
    dg_rows, dg_chunks = shares
    dg = torch.empty_like(dgam)
    chunks = info.chunks(chunk_size)
    H, K = dgam.shape[-2], dgam.shape[-1]
    BK = min(64, next_power_of_2(K))
    if chunks.num_chunks:
        launch(channel_gate_grad_kernel, (chunks.num_chunks, H, cdiv(K, BK)), dgam, dg_rows, dg_chunks, dg,
               info.cu_seqlens, chunks.chunk_indices, info.total_tokens, H, K, chunk_size, BK, num_warps=4)
    return dg
