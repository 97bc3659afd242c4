"""The WY stage (DESIGN.md §2, §3, §5): T~ = (I + A)^{-1} per chunk, then W = T~ (beta K), U = T~ (beta V), or
T's pair instead.

One kernel, four entry points:
    wy_fwd(k, v, beta, ...) -> (T~, W, U)           A from K on chip, inverted, applied; T~ stored for training only;
    tinv_pair_fwd(k, beta, ...) -> (T~, Tb)         Tb = T~ diag(beta) as its 16-bit pair: the residual form's input
                                                    (the Hopper walk forms V' = Tb (V - K S), gated
                                                    V' = Tb (V - diag(exp(γ)) K S): no W, U at all);
    tinv_fwd(k, beta, ...) -> T~                    fused_chunk's input;
    recompute_w_u(k, v, beta, T~, ...) -> (W, U)    from a stored T~: the backward's two-launch recompute.
Gated (USE_G, DESIGN.md §11): A carries exp(γ_i - γ_j) and W = T~ (beta exp(γ) K), so W's pair is T~ diag(beta
exp(γ)) while U's, and the residual form's Tb, stay T~ diag(beta); per-channel gate (USE_GK, KDA, DESIGN.md §12): A from
gate.channel_scores and W = T~ diag(beta) (exp(Γ) ⊙ K), the per-channel factor on K's columns (rounded with K to the
input dtype for the product), T~'s pair as the ungated rule's; KDA's W pass also writes the serial passes' decays
(exp(Γ_C - Γ) ⊙ K, exp(Γ_C) and exp(Γ) ⊙ Q: gate.store_decays) from the sums it forms for exp(Γ), so no launch of
their own makes them; KDA's forward forms the output's scores P beside A (kkt.kkt_scores_tile), so that the output
stage reads them with exp(Γ) ⊙ Q instead of forming them under the decays. Grouped value heads: W, U and T~ per value head, K read
from its key head. W and U are stored in the input dtype (they feed 16-bit products). Every producer of W, U, here and
walk.state_wy_fwd, goes through tinv_beta_pair and wy_product, so they agree bit for bit. The plan chooses the form
(plan.residual); the launch comes from plan.wy_launch."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...launch import launch
from ...utils import WY_PIPELINE_STAGES, SeqInfo, chunk_span, dot_precision, load_rows, mm, store_rows, tril_precision
from ..plan import Launch, wy_launch
from .gate import SUM_PLANES, ChannelDecays, channel_decays, gate_rows, gate_sums, load_gamma, store_decays
from .grads import causal_scores_t
from .kkt import kkt_scores_tile
from .solve_tril import tril_inverse, unit_lower_inverse


@triton.jit
def tinv_beta_pair(b_t, beta_c, b_decay, n, H: tl.constexpr, C: tl.constexpr, DT: tl.constexpr, DECAY: tl.constexpr):
    """T~ diag(beta) of one chunk (DECAY: T~ diag(beta b_decay), W's of the gated rule, b_decay = exp(γ) [C]) as a
    pair hi + lo of dtype DT (the input dtype; lo is zero for fp32). beta_c points at the chunk's first token and its
    head; beta past the chunk's end (row n on) reads as 0.

    W = (T~ diag(beta)) K, U = (T~ diag(beta)) V take K, V as they are (exact operands). Rounded to 16 bits alone,
    T~ diag(beta) would put 2^-9 (bf16) of error in every term of W's rows, which cancel when keys are nearly
    parallel; the pair leaves 2^-18 (DESIGN.md §2)."""
    rows = tl.arange(0, C)
    b_beta = tl.load(beta_c + rows * H, mask=rows < n, other=0.0).to(tl.float32)
    if DECAY:
        b_beta *= b_decay
    b_tb = b_t * b_beta[None, :]
    b_tb_hi = b_tb.to(DT)
    b_tb_lo = (b_tb - b_tb_hi.to(tl.float32)).to(DT)
    return b_tb_hi, b_tb_lo


@triton.jit
def wy_product(t_hi, t_lo, b_x, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    """(t_hi + t_lo) x in fp32 (t_lo only with SPLIT): a tile of W or U before its rounding to the input
    dtype. Every producer of W, U goes through here, so they agree bit for bit."""
    b_y = mm(t_hi, b_x, PRECISION)
    if SPLIT:
        b_y += mm(t_lo, b_x, PRECISION)
    return b_y


@triton.jit
def apply_tinv(t_hi, t_lo, x, y, g, n, HX: tl.constexpr, H: tl.constexpr, GS: tl.constexpr, D: tl.constexpr,
               BD: tl.constexpr, C: tl.constexpr, GK: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
               q, kd, qd, dc, DECAYS: tl.constexpr, DECAYS_Q: tl.constexpr):
    """y = (t_hi + t_lo) x for one chunk, BD columns of the head dimension D at a time (t_lo only with
    SPLIT); GK: y = (t_hi + t_lo) (exp(Γ) ⊙ x), Γ from KDA's g (g at the chunk's first token and its head, GS apart a
    row). x and y point at the chunk's first token and its head (of HX and H heads: K of a key head makes W of a
    value head); t_hi, t_lo have x's dtype. DECAYS (GK, x = K): the serial passes' decays of each tile too, from the
    same channel_decays (gate.store_decays into kd, dc and, DECAYS_Q, qd from q, laid out as x and y)."""
    rows = tl.arange(0, C)
    cols = tl.arange(0, BD)
    # one tile of offsets for all steps, the base pointers moved by d0: offsets computed per step are carried
    # by the software pipeliner as whole [C, BD] int32 tiles for the steps ahead, which spill under the cap
    x_offs = rows[:, None] * (HX * D) + cols[None, :]
    y_offs = rows[:, None] * (H * D) + cols[None, :]
    for d0 in range(0, D, BD):
        mask = (rows[:, None] < n) & (d0 + cols[None, :] < D)
        b_x = tl.load(x + d0 + x_offs, mask=mask, other=0.0)
        if GK:
            decays = channel_decays(g, n, GS, d0, D, C, BD)
            if DECAYS:
                store_decays(b_x, q, decays, kd, qd, dc, d0 + x_offs, d0 + y_offs, mask, d0 + cols, D, DECAYS_Q)
            b_x = (b_x.to(tl.float32) * tl.exp(decays[0])).to(b_x.dtype)
        b_y = wy_product(t_hi, t_lo, b_x, SPLIT, PRECISION)
        tl.store(y + d0 + y_offs, b_y.to(y.dtype.element_ty), mask=mask)


@triton.jit
def wy_kernel(k, v, beta, gam, tinv, w, u, tb, q, kd, qd, dc, scores, scale, cu_seqlens, chunk_indices,
              H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
              BW: tl.constexpr, BV: tl.constexpr, FUSED: tl.constexpr, STORE_TINV: tl.constexpr, APPLY: tl.constexpr,
              STORE_PAIR: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr, DECAYS: tl.constexpr,
              DECAYS_Q: tl.constexpr, SCORES: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
              TRIL_PREC: tl.constexpr, NEWTON: tl.constexpr):
    """FUSED: Tinv from K on chip (written out if STORE_TINV); else Tinv read from tinv. APPLY: W and U.
    STORE_PAIR: Tinv diag(beta) as its 16-bit pair into tb [.., H, 2C], hi in columns [0, C), lo in [C, 2C)
    (one [C, 2C] row block a chunk and head, so a TMA box of W's shape [64, 128] takes both halves).
    Tiles of the head dimensions: BK in K K^T, BW and BV in W and U (the width of their accumulators). H value heads
    (beta, gam, W, U, T~), HK key heads (k); USE_G: gated by γ (gam): in T~, and in W's pair but not in Tb;
    USE_GK: by KDA's per-channel g (gam [.., H, K]); DECAYS: with W, the serial passes' decays (gate.ChannelDecays:
    kd, dc and, DECAYS_Q, qd from q). SCORES (FUSED, USE_GK): the output stage's scale P (kkt.kkt_scores_tile, from
    the pass over the channels that makes A) into scores [.., TT, H, C] as grads.causal_scores_t lays it out."""
    tl.static_assert(not (USE_GK and STORE_PAIR), "the residual form takes the per-head gate only")
    tl.static_assert(not (USE_G and USE_GK), "one gate: per head (USE_G) or per channel (USE_GK)")
    tl.static_assert(not SCORES or (FUSED and USE_GK and DECAYS_Q), "P is formed beside KDA's A, Q beside it")
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start, n = chunk_span(cu_seqlens, chunk_indices, i_c, C)
    k_c = k + start * HK * K + (i_h // (H // HK)) * K
    beta_c = beta + start * H + i_h
    b_decay = tl.zeros([C], dtype=tl.float32)
    gam_c = gam
    if USE_G:
        b_gam, _ = load_gamma(gam, start, n, i_h, H, C)
        b_decay = tl.exp(b_gam)
        gam_c = gam + start * H + i_h
    if USE_GK:
        gam_c = gate_rows(gam, start, i_h, H, K)
    q_c, kd_c, qd_c, dc_c = q, kd, qd, dc
    if DECAYS:
        kd_c = kd + start * H * K + i_h * K
        dc_c = dc + (i_c * H + i_h) * K
    if DECAYS_Q:
        q_c = q + start * HK * K + (i_h // (H // HK)) * K
        qd_c = qd + start * H * K + i_h * K
    if SCORES:
        b_a, b_p = kkt_scores_tile(k_c, q_c, beta_c, gam_c, n, H, HK, K, C, PRECISION)
        store_rows(scores, causal_scores_t(tl.trans(b_p), scale, C, scores.dtype.element_ty), start, n, i_h, 0, H, C,
                   C, C)
        b_t = unit_lower_inverse(b_a, C, TRIL_PREC, NEWTON)
    elif FUSED:
        # (A comes from K here: the first argument, A's address, is not read)
        b_t = tril_inverse(k_c, k_c, beta_c, gam_c, n, H, HK, C, K, BK, True, USE_G, USE_GK, PRECISION, TRIL_PREC,
                           NEWTON)
    if FUSED and STORE_TINV:
        store_rows(tinv, b_t, start, n, i_h, 0, H, C, C, C)
    if not FUSED:
        # (Tinv is lower triangular: in the rows of the chunk, the columns past its end are stored zeros)
        b_t = load_rows(tinv, start, n, i_h, 0, H, C, C, C)
    if STORE_PAIR:
        b_tb_hi, b_tb_lo = tinv_beta_pair(b_t, beta_c, b_decay, n, H, C, tb.dtype.element_ty, False)
        store_rows(tb, b_tb_hi, start, n, i_h, 0, H, 2 * C, C, C)
        store_rows(tb, b_tb_lo, start, n, i_h, C, H, 2 * C, C, C)
    if APPLY:
        b_tb_hi, b_tb_lo = tinv_beta_pair(b_t, beta_c, b_decay, n, H, C, w.dtype.element_ty, False)
        apply_tinv(b_tb_hi, b_tb_lo, v + start * H * V + i_h * V, u + start * H * V + i_h * V, gam_c, n, H, H, H * K,
                   V, BV, C, False, SPLIT, PRECISION, q_c, kd_c, qd_c, dc_c, False, False)
        if USE_G:  # W's pair takes the decay exp(γ) beside beta
            b_tb_hi, b_tb_lo = tinv_beta_pair(b_t, beta_c, b_decay, n, H, C, w.dtype.element_ty, True)
        apply_tinv(b_tb_hi, b_tb_lo, k_c, w + start * H * K + i_h * K, gam_c, n, HK, H, SUM_PLANES * H * K, K, BW, C,
                   USE_GK,
                   SPLIT, PRECISION, q_c, kd_c, qd_c, dc_c, DECAYS, DECAYS_Q)


def _wy(k, v, beta, tinv, fused: bool, info: SeqInfo, chunk_size: int, tb=None, cfg: Optional[Launch] = None,
        gam: Optional[torch.Tensor] = None, gk: Optional[torch.Tensor] = None,
        decays: Optional[ChannelDecays] = None, q: Optional[torch.Tensor] = None,
        scores: Optional[torch.Tensor] = None, scale: float = 1.0):
    """fused: Tinv computed from K (and written to tinv unless it is None); else read from tinv. v None:
    no W, U (returns None, None). tb: where Tinv diag(beta) goes as its pair (tinv_pair_fwd). gam: the gated rule's
    γ (gate.chunk_gamma); gk: KDA's per-channel g [.., H, K] (or its planes, gate.gate_sums) instead. decays (with gk
    and v): gate.channel_decay_buffers' tensors, written beside W (their q tensor from q). scores (fused, with the
    decays' q): where the output stage's (scale P)^T goes, [.., TT, H, C] in v's dtype. Value heads are beta's, key
    heads k's."""
    if decays is not None and (gk is None or v is None or (decays.q is None) != (q is None)):
        raise ValueError("wy: decays are written beside W under KDA's gate, their decayed q from q")
    if scores is not None and (not fused or decays is None or decays.q is None):
        raise ValueError("wy: the output's scores are formed beside A (fused) with KDA's decays and their q")
    HK, K = k.shape[2], k.shape[3]
    H = beta.shape[2]
    V = K if v is None else v.shape[3]
    gk = gate_sums(gk, info, chunk_size)
    w, u = (None, None) if v is None else (k.new_empty(*k.shape[:2], H, K), torch.empty_like(v))
    chunks = info.chunks(chunk_size)
    split = k.dtype != torch.float32  # Tinv diag(beta) as a hi + lo pair of the 16-bit input dtype
    if cfg is None:
        cfg = wy_launch(K, V, k.element_size(), fused, gam is not None and v is not None)
    if chunks.num_chunks:
        launch(
            wy_kernel, (chunks.num_chunks, H),
            k, v, beta, gk if gam is None else gam, tinv, w, u, tb, q, decays and decays.k, decays and decays.q,
            decays and decays.chunk, scores, scale, info.cu_seqlens, chunks.chunk_indices, H, HK, K, V,
            chunk_size, cfg.tile_k, cfg.tile_k, cfg.tile_v,
            fused, tinv is not None, v is not None, tb is not None, gam is not None, gk is not None,
            decays is not None, q is not None, scores is not None, split,
            dot_precision(k.dtype),
            *tril_precision(k.dtype),
            num_warps=cfg.warps, num_stages=WY_PIPELINE_STAGES, **cfg.options(),
        )
    return w, u


