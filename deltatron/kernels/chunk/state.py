"""Stage 4 of the chunk forward: the serial pass over chunks (DESIGN.md §2).

One program per (V-block, sequence, head) walks the chunks of its sequence with the state block
S [K, BV] in registers (fp32). Per chunk:
    h[chunk] = S                    (the state entering the chunk, for the output stage and the backward)
    V'       = U - W S              (stored as v_new)
    S        = S + K^T V'
The loads of W, U and K do not depend on S, so the compiler can fetch the next chunk's tiles while the
current chunk's products run."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..utils import PIPELINE_STAGES, SeqInfo, cdiv, dot_precision, head_block, mm, state_block_v, state_offsets


@triton.jit
def state_fwd_kernel(k, w, u, h0, h, v_new, ht, cu_seqlens, chunk_offsets, H: tl.constexpr, K: tl.constexpr,
                     V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PRECISION: tl.constexpr):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
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
        h_kv, _ = state_offsets((first_chunk + i_t) * H + i_h, 0, i_v * BV, K, V, BK, BV)
        tl.store(h + h_kv, b_s.to(h.dtype.element_ty), mask=m_kv)

        m_wk = m_rows[:, None] & (ck[None, :] < K)
        b_w = tl.load(w + (start + rows[:, None]) * (H * K) + i_h * K + ck[None, :], mask=m_wk, other=0.0)
        # K^T [BK, C], loaded transposed
        b_kt = tl.load(k + (start + rows[None, :]) * (H * K) + i_h * K + ck[:, None],
                       mask=(ck[:, None] < K) & m_rows[None, :], other=0.0)
        o_uv = (start + rows[:, None]) * (H * V) + i_h * V + cv[None, :]
        m_uv = m_rows[:, None] & (cv[None, :] < V)
        b_u = tl.load(u + o_uv, mask=m_uv, other=0.0)

        b_vn = b_u.to(tl.float32) - mm(b_w, b_s.to(b_w.dtype), PRECISION)
        b_vn = b_vn.to(v_new.dtype.element_ty)
        tl.store(v_new + o_uv, b_vn, mask=m_uv)
        b_s += mm(b_kt, b_vn, PRECISION)

    if STORE_HT:
        tl.store(ht + o_kv, b_s, mask=m_kv)


def state_fwd(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, initial_state: Optional[torch.Tensor],
              output_final_state: bool, info: SeqInfo,
              chunk_size: int) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Returns (h [NT, H, K, V]: the state entering each chunk, in the input dtype; v_new [B, T, H, V] =
    U - W S, input dtype; final_state [N, H, K, V] fp32 or None). initial_state: [N, H, K, V] or None.
    A sequence of length 0 passes its initial state (or zeros) through."""
    H, K, V = k.shape[2], k.shape[3], u.shape[3]
    N = info.num_seqs
    chunks = info.chunks(chunk_size)
    h = k.new_empty(chunks.num_chunks, H, K, V)
    v_new = torch.empty_like(u)
    final_state = k.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    BK = head_block(K)
    BV = state_block_v(K, V, N * H)
    if N * H:
        state_fwd_kernel[(N * H, cdiv(V, BV))](
            k, w, u, initial_state, h, v_new, final_state, info.cu_seqlens, chunks.chunk_offsets,
            H, K, V, chunk_size, BK, BV, initial_state is not None, output_final_state, dot_precision(k.dtype),
            num_warps=8 if BK >= 256 else 4,
            num_stages=PIPELINE_STAGES,
        )
    return h, v_new, final_state
