"""fused_chunk_delta_rule in Triton (DESIGN.md §5, other forms): T~ for every chunk in one launch (wy.tinv_fwd: the
chunk form's T~), then one walk per (sequence, head, V-block) that keeps every other per-chunk intermediate on chip.
An independent second implementation of the chunkwise form, for cross-checks.

Per chunk, with S the state entering it (fp32, in registers across the walk): X = V - K S, V' = T~ diag(beta) X
(= U - W S: the residual form, DESIGN.md §3), O = scale (Q S + (Q K^T ⊙ M) V'), S <- S + K^T V'. W is never formed:
one C x C x V product replaces two C x C x K ones.

Backward: the forward kernel again, storing the state entering every chunk (fp32 [NT, H, K, V]; walking back by
inverting the transitions would be numerically unsafe), then one reverse walk per (sequence, head, V-block) with dS
[K, BV] in registers that recomputes X and V' from T~. The gradient through the inverse is dA = -tril(dR V'^T, -1)
with dR = T~^T dV' (from (I + A) V' = diag(beta) X), so no C x C x C product is needed (the kernel's comments give
each gradient). dq, dk and dbeta sum over V: each V-block program writes an fp32 partial [NV, ...] and torch adds them
in a fixed order (deterministic). Every V-block program recomputes Q K^T: the price of V-blocking, the walk's only
parallelism besides sequences x heads."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk.portable.wy import tinv_fwd
from .launch import launch
from .utils import (PIPELINE_STAGES, cdiv, dot_precision, head_block, load_rows, mm, state_block_v, state_offsets,
                    store_rows)


@triton.jit
def _new_values(b_k, b_v, b_beta, b_S, b_Tinv, PRECISION: tl.constexpr, F32_DT: tl.constexpr):
    """X = V - K S and V' = Tinv diag(beta) X of one chunk (both fp32)."""
    b_x = b_v.to(tl.float32) - mm(b_k, b_S.to(b_k.dtype), PRECISION)
    b_vn = mm(b_Tinv.to(F32_DT), (b_beta[:, None] * b_x).to(F32_DT), PRECISION)
    return b_x, b_vn


@triton.jit
def _causal_scores(b_a, b_b, scale, C: tl.constexpr, PRECISION: tl.constexpr):
    """scale (a b^T ⊙ M), M keeping j <= i, fp32 [C, C]."""
    i = tl.arange(0, C)
    return tl.where(i[:, None] >= i[None, :], scale * mm(b_a, tl.trans(b_b), PRECISION), 0.0)


@triton.jit
def fused_chunk_fwd_kernel(
    q, k, v, beta, tinv, h0, o, ht, h, cu_seqlens, chunk_offsets, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, WRITE_O: tl.constexpr, SAVE_STATES: tl.constexpr,
    PRECISION: tl.constexpr, F32_DT: tl.constexpr,
):
    """Program (sequence x head, V-block). Writes o (WRITE_O), the final state (STORE_HT) and/or the
    state entering every chunk into h [NT, H, K, V] (SAVE_STATES, for the backward)."""
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # sequences x heads on axis 0: no 65535 limit
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    head_offs, state_mask = state_offsets(i_nh, 0, i_v * BV, K, V, BK, BV)  # this program's state slice

    b_S = tl.zeros((BK, BV), dtype=tl.float32)
    if USE_H0:
        b_S += tl.load(h0 + head_offs, mask=state_mask, other=0.0).to(tl.float32)
    if SAVE_STATES:
        first_chunk = tl.load(chunk_offsets + i_n)
    for i_t in range(tl.cdiv(eos - bos, C)):
        if SAVE_STATES:
            chunk_offs, _ = state_offsets((first_chunk + i_t) * H + i_h, 0, i_v * BV, K, V, BK, BV)
            tl.store(h + chunk_offs, b_S, mask=state_mask)
        t0 = bos + i_t * C
        t = t0 + tl.arange(0, C)
        b_k = load_rows(k, t0, eos - t0, i_h, 0, H, K, C, BK)
        b_v = load_rows(v, t0, eos - t0, i_h, i_v * BV, H, V, C, BV)
        b_beta = tl.load(beta + t.to(tl.int64) * H + i_h, mask=t < eos, other=0.0).to(tl.float32)
        b_Tinv = load_rows(tinv, t0, eos - t0, i_h, 0, H, C, C, C)  # zero past the end
        _, b_vn = _new_values(b_k, b_v, b_beta, b_S, b_Tinv, PRECISION, F32_DT)
        b_vn = b_vn.to(b_k.dtype)
        if WRITE_O:
            b_q = load_rows(q, t0, eos - t0, i_h, 0, H, K, C, BK)
            b_o = scale * mm(b_q, b_S.to(b_k.dtype), PRECISION)
            b_o += mm(_causal_scores(b_q, b_k, scale, C, PRECISION).to(b_k.dtype), b_vn, PRECISION)
            store_rows(o, b_o, t0, eos - t0, i_h, i_v * BV, H, V, C, BV)
        b_S += mm(tl.trans(b_k), b_vn, PRECISION)
    if STORE_HT:
        tl.store(ht + head_offs, b_S, mask=state_mask)


