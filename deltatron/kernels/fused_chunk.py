"""fused_chunk_delta_rule in Triton: one kernel walks the chunks of a (sequence, head, V-block) and keeps
every intermediate of a chunk on chip (DESIGN.md §2, §3).

Per chunk, with S the state entering it (fp32, in registers across the whole walk):

    A  = tril(diag(beta) K K^T, -1),  Tinv = (I + A)^{-1}              (fp32, only depends on K)
    X  = V - K S                                                       (what the state mispredicts)
    V' = Tinv diag(beta) X                                             (= U - W S of DESIGN.md §2)
    O  = scale (Q S + (Q K^T ⊙ M) V'),   S <- S + K^T V'

Writing V' = Tinv R with R = diag(beta) X never forms W = Tinv (beta K) [C, K]: one C x C x V product
replaces two C x C x K ones, and no [C, K] fp32 tile is live. HBM traffic of the forward: q, k, v, beta
read once, o written once, plus the initial and final state.

Backward (two launches and a reduction):
  1. the forward kernel again, in its state-saving mode (no output): the state entering every chunk,
     fp32 [NT, H, K, V]; the one intermediate that goes through HBM, the price of walking the chunks
     in reverse without inverting the transitions (numerically unsafe);
  2. one kernel per (sequence, head, V-block) walking the chunks in reverse with dS [K, BV] in
     registers, recomputing A, Tinv, X, V' on chip. With dV' = (scale Q K^T ⊙ M)^T dO + K dS_next and
     dR = Tinv^T dV', the gradient through the inverse collapses to dA = -tril(dR V'^T, -1) (from
     (I + A) V' = R), so no C x C x C product is needed:
         dQ = scale (dO S^T + G K),  G = dO V'^T ⊙ M
         dK = scale G^T Q + V' dS_next^T - diag(beta) dR S^T + diag(beta) dA K + (diag(beta) dA)^T K
         dV = diag(beta) dR,  dbeta = rowsum(dR ⊙ X) + rowsum(dA ⊙ K K^T)
         dS = scale Q^T dO + dS_next - K^T diag(beta) dR          (dh0 after the first chunk)
  3. dq, dk and dbeta sum over all of V: each V-block program writes its own fp32 partial
     [NV, ...] and torch sums them in a fixed order, so two runs give bitwise-identical gradients.

V-blocking: A, Tinv and Q K^T only depend on K, so each V-block program recomputes them (2 C^2 K flops
per chunk). That buys parallelism, the only kind a serial chunk walk has besides sequences x heads,
and bounds the registers of the [K, BV] state tiles; BV is the whole V (capped by register budget)
unless there are too few (sequence, head) programs to fill the GPU."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .chunk.solve_tril import tril_inverse
from .utils import INTERPRET, dot_precision, head_block, mm, tril_precision


def _autotuned(fn):
    """GPU: a few warp/stage configs per shape; the interpreter cannot benchmark, so it runs as is.
    Every launch only stores (no accumulation into outputs), so benchmarking reruns are harmless."""
    if INTERPRET:
        return triton.jit(fn)
    configs = [triton.Config({}, num_warps=w, num_stages=s) for w, s in ((4, 2), (8, 1), (8, 2), (16, 2))]
    return triton.autotune(configs, key=["K", "V", "C", "BV"])(triton.jit(fn))


@triton.jit
def _load_rows(ptr, t, t_end, cols, n_cols, row_stride):
    """Tile x[t, cols] of a token-major tensor (rows t >= t_end and cols >= n_cols read as 0)."""
    mask = (t[:, None] < t_end) & (cols[None, :] < n_cols)
    return tl.load(ptr + t[:, None].to(tl.int64) * row_stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _store_rows(ptr, x, t, t_end, cols, n_cols, row_stride):
    mask = (t[:, None] < t_end) & (cols[None, :] < n_cols)
    tl.store(ptr + t[:, None].to(tl.int64) * row_stride + cols[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_inverse(k, beta, t0, eos, i_h, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                   PRECISION: tl.constexpr, TRIL_PRECISION: tl.constexpr):
    """Tinv = (I + tril(diag(beta) K K^T, -1))^{-1} of the chunk starting at token t0 (fp32 [C, C]): the
    A tiles come straight from K (cache hits: the caller loads the same rows) and never leave the chip."""
    k_c = k + t0.to(tl.int64) * H * K + i_h * K
    beta_c = beta + t0.to(tl.int64) * H + i_h
    return tril_inverse(k, k_c, beta_c, eos - t0, H, C, K, BK, True, PRECISION, TRIL_PRECISION)


@triton.jit
def _new_values(b_k, b_v, b_beta, b_S, b_Tinv, PRECISION: tl.constexpr):
    """X = V - K S and V' = Tinv diag(beta) X of one chunk (both fp32)."""
    dt = b_k.dtype
    b_x = b_v.to(tl.float32) - mm(b_k, b_S.to(dt), PRECISION)
    b_vn = mm(b_Tinv, b_beta[:, None] * b_x, PRECISION)
    return b_x, b_vn


