"""Helpers shared by the Triton kernels: a call's packed-sequence view (seq_info; the bookkeeping itself is
deltatron/varlen.py), chunk spans, the interpreter-safe matrix product, dot precisions, V-blocks and pipelining
depths. One code path serves fixed-length and variable-length batches, and chunks never cross a sequence boundary."""
from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..varlen import ChunkIndex, SeqInfo, VarlenMetadata, packed_info  # noqa: F401 (the kernels' imports)

# Under TRITON_INTERPRET=1 tl.dot on bf16 operands multiplies the raw uint16 bits (DESIGN.md §10):
# the interpreter path widens 16-bit operands to fp32 first, which is exact.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
IS_INTERPRET = tl.constexpr(INTERPRET)


def _round_bf16_to_nearest_in_interpreter() -> None:
    """The interpreter casts fp32 -> bf16 by truncation; the GPU rounds to nearest even. Truncation biases
    every bf16 intermediate the same way, so errors add up (past the bf16 bound in the chunk kernels)
    instead of averaging out: make the interpreter round like the GPU. Interpreter only."""
    import numpy as np
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "cast_impl") or getattr(builder, "_deltatron_rounding", False):
        return
    truncating_cast = builder.cast_impl

    def rounding_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            x = torch.from_numpy(np.asarray(src.data, dtype=np.float32))
            bits = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, dst_type.scalar)
        return truncating_cast(self, src, dst_type)

    builder.cast_impl = rounding_cast
    builder._deltatron_rounding = True


if INTERPRET:
    _round_bf16_to_nearest_in_interpreter()