@triton.jit
def fused_chunk_bwd_kernel(
    q, k, v, beta, tinv, h, do, dht, dq, dk, dv, dbeta, dh0, cu_seqlens, chunk_offsets, scale, total_tokens,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PRECISION: tl.constexpr, F32_DT: tl.constexpr,
):
    """Program (sequence x head, V-block): reverse walk over the chunks with dS [BK, BV] in registers.
    dq, dk [NV, TT, H, K] and dbeta [NV, TT, H] get this V-block's partial; dv, dh0 are exact."""
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # sequences x heads on axis 0: no 65535 limit
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    head_offs, state_mask = state_offsets(i_nh, 0, i_v * BV, K, V, BK, BV)  # this program's state slice
    # this V-block's slice of the partial sums
    dq += i_v.to(tl.int64) * total_tokens * H * K
    dk += i_v.to(tl.int64) * total_tokens * H * K
    dbeta += i_v.to(tl.int64) * total_tokens * H

    b_dS = tl.zeros((BK, BV), dtype=tl.float32)
    if USE_DHT:
        b_dS += tl.load(dht + head_offs, mask=state_mask, other=0.0).to(tl.float32)
    first_chunk = tl.load(chunk_offsets + i_n)
    NT = tl.cdiv(eos - bos, C)
    for j in range(NT):
        i_t = NT - 1 - j
        t0 = bos + i_t * C
        t = t0 + tl.arange(0, C)
        b_k = load_rows(k, t0, eos - t0, i_h, 0, H, K, C, BK)
        b_q = load_rows(q, t0, eos - t0, i_h, 0, H, K, C, BK)
        b_v = load_rows(v, t0, eos - t0, i_h, i_v * BV, H, V, C, BV)
        b_do = load_rows(do, t0, eos - t0, i_h, i_v * BV, H, V, C, BV)
        b_beta = tl.load(beta + t.to(tl.int64) * H + i_h, mask=t < eos, other=0.0).to(tl.float32)
        chunk_offs, _ = state_offsets((first_chunk + i_t) * H + i_h, 0, i_v * BV, K, V, BK, BV)
        b_S = tl.load(h + chunk_offs, mask=state_mask, other=0.0)
        dt = b_k.dtype
        b_Sd, b_dSd = b_S.to(dt), b_dS.to(dt)

        b_Tinv = load_rows(tinv, t0, eos - t0, i_h, 0, H, C, C, C)  # zero past the end
        b_x, b_vn = _new_values(b_k, b_v, b_beta, b_S, b_Tinv, PRECISION, F32_DT)
        # (ordered so that each C x C tile dies early: the chunk's tiles all live in registers)
        # dV' = (scale Q K^T ⊙ M)^T dO + K dS_next;  dR = Tinv^T dV';  dV = diag(beta) dR
        b_P = _causal_scores(b_q, b_k, scale, C, PRECISION)
        b_dvn = mm(tl.trans(b_P).to(dt), b_do, PRECISION) + mm(b_k, b_dSd, PRECISION)
        b_dr = mm(tl.trans(b_Tinv).to(F32_DT), b_dvn.to(F32_DT), PRECISION)
        b_db = tl.sum(b_dr * b_x, axis=1)
        store_rows(dv, b_beta[:, None] * b_dr, t0, eos - t0, i_h, i_v * BV, H, V, C, BV)
        b_drb = (b_beta[:, None] * b_dr).to(dt)
        # dQ = scale (dO S^T + G K),  G = dO V'^T ⊙ M
        b_vnd = b_vn.to(dt)
        b_G = _causal_scores(b_do, b_vnd, 1.0, C, PRECISION).to(dt)
        b_dq = scale * (mm(b_do, tl.trans(b_Sd), PRECISION) + mm(b_G, b_k, PRECISION))
        store_rows(dq, b_dq, t0, eos - t0, i_h, 0, H, K, C, BK)
        # dK; dA = -tril(dR V'^T, -1) enters through A = tril(diag(beta) K K^T, -1)
        i = tl.arange(0, C)
        b_dA = tl.where(i[:, None] > i[None, :], -mm(b_dr.to(F32_DT), tl.trans(b_vn).to(F32_DT), PRECISION), 0.0)
        b_dAk = mm(b_dA.to(dt), b_k, PRECISION)
        b_db += tl.sum(b_dAk * b_k, axis=1)  # rowsum(dA ⊙ K K^T)
        tl.store(dbeta + t.to(tl.int64) * H + i_h, b_db, mask=t < eos)
        b_dk = scale * mm(tl.trans(b_G), b_q, PRECISION) + b_beta[:, None] * b_dAk
        b_dk += mm(b_vnd, tl.trans(b_dSd), PRECISION) - mm(b_drb, tl.trans(b_Sd), PRECISION)
        b_dk += mm(tl.trans(b_beta[:, None] * b_dA).to(dt), b_k, PRECISION)
        store_rows(dk, b_dk, t0, eos - t0, i_h, 0, H, K, C, BK)
        # dS = scale Q^T dO + dS_next - K^T diag(beta) dR
        b_dS += scale * mm(tl.trans(b_q), b_do, PRECISION) - mm(tl.trans(b_k), b_drb, PRECISION)
    if STORE_DH0:
        tl.store(dh0 + head_offs, b_dS, mask=state_mask)


