"""Stages the chunk forward fuses into one kernel (portable/wy.py), launched apart so that the tests can check each
against the float64 oracle and the fused kernel against their composition: A = tril(diag(beta) K K^T, -1) per chunk
(chunk_kkt) and its inverse T~ = (I + A)^-1 (solve_tril), with the library's own tile functions (kkt_tile,
tril_inverse). Only the tests call them."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltatron.kernels.chunk.portable.kkt import kkt_tile
from deltatron.kernels.chunk.portable.solve_tril import tril_inverse
from deltatron.kernels.launch import launch
from deltatron.kernels.utils import (PIPELINE_STAGES, SeqInfo, chunk_span, dot_precision, head_tile, store_rows,
                                    tril_precision)


@triton.jit
def chunk_kkt_kernel(k, beta, a, cu_seqlens, chunk_indices, H: tl.constexpr, K: tl.constexpr,
                     C: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start, n = chunk_span(cu_seqlens, chunk_indices, i_c, C)
    b_a = kkt_tile(k + start * H * K + i_h * K, beta + start * H + i_h, beta, n, H, H, 0, 0, C, C, K, BK, PRECISION,
                   False, False)
    rows = tl.arange(0, C)
    tl.store(a + (start + rows[:, None]) * (H * C) + i_h * C + rows[None, :], b_a, mask=rows[:, None] < n)


def chunk_kkt(k: torch.Tensor, beta: torch.Tensor, info: SeqInfo, chunk_size: int) -> torch.Tensor:
    """A = tril(diag(beta) K K^T, -1) per chunk: [B, T, H, C] fp32 (rows past each sequence's end are not
    tokens and are not written)."""
    H, K = k.shape[2], k.shape[3]
    a = k.new_empty(*k.shape[:3], chunk_size, dtype=torch.float32)
    chunks = info.chunks(chunk_size)
    if chunks.num_chunks:
        launch(
            chunk_kkt_kernel, (chunks.num_chunks, H),
            k, beta, a, info.cu_seqlens, chunks.chunk_indices, H, K, chunk_size, head_tile(K),
            dot_precision(k.dtype), num_warps=4, num_stages=PIPELINE_STAGES,
        )
    return a


@triton.jit
def solve_tril_kernel(a, tinv, cu_seqlens, chunk_indices, H: tl.constexpr, C: tl.constexpr,
                      TRIL_PREC: tl.constexpr, NEWTON: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start, n = chunk_span(cu_seqlens, chunk_indices, i_c, C)
    offset = start * H * C + i_h * C
    # FROM_K=False: k, beta, gam and K are unused, a stands in for them
    b_t = tril_inverse(a + offset, a, a, a, n, H, H, C, 16, 16, False, False, False, "ieee", TRIL_PREC, NEWTON)
    store_rows(tinv, b_t, start, n, i_h, 0, H, C, C, C)


def solve_tril(A: torch.Tensor, info: SeqInfo, chunk_size: int) -> torch.Tensor:
    """Tinv = (I + A)^{-1} per chunk from A [B, T, H, C] fp32 (strictly lower; entries on and above the
    diagonal are ignored). Returns [B, T, H, C] fp32; in a short last chunk the columns past the sequence
    end are zero."""
    H = A.shape[2]
    tinv = torch.empty_like(A)
    chunks = info.chunks(chunk_size)
    if chunks.num_chunks:
        launch(
            solve_tril_kernel, (chunks.num_chunks, H),
            A, tinv, info.cu_seqlens, chunks.chunk_indices, H, chunk_size, *tril_precision(A.dtype),
            num_warps=4, num_stages=PIPELINE_STAGES,
        )
    return tinv