def recompute_w_u(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, Tinv: torch.Tensor, info: SeqInfo,
                  chunk_size: int, cfg: Optional[Launch] = None, gam: Optional[torch.Tensor] = None,
                  gk: Optional[torch.Tensor] = None, decays: Optional[ChannelDecays] = None,
                  q: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """W = Tinv (beta*K) [B, T, H, K] (gated: Tinv (beta exp(γ) K); KDA's gk: Tinv diag(beta) (exp(Γ) ⊙ K)),
    U = Tinv (beta*V) [B, T, H, V], in the input dtype; decays (KDA): written beside W, as _wy says."""
    return _wy(k, v, beta, Tinv, False, info, chunk_size, cfg=cfg, gam=gam, gk=gk, decays=decays, q=q)


def wy_fwd(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, info: SeqInfo,
           chunk_size: int, store_tinv: bool = True, cfg: Optional[Launch] = None, gam: Optional[torch.Tensor] = None,
           gk: Optional[torch.Tensor] = None, decays: Optional[ChannelDecays] = None,
           q: Optional[torch.Tensor] = None, scores: Optional[torch.Tensor] = None, scale: float = 1.0
           ) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """kkt, solve_tril and recompute_w_u in one kernel: (Tinv [B, T, H, C] fp32, or None without store_tinv
    (inference: nothing needs it after W and U), w, u). gam: the gated rule's γ; gk: KDA's per-channel g; decays
    (KDA): the walk's decays, written beside W, and with their q tensor exp(Γ) ⊙ Q from q; scores (KDA, with q): the
    output stage's operand (scale P)^T, formed beside A (output.output_fwd reads both)."""
    tinv = k.new_empty(*beta.shape, chunk_size, dtype=torch.float32) if store_tinv else None
    w, u = _wy(k, v, beta, tinv, True, info, chunk_size, cfg=cfg, gam=gam, gk=gk, decays=decays, q=q, scores=scores,
               scale=scale)
    return tinv, w, u


def tinv_fwd(k: torch.Tensor, beta: torch.Tensor, info: SeqInfo, chunk_size: int) -> torch.Tensor:
    """Tinv = (I + A)^{-1} per chunk [B, T, H, C] fp32, from K on chip (kkt and solve_tril in one launch,
    A never written): the same Tinv as wy_fwd's."""
    tinv = k.new_empty(*beta.shape, chunk_size, dtype=torch.float32)  # per value head (beta's)
    _wy(k, None, beta, tinv, True, info, chunk_size)
    return tinv


def tinv_pair_fwd(k: torch.Tensor, beta: torch.Tensor, info: SeqInfo, chunk_size: int,
                  store_tinv: bool = True, cfg: Optional[Launch] = None, gam: Optional[torch.Tensor] = None
                  ) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """(Tinv [B, T, H, C] fp32, or None without store_tinv, Tb [B, T, H, 2C] in k's dtype; H beta's value heads):
    wy_fwd's Tinv, and
    Tb = Tinv diag(beta) as the 16-bit pair hi + lo that wy_fwd applies to K and V (tinv_beta_pair, the same
    bits), hi in columns [0, C) and lo in [C, 2C). In a short last chunk the columns past the sequence end are
    zero (beta reads as 0 there). 16-bit inputs only: fp32 has no pair. gam: the gated rule's γ, in T~ (A's
    exp(γ_i - γ_j)) and not in Tb's diag(beta): the walk puts exp(γ) on K S."""
    if k.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"tinv_pair_fwd: 16-bit k only (Tinv diag(beta) as a pair of k's dtype), got {k.dtype}")
    tinv = k.new_empty(*beta.shape, chunk_size, dtype=torch.float32) if store_tinv else None  # per value head
    tb = k.new_empty(*beta.shape, 2 * chunk_size)
    _wy(k, None, beta, tinv, True, info, chunk_size, tb=tb, cfg=cfg, gam=gam)
    return tinv, tb