def _f32_dot_dtype(dtype: torch.dtype):
    """Operand dtype of the dots between two fp32 intermediates (Tinv R, Tinv^T dV', dR V'^T). With unnormalized
    keys and beta up to 2 (T = 200, interpreter), bf16 operands double the error of bf16 inputs (to the 1e-2
    bound), so those stay fp32; fp16 operands cost fp16 inputs 1.8e-3, under its bound."""
    return tl.float16 if dtype == torch.float16 else tl.float32


def _precision(dtype: torch.dtype) -> str:
    """PRECISION of this form's walks. With bf16 inputs the fp32 x fp32 dots run in ieee: on the H200 with
    triton 3.6 the tf32 variant of these kernels returns wrong results forward and makes illegal memory
    accesses backward, while ieee is right."""
    return "ieee" if dtype == torch.bfloat16 else dot_precision(dtype)


# Every chunk's tiles live in registers: 8 warps spill less than 4 at every K, C and BV (sm_90). A fixed
# config: autotuning would compile each kernel several times per shape.
NUM_WARPS = 8


def _blocks(q, v, info, backward: bool):
    """(BK, BV). The backward holds two [K, BV] fp32 tiles (S and dS) where the forward holds one: its
    V-block is that of a state of 2K rows."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    return head_block(K), state_block_v(2 * K if backward else K, V, info.num_seqs * H)


def _state_sweep(q, k, v, beta, tinv, scale, initial_state, info, chunk_size, o=None, ht=None, h=None):
    """Runs the forward kernel: o (if given), final state ht (if given), per-chunk states h (if given)."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    BK, BV = _blocks(q, v, info, backward=False)
    chunk_offsets = info.chunks(chunk_size).chunk_offsets if h is not None else None
    launch(
        fused_chunk_fwd_kernel, (info.num_seqs * H, cdiv(V, BV)),
        q, k, v, beta, tinv, initial_state, o, ht, h, info.cu_seqlens, chunk_offsets, scale,
        H=H, K=K, V=V, C=chunk_size, BK=BK, BV=BV,
        USE_H0=initial_state is not None, STORE_HT=ht is not None, WRITE_O=o is not None,
        SAVE_STATES=h is not None, PRECISION=_precision(q.dtype), F32_DT=_f32_dot_dtype(q.dtype),
        num_warps=NUM_WARPS, num_stages=PIPELINE_STAGES,
    )