@triton.jit
def _causal_scores(b_a, b_b, scale, C: tl.constexpr, PRECISION: tl.constexpr):
    """scale (a b^T ⊙ M), M keeping j <= i, fp32 [C, C]."""
    i = tl.arange(0, C)
    return tl.where(i[:, None] >= i[None, :], scale * mm(b_a, tl.trans(b_b), PRECISION), 0.0)


@_autotuned
def fused_chunk_fwd_kernel(
    q, k, v, beta, h0, o, ht, h, cu_seqlens, chunk_offsets, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, WRITE_O: tl.constexpr, SAVE_STATES: tl.constexpr,
    PRECISION: tl.constexpr, TRIL_PRECISION: tl.constexpr,
):
    """Program (V-block, sequence x head). Writes o (WRITE_O), the final state (STORE_HT) and/or the
    state entering every chunk into h [NT, H, K, V] (SAVE_STATES, for the backward)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    state_offs = ck[:, None] * V + cv[None, :]
    state_mask = (ck[:, None] < K) & (cv[None, :] < V)
    head_state = i_nh.to(tl.int64) * K * V

    b_S = tl.zeros((BK, BV), dtype=tl.float32)
    if USE_H0:
        b_S += tl.load(h0 + head_state + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    if SAVE_STATES:
        first_chunk = tl.load(chunk_offsets + i_n)
    for i_t in range(tl.cdiv(eos - bos, C)):
        if SAVE_STATES:
            chunk_state = ((first_chunk + i_t).to(tl.int64) * H + i_h) * K * V
            tl.store(h + chunk_state + state_offs, b_S, mask=state_mask)
        t = bos + i_t * C + tl.arange(0, C)
        b_k = _load_rows(k + i_h * K, t, eos, ck, K, H * K)
        b_v = _load_rows(v + i_h * V, t, eos, cv, V, H * V)
        b_beta = tl.load(beta + t.to(tl.int64) * H + i_h, mask=t < eos, other=0.0).to(tl.float32)
        b_Tinv = _chunk_inverse(k, beta, bos + i_t * C, eos, i_h, H, K, C, BK, PRECISION, TRIL_PRECISION)
        _, b_vn = _new_values(b_k, b_v, b_beta, b_S, b_Tinv, PRECISION)
        b_vn = b_vn.to(b_k.dtype)
        if WRITE_O:
            b_q = _load_rows(q + i_h * K, t, eos, ck, K, H * K)
            b_o = scale * mm(b_q, b_S.to(b_k.dtype), PRECISION)
            b_o += mm(_causal_scores(b_q, b_k, scale, C, PRECISION).to(b_k.dtype), b_vn, PRECISION)
            _store_rows(o + i_h * V, b_o, t, eos, cv, V, H * V)
        b_S += mm(tl.trans(b_k), b_vn, PRECISION)
    if STORE_HT:
        tl.store(ht + head_state + state_offs, b_S, mask=state_mask)


@_autotuned
def fused_chunk_bwd_kernel(
    q, k, v, beta, h, do, dht, dq, dk, dv, dbeta, dh0, cu_seqlens, chunk_offsets, scale, total_tokens,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PRECISION: tl.constexpr, TRIL_PRECISION: tl.constexpr,
):
    """Program (V-block, sequence x head): reverse walk over the chunks with dS [BK, BV] in registers.
    dq, dk [NV, TT, H, K] and dbeta [NV, TT, H] get this V-block's partial; dv, dh0 are exact."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    state_offs = ck[:, None] * V + cv[None, :]
    state_mask = (ck[:, None] < K) & (cv[None, :] < V)
    head_state = i_nh.to(tl.int64) * K * V
    # this V-block's slice of the partial sums
    dq += i_v.to(tl.int64) * total_tokens * H * K
    dk += i_v.to(tl.int64) * total_tokens * H * K
    dbeta += i_v.to(tl.int64) * total_tokens * H

    b_dS = tl.zeros((BK, BV), dtype=tl.float32)
    if USE_DHT:
        b_dS += tl.load(dht + head_state + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    first_chunk = tl.load(chunk_offsets + i_n)
    NT = tl.cdiv(eos - bos, C)
    for j in range(NT):
        i_t = NT - 1 - j
        t = bos + i_t * C + tl.arange(0, C)
        b_k = _load_rows(k + i_h * K, t, eos, ck, K, H * K)
        b_q = _load_rows(q + i_h * K, t, eos, ck, K, H * K)
        b_v = _load_rows(v + i_h * V, t, eos, cv, V, H * V)
        b_do = _load_rows(do + i_h * V, t, eos, cv, V, H * V)
        b_beta = tl.load(beta + t.to(tl.int64) * H + i_h, mask=t < eos, other=0.0).to(tl.float32)
        chunk_state = ((first_chunk + i_t).to(tl.int64) * H + i_h) * K * V
        b_S = tl.load(h + chunk_state + state_offs, mask=state_mask, other=0.0)
        dt = b_k.dtype
        b_Sd, b_dSd = b_S.to(dt), b_dS.to(dt)

        b_Tinv = _chunk_inverse(k, beta, bos + i_t * C, eos, i_h, H, K, C, BK, PRECISION, TRIL_PRECISION)
        b_x, b_vn = _new_values(b_k, b_v, b_beta, b_S, b_Tinv, PRECISION)
        b_vnd = b_vn.to(dt)
        # dV' = (scale Q K^T ⊙ M)^T dO + K dS_next;  dR = Tinv^T dV'
        b_P = _causal_scores(b_q, b_k, scale, C, PRECISION)
        b_dvn = mm(tl.trans(b_P).to(dt), b_do, PRECISION) + mm(b_k, b_dSd, PRECISION)
        b_dr = mm(tl.trans(b_Tinv), b_dvn, PRECISION)
        b_drb = (b_beta[:, None] * b_dr).to(dt)
        i = tl.arange(0, C)
        b_G = _causal_scores(b_do, b_vnd, 1.0, C, PRECISION).to(dt)  # dO V'^T ⊙ M
        b_dA = tl.where(i[:, None] > i[None, :], -mm(b_dr, tl.trans(b_vn), PRECISION), 0.0)

        b_dq = scale * (mm(b_do, tl.trans(b_Sd), PRECISION) + mm(b_G, b_k, PRECISION))
        _store_rows(dq + i_h * K, b_dq, t, eos, ck, K, H * K)
        b_dk = scale * mm(tl.trans(b_G), b_q, PRECISION)
        b_dk += mm(b_vnd, tl.trans(b_dSd), PRECISION) - mm(b_drb, tl.trans(b_Sd), PRECISION)
        b_dAk = mm(b_dA.to(dt), b_k, PRECISION)
        b_dk += b_beta[:, None] * b_dAk + mm(tl.trans(b_beta[:, None] * b_dA).to(dt), b_k, PRECISION)
        _store_rows(dk + i_h * K, b_dk, t, eos, ck, K, H * K)
        _store_rows(dv + i_h * V, b_beta[:, None] * b_dr, t, eos, cv, V, H * V)
        b_db = tl.sum(b_dr * b_x, axis=1) + tl.sum(b_dAk * b_k, axis=1)  # rowsum(dA ⊙ K K^T) = rowsum(dA K ⊙ K)
        tl.store(dbeta + t.to(tl.int64) * H + i_h, b_db, mask=t < eos)

        b_dS += scale * mm(tl.trans(b_q), b_do, PRECISION) - mm(tl.trans(b_k), b_drb, PRECISION)
    if STORE_DH0:
        tl.store(dh0 + head_state + state_offs, b_dS, mask=state_mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _block_v(K: int, V: int, programs: int, device: torch.device, backward: bool) -> int:
    """Whole V up to a register budget for the [BK, BV] state tiles (the backward holds S and dS), then
    halved while there are fewer programs than SMs."""
    BK = head_block(K)
    cap = {16: 64, 32: 64, 64: 64, 128: 64, 256: 32}[BK] // (2 if backward and BK > 64 else 1)
    BV = min(head_block(V), cap)
    while BV > 16 and triton.cdiv(V, BV) * programs < _num_sms(device):
        BV //= 2
    return BV


def _state_sweep(q, k, v, beta, scale, initial_state, info, chunk_size, o=None, ht=None, h=None):
    """Runs the forward kernel: o (if given), final state ht (if given), per-chunk states h (if given)."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    BV = _block_v(K, V, info.num_seqs * H, q.device, backward=False)
    chunk_offsets = info.chunks(chunk_size).chunk_offsets if h is not None else None
    grid = (triton.cdiv(V, BV), info.num_seqs * H)
    fused_chunk_fwd_kernel[grid](
        q, k, v, beta, initial_state, o, ht, h, info.cu_seqlens, chunk_offsets, scale,
        H=H, K=K, V=V, C=chunk_size, BK=head_block(K), BV=BV,
        USE_H0=initial_state is not None, STORE_HT=ht is not None, WRITE_O=o is not None,
        SAVE_STATES=h is not None, PRECISION=dot_precision(q.dtype), TRIL_PRECISION=tril_precision(),
    )


def forward(q, k, v, beta, scale, initial_state, output_final_state, info, chunk_size=64):
    """Contract of deltatron.autograd. Saves nothing beyond the inputs: the backward recomputes."""
    N, H, K, V = info.num_seqs, q.shape[2], q.shape[3], v.shape[3]
    o = torch.empty_like(v)
    ht = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    _state_sweep(q, k, v, beta, scale, initial_state, info, chunk_size, o=o, ht=ht)
    return o, ht, (), ()


def backward(q, k, v, beta, scale, initial_state, saved, do, dht, info, chunk_size=64):
    """Contract of deltatron.autograd: (dq, dk, dv, dbeta, dh0 or None), dq, dk, dbeta in fp32.

    Memory: the per-chunk states, fp32 [NT, H, K, V], and fp32 partials of dq, dk, dbeta per V-block."""
    N, H, K, V = info.num_seqs, q.shape[2], q.shape[3], v.shape[3]
    chunks = info.chunks(chunk_size)
    h = q.new_empty(chunks.num_chunks, H, K, V, dtype=torch.float32)
    _state_sweep(q, k, v, beta, scale, initial_state, info, chunk_size, h=h)

    BV = _block_v(K, V, N * H, q.device, backward=True)
    NV = triton.cdiv(V, BV)
    dq = q.new_empty(NV, *q.shape, dtype=torch.float32)
    dk = q.new_empty(NV, *k.shape, dtype=torch.float32)
    dbeta = q.new_empty(NV, *beta.shape, dtype=torch.float32)
    dv = torch.empty_like(v)
    dh0 = q.new_empty(N, H, K, V, dtype=torch.float32) if initial_state is not None else None
    fused_chunk_bwd_kernel[(NV, N * H)](
        q, k, v, beta, h, do, dht, dq, dk, dv, dbeta, dh0, info.cu_seqlens, chunks.chunk_offsets, scale,
        info.total_tokens, H=H, K=K, V=V, C=chunk_size, BK=head_block(K), BV=BV,
        USE_DHT=dht is not None, STORE_DH0=dh0 is not None,
        PRECISION=dot_precision(q.dtype), TRIL_PRECISION=tril_precision(),
    )
    # fixed-order reduction over the V-blocks: deterministic
    return dq.sum(0), dk.sum(0), dv, dbeta.sum(0), dh0