@triton.jit
def mm(a, b, PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation. PRECISION applies to fp32 operands ("ieee", "tf32", "tf32x3");
    16-bit operands run on the tensor cores as they are. (No default: triton 3.6 does not wrap a string
    default of a nested jit call as a constexpr.)"""
    if IS_INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def tf32_high(x):
    """x with the 13 mantissa bits that tf32 drops cleared: x = tf32_high(x) + (x - tf32_high(x)) exactly."""
    return (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def mm_split_tf32(a, b):
    """a @ b for fp32 a, b at about fp32 accuracy from three tf32 products: a = a_hi + a_lo, b = b_hi + b_lo split
    by truncation, a_lo b_lo dropped. What input_precision="tf32x3" computes, with the split by a bit mask instead
    of tf32 rounding, which the sm_90 compile expands into compare-and-select sequences."""
    a_hi = tf32_high(a)
    b_hi = tf32_high(b)
    return mm(a_hi, b - b_hi, "tf32") + mm(a - a_hi, b_hi, "tf32") + mm(a_hi, b_hi, "tf32")


@triton.jit
def take_diagonal_blocks(a, B: tl.constexpr):
    """The diagonal B x B blocks of a square tile a [C, C] as a batch [C/B, B, B]:
    out[b, i, j] = a[b*B + i, b*B + j]."""
    NB: tl.constexpr = a.shape[0] // B
    nb = tl.arange(0, NB)
    same_block = nb[:, None, None, None] == nb[None, None, :, None]
    return tl.sum(tl.where(same_block, tl.reshape(a, (NB, B, NB, B)), 0.0), axis=2)


@triton.jit
def place_diagonal_blocks(blocks, C: tl.constexpr):
    """[C, C]: a batch of square blocks [C/B, B, B] on the diagonal (take_diagonal_blocks' inverse), 0 elsewhere."""
    NB: tl.constexpr = blocks.shape[0]
    nb = tl.arange(0, NB)
    same_block = nb[:, None, None, None] == nb[None, None, :, None]
    return tl.reshape(tl.where(same_block, tl.expand_dims(blocks, 2), 0.0), (C, C))


@triton.jit
def tile_offsets(row0, row_end, stride, col0, col_end, BR: tl.constexpr, BC: tl.constexpr):
    """Offsets and mask of the [BR, BC] tile x[row0 + i, col0 + j] of a row-major view whose rows are
    `stride` elements apart; rows at or past row_end and columns at or past col_end are masked. Row offsets
    are int64 (tokens * H * D passes 2^31 on long batches)."""
    rows = row0 + tl.arange(0, BR)
    cols = col0 + tl.arange(0, BC)
    offs = rows[:, None].to(tl.int64) * stride + cols[None, :]
    mask = (rows[:, None] < row_end) & (cols[None, :] < col_end)
    return offs, mask


@triton.jit
def chunk_span(cu_seqlens, chunk_indices, i_c, C: tl.constexpr):
    """(first token, number of tokens) of global chunk i_c. Chunks never cross sequences: the last chunk
    of a sequence may hold fewer than C tokens."""
    seq = tl.load(chunk_indices + 2 * i_c)
    local = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    eos = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    start = bos + local * C
    return start, tl.minimum(eos - start, C)


@triton.jit
def load_tile(x, row0, row_end, stride, col0, col_end, BR: tl.constexpr, BC: tl.constexpr):
    """x[row0 : row0 + BR, col0 : col0 + BC] of a row-major view, zero where masked (see tile_offsets)."""
    offs, mask = tile_offsets(row0, row_end, stride, col0, col_end, BR, BC)
    return tl.load(x + offs, mask=mask, other=0.0)


@triton.jit
def store_tile(x, value, row0, row_end, stride, col0, col_end, BR: tl.constexpr, BC: tl.constexpr):
    offs, mask = tile_offsets(row0, row_end, stride, col0, col_end, BR, BC)
    tl.store(x + offs, value.to(x.dtype.element_ty), mask=mask)


@triton.jit
def load_rows(x, start, n, i_h, d0, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Tokens [start, start + BT) of head i_h, columns [d0, d0 + BD), of a packed [TT, H, D] tensor; rows
    from n on (past the end of the sequence) read as zero."""
    return load_tile(x + i_h * D, start, start + n, H * D, d0, D, BT, BD)


@triton.jit
def store_rows(x, value, start, n, i_h, d0, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
               BD: tl.constexpr):
    store_tile(x + i_h * D, value, start, start + n, H * D, d0, D, BT, BD)


@triton.jit
def store_group_sum(out, group, value, start, n, i_hk, d0, HK: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                    BD: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr):
    """A value head's gradient tile (fp32) into its key head's sum over the group of value heads (group_members):
    added to the sum so far in group (fp32, [TT, HK, D]) unless FIRST, then stored there, or, if LAST, rounded into
    out. Rows as store_rows'."""
    if not FIRST:
        value += load_rows(group, start, n, i_hk, d0, HK, D, BT, BD)
    store_rows(out if LAST else group, value, start, n, i_hk, d0, HK, D, BT, BD)


def group_members(heads: int, key_heads: int):
    """(member, FIRST, LAST) of each launch of a stage that sums a gradient over each key head's group of
    heads // key_heads value heads (store_group_sum): one launch a member, value head key_head * G + member, in
    order, so that the sums are the same every run. One launch, first and last, without groups."""
    G = heads // key_heads
    return [(j, j == 0, j == G - 1) for j in range(G)]


@triton.jit
def state_offsets(i_s, k0, v0, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Offsets and mask of the tile [k0:k0+BK, v0:v0+BV] of state i_s of a [*, K, V] state tensor
    (i_s = chunk * H + head, or sequence * H + head)."""
    return tile_offsets(i_s.to(tl.int64) * K + k0, (i_s.to(tl.int64) + 1) * K, V, v0, V, BK, BV)


@triton.jit
def state_offsets_v_first(i_s, k0, v0, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """state_offsets' tile [k0:k0+BK, v0:v0+BV] of state i_s, in a [*, V, K] state tensor (the V-first layout of
    vLLM's and FlashInfer's state pools): the same [BK, BV] tile, read from and written to its transpose."""
    ck = k0 + tl.arange(0, BK)
    cv = v0 + tl.arange(0, BV)
    return i_s.to(tl.int64) * (K * V) + cv[None, :] * K + ck[:, None], (ck[:, None] < K) & (cv[None, :] < V)


def dot_precision(dtype: torch.dtype) -> str:
    """Precision of fp32 dots for inputs of this dtype: fp32 inputs must stay ieee-accurate (bound 1e-4),
    16-bit inputs round their fp32 intermediates to 16 bits anyway, so tf32 costs nothing there."""
    return "ieee" if dtype == torch.float32 else "tf32"


TRIL_PRECISIONS = ("ieee", "tf32x3", "tf32_newton")


def tril_precision(dtype: torch.dtype) -> Tuple[str, bool]:
    """(precision of the products inside the triangular inverse, whether one Newton step follows) for
    inputs of this dtype. DELTATRON_TRIL_PRECISION picks one of TRIL_PRECISIONS; the default is ieee for
    fp32 inputs and tf32_newton for 16-bit ones:

      ieee         fp32 products on the CUDA cores;
      tf32x3       fp32 accuracy on the tensor cores (three tf32 products each);
      tf32_newton  tf32 products, then T <- T + T (I - (I + A) T) with the residual's product in tf32x3.

    Plain tf32 is not offered: with nearly parallel keys (repeated tokens) the products cancel heavily, and
    tf32 alone puts 1e-2 of error in T and 8e-3 in one chunk's 16-bit output, over fp16's 3e-3 bound; the
    Newton step brings that to 1.9e-4, as tf32x3 throughout does, at the cost of two products instead of
    tripling every one (DESIGN.md §2, §8)."""
    p = os.environ.get("DELTATRON_TRIL_PRECISION", "ieee" if dtype == torch.float32 else "tf32_newton")
    if p not in TRIL_PRECISIONS:
        raise ValueError(f"DELTATRON_TRIL_PRECISION must be one of {', '.join(TRIL_PRECISIONS)}; got {p!r}")
    return ("tf32", True) if p == "tf32_newton" else (p, False)


# Host-side integer helpers. triton.cdiv and triton.next_power_of_2 cost about 5 µs per call on the host
# (constexpr-function wrappers, triton 3.6 and 3.9 alike), and a decode step or a small chunk call makes
# dozens of them; these are plain integer arithmetic.
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive integers."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


@functools.lru_cache(maxsize=None)
def head_block(size: int) -> int:
    """Block covering a whole head dimension: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, next_power_of_2(size))


@functools.lru_cache(maxsize=None)
def head_tile(size: int) -> int:
    """Tile of a head dimension that a program loops over: head_block, at most 64 wide."""
    return min(64, head_block(size))


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere): programs that fit run in one wave."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def two_streams(x: torch.Tensor) -> bool:
    """Whether work on x can run on a second CUDA stream beside the current one (CUDA tensors, not the
    interpreter): the backward's overlap and segments and the forward's sequence split depend on it."""
    return x.is_cuda and not INTERPRET


@functools.lru_cache(maxsize=None)
def side_stream(device_index: int) -> torch.cuda.Stream:
    """The side stream of a device: made once and reused (a stream is a driver object, not free to make)."""
    return torch.cuda.Stream(device=device_index)


def state_block_v(K: int, V: int, num_states: int, min_programs: int = 128, max_tile: int = 8192,
                  shrink: bool = not INTERPRET) -> int:
    """V-block of a serial state pass (one program walks a whole sequence with S [K, BV] in registers):
    as wide as registers allow (the tile is at most max_tile fp32: 8192 is 64 registers a thread at 4
    warps; and at most max_tile / 128 columns, 64 by default), halved while sequences * heads * V-blocks
    are fewer than min_programs, which would leave SMs idle (shrink; not under the interpreter, where programs
    run in turn). The plan's launches (plan.walk_launch, plan.reverse_launch) call it."""
    bv = min(max_tile // 128, head_block(V), max_tile // head_block(K))
    while shrink and bv > 16 and num_states * cdiv(V, bv) < min_programs:
        bv //= 2
    return bv


# Software-pipelining depth of the chunk kernels' loops (triton 3.6, H200): 1 gives wrong results or illegal
# memory accesses with 16-bit dots, 3 runs out of shared memory at K = 256; 2 is right everywhere.
PIPELINE_STAGES = 2
# The WY kernels (W, U and their backward) pipeline 3 deep: their tiles are at most 64 wide whatever K, V are,
# so a third stage fits in shared memory at every head size, and it is faster with the same outputs.
WY_PIPELINE_STAGES = 3


@functools.lru_cache(maxsize=64)
def _fixed_length_info(B: int, T: int, device: torch.device) -> SeqInfo:
    if T:
        cpu = torch.arange(0, B * T + 1, T, dtype=torch.int64)
    else:
        cpu = torch.zeros(B + 1, dtype=torch.int64)
    return SeqInfo(cpu.to(torch.int32).to(device), cpu, B, B * T)


def seq_info(B: int, T: int, device: torch.device, cu_seqlens, cu_seqlens_cpu: Optional[torch.Tensor]) -> SeqInfo:
    """SeqInfo of a [B, T] batch; with cu_seqlens (B == 1) the packed sequences it describes: a tensor, with
    cu_seqlens_cpu (the public API makes it when the caller did not), or a VarlenMetadata (itself)."""
    if isinstance(cu_seqlens, VarlenMetadata):
        return cu_seqlens
    if cu_seqlens is None:
        return _fixed_length_info(B, T, device)
    return SeqInfo(cu_seqlens.to(torch.int32), cu_seqlens_cpu.to(torch.int64), len(cu_seqlens_cpu) - 1, T)