def forward(q, k, v, beta, scale, initial_state, output_final_state, info, needs_backward=True, chunk_size=64):
    """Contract of deltatron.autograd. Saves Tinv (fp32 [TT, H, C]) with needs_backward; the backward
    recomputes the rest."""
    N, H, K, V = info.num_seqs, q.shape[2], q.shape[3], v.shape[3]
    o = torch.empty_like(v)
    ht = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    tinv = tinv_fwd(k, beta, info, chunk_size)
    _state_sweep(q, k, v, beta, tinv, scale, initial_state, info, chunk_size, o=o, ht=ht)
    return o, ht, (tinv,) if needs_backward else (), ()


def backward(q, k, v, beta, scale, initial_state, saved, do, dht, info, chunk_size=64):
    """Contract of deltatron.autograd: (dq, dk, dv, dbeta, dh0 or None), dq, dk, dbeta in fp32.

    The states entering the chunks are recomputed here rather than saved by the forward, so inference pays
    nothing for training. Memory: those states, fp32 [NT, H, K, V] (acceptable for this form: one state per
    chunk, as the chunk pipeline's h), and fp32 partials of dq, dk, dbeta per V-block."""
    (tinv,) = saved
    N, H, K, V = info.num_seqs, q.shape[2], q.shape[3], v.shape[3]
    chunks = info.chunks(chunk_size)
    h = q.new_empty(chunks.num_chunks, H, K, V, dtype=torch.float32)
    _state_sweep(q, k, v, beta, tinv, scale, initial_state, info, chunk_size, h=h)

    BK, BV = _blocks(q, v, info, backward=True)
    NV = cdiv(V, BV)
    dq = q.new_empty(NV, *q.shape, dtype=torch.float32)
    dk = q.new_empty(NV, *k.shape, dtype=torch.float32)
    dbeta = q.new_empty(NV, *beta.shape, dtype=torch.float32)
    dv = torch.empty_like(v)
    dh0 = q.new_empty(N, H, K, V, dtype=torch.float32) if initial_state is not None else None
    launch(
        fused_chunk_bwd_kernel, (N * H, NV),
        q, k, v, beta, tinv, h, do, dht, dq, dk, dv, dbeta, dh0, info.cu_seqlens, chunks.chunk_offsets, scale,
        info.total_tokens, H=H, K=K, V=V, C=chunk_size, BK=BK, BV=BV,
        USE_DHT=dht is not None, STORE_DH0=dh0 is not None,
        PRECISION=_precision(q.dtype), F32_DT=_f32_dot_dtype(q.dtype),
        # one stage: prefetching the next chunk's tiles (Tinv among them) overflows sm_90's shared memory at
        # K = 256 (233,472 > 232,448 bytes), and the walk's body is long enough to hide the loads
        num_warps=NUM_WARPS, num_stages=1,
    )
    return _sum_blocks(dq), _sum_blocks(dk), dv, _sum_blocks(dbeta), dh0


def _sum_blocks(partials: torch.Tensor) -> torch.Tensor:
    """Sum over the V-blocks (dim 0) in a fixed order: deterministic, unlike atomics."""
    return partials[0] if partials.shape[0] == 1 else partials.sum(0)
