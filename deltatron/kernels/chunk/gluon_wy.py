"""The WY forward (wy.wy_fwd's fused 16-bit case: Tinv, W, U of each chunk from K, V and beta) as a Gluon kernel
for Hopper (triton 3.6, sm_90, 16-bit, C = 64, K = V = 128 or 64). Off by default: wy.wy_fwd runs it only where
wy.GLUON_WY is True (not measured on a GPU yet).

The same math as wy_kernel's 16-bit path (wy.py, solve_tril.py, kkt.py; tril_precision's tf32_newton), one
program (one warp group) per chunk and head:
    TMA loads of the chunk's K and V tiles [C, D] into shared memory, both issued first, each on its own
        mbarrier, so V's arrives while the inverse runs;
    A = tril(diag(beta) K K^T, -1): one 16-bit wgmma (K and K^T straight from the TMA tile), beta scaling the
        rows of the fp32 product; rows and columns at or past the chunk's end n are zero, so T is the identity
        there (the TMA tile's rows past n hold the next sequence's tokens or TMA's zero fill);
    T = (I + A)^{-1} by doubling, T <- T - T E_S T for S = 1, 2, 4, 8 (the four diagonal 16-blocks' levels),
        16 and 32 (the merges), E_S the blocks of A below the diagonal S-blocks inside each diagonal 2S-block.
        Every level runs on the whole [C, C] tile: T is block diagonal at each level, so the product is exactly
        the per-block one, and the blocks never leave the tile (wy_kernel's extraction and reassembly of the
        16-blocks were 450 of its 3,496 SASS instructions). Level S = 1 starts from T = I: T = I - E_1, no
        product. The products are tf32 wgmma with both operands stored from registers into fp32 shared-memory
        tiles, the right one K-major (wgmma's rule for tf32). With BLOCKED_LEVELS, each level's products run on
        16-column pieces and only the blocks that can be nonzero (shared-memory subviews), under a quarter of the
        levels' tensor work, the pieces put back into the tile through shared memory;
    one Newton step T <- T + T R, R = I - (I + A) T, the product A T in tf32x3 (A_hi T_hi + A_lo T_hi +
        A_hi T_lo, the hi parts by masking the low 13 mantissa bits: exact, no rounding), T R in tf32;
    Tb = T diag(beta) as a 16-bit pair hi + lo, W = hi K + lo K, U = hi V + lo V (16-bit wgmma, fp32
        accumulation, rounded to the input dtype);
    W, U and (STORE_TINV) Tinv stored from registers by masked pointer stores, rows at or past n left alone (a
        TMA store would write them: they are the next sequence's rows).

Shared memory: K and V tiles (2 x 16 KiB at D = 128) and two fp32 [C, C] operand tiles (2 x 16 KiB) that every
tf32 product's operands pass through in turn: 64 KiB, so 3 programs an SM at D = 128 (4 at D = 64 by shared
memory; registers allow 3 either way). Not warp-specialized and not persistent: the products of a program are
serial, and the SM overlaps programs. Offline numbers and the prediction are in benchmarks/NOTES.md (session 15).

Imported only where it can run (wy.wy_fwd imports it lazily where wy.gluon_wy_applies: a CUDA sm_90 device, not
the interpreter, a triton with Gluon's Hopper API): Gluon does not run in TRITON_INTERPRET, and CI's triton may
lack its Hopper API."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..launch import launch
from ..utils import SeqInfo
from .gluon_walk import accumulator_layout, register_operand, tile_layout

C_WY = 64  # chunk size of this kernel
HEAD_SIZES = (64, 128)  # K = V of this kernel
# Whether the doubling levels S = 2 .. 32 run on 16-column pieces with only their nonzero blocks (blocked_level:
# 18 tf32 m64n64k8-equivalents instead of 80, through shared-memory subviews and more shared-memory round trips)
# or on the whole tile (the simpler one; the default until the two are measured on a GPU:
# benchmarks/diagnostics/gluon_wy.py)
BLOCKED_LEVELS = False
# registers a thread: 3 programs of 4 warps an SM (shared memory allows 3 at D = 128 anyway). Offline sm_90: no
# spills at this cap with either form of the levels; at 128 (4 programs an SM at D = 64) they spill 60-68 B
MAX_REGISTERS = 168
TF32_HI_MASK = gl.constexpr(-8192)  # 0xFFFFE000: fp32 bits that tf32 keeps (sign, exponent, 10 mantissa bits)


@gluon.constexpr_function
def tf32_accumulator_layout(num_warps, n):
    """accumulator_layout's row split for tf32 products (their instruction's K is 8, not 16: the same registers,
    so converting between the two moves nothing)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 8])


@gluon.jit
def tf32_hi(x):
    """x with its low 13 mantissa bits cleared: what tf32 keeps of it, so that x - tf32_hi(x) is exact."""
    return (x.to(gl.int32, bitcast=True) & TF32_HI_MASK).to(gl.float32, bitcast=True)


@gluon.jit
def product_tf32(x, y, operands, acc, use_acc: gl.constexpr = True):
    """acc + x y (tf32 wgmma; acc only shapes the result without use_acc), both operands through shared memory:
    operands = (lhs, rhs), [C, C] fp32 tiles, x stored row-major in lhs and y K-major in rhs (wgmma takes fp32
    operands K-major only). From registers x would need a layout conversion of its own (shuffles and selects:
    more instructions and registers than the vectorized store). Their previous reader has finished: every
    product here is synchronous."""
    lhs, rhs = operands
    lhs.store(x)
    rhs.store(y)
    fence_async_shared()  # wgmma reads the tiles through the async proxy
    return warpgroup_mma(lhs, rhs, acc, use_acc=use_acc)  # fp32 operands: tf32 (the default precision)


@gluon.constexpr_function
def piece_updated(c, S, P):
    """Whether column piece c (P wide) of ne T is nonzero at level S: ne's columns are nonzero only in the first
    S-block of each 2S-block (in every 16-block below S = 16)."""
    return S < P or (c * P // S) % 2 == 0


@gluon.constexpr_function
def piece_index(c, S, P):
    """The position of column piece c among the updated ones (piece_updated) at level S."""
    return sum(piece_updated(j, S, P) for j in range(c))


@gluon.constexpr_function
def t_rows(S, P):
    """The rows of T that a column piece of ne T reads (from the piece's own block on): T is block diagonal in
    max(S, P)-blocks."""
    return max(S, P)


@gluon.constexpr_function
def net_rows(c, S, P):
    """The first row where column piece c of ne T can be nonzero (net_size rows from it): its own P-block below
    S = P, else the second S-block of its 2S-block."""
    return c * P if S < P else c * P // (2 * S) * (2 * S) + S


@gluon.jit
def blocked_level(ne, t, operands, LEVEL: gl.constexpr, num_warps: gl.constexpr):
    """The doubling level S = 2^LEVEL, T + T (ne T), on [C, 16] column pieces of the result, each product taking only
    the part of its inner dimension where its operands can be nonzero (shared-memory subviews of the operand tiles;
    t_rows, net_rows): [C, max(S, 16)] x [max(S, 16), 16] and [C, S] x [S, 16] (16 x 16 below S = 16) instead of
    [C, C] x [C, 16];
    pieces where ne T is zero keep T's columns (piece_updated). ne, t and the result are [C, C] tiles in the
    accumulator layout; the pieces go back into the tile through shared memory."""
    lhs, rhs = operands
    C: gl.constexpr = lhs.shape[0]
    S: gl.constexpr = 1 << LEVEL
    P: gl.constexpr = 16
    G: gl.constexpr = t_rows(S, P)
    R: gl.constexpr = P if S < P else S  # rows of ne T's nonzero block in a piece
    piece: gl.constexpr = tf32_accumulator_layout(num_warps, P)
    lhs.store(ne)
    rhs.store(t)
    fence_async_shared()
    nets = ()
    for c in gl.static_range(C // P):
        if piece_updated(c, S, P):
            nets = nets + (warpgroup_mma(lhs.slice(c * P // G * G, G, dim=1),
                                         rhs.slice(c * P // G * G, G, dim=0).slice(c * P, P, dim=1),
                                         gl.zeros([C, P], gl.float32, layout=piece), use_acc=False, is_async=True), )
    nets = warpgroup_mma_wait(num_outstanding=0, deps=nets)
    lhs.store(t)
    for c in gl.static_range(C // P):
        if piece_updated(c, S, P):
            rhs.slice(c * P, P, dim=1).store(nets[piece_index(c, S, P)])
    fence_async_shared()
    ts = ()
    for c in gl.static_range(C // P):
        if piece_updated(c, S, P):
            ts = ts + (warpgroup_mma(lhs.slice(net_rows(c, S, P), R, dim=1),
                                     rhs.slice(net_rows(c, S, P), R, dim=0).slice(c * P, P, dim=1),
                                     lhs.slice(c * P, P, dim=1).load(piece), is_async=True), )
    ts = warpgroup_mma_wait(num_outstanding=0, deps=ts)
    for c in gl.static_range(C // P):
        if piece_updated(c, S, P):
            lhs.slice(c * P, P, dim=1).store(ts[piece_index(c, S, P)])
    return lhs.load(t.type.layout)


@gluon.jit
def gluon_wy_kernel(k_desc, v_desc, beta, tinv, w, u, cu_seqlens, chunk_indices, H: gl.constexpr,
                    STORE_TINV: gl.constexpr, BLOCKED_LEVELS: gl.constexpr, num_warps: gl.constexpr):
    C: gl.constexpr = k_desc.block_type.shape[0]
    K: gl.constexpr = k_desc.block_type.shape[1]
    V: gl.constexpr = v_desc.block_type.shape[1]
    gl.static_assert(num_warps == 4 and C == 64, "one warp group a chunk of 64 rows (wgmma's M)")
    dt: gl.constexpr = k_desc.dtype
    i_c, i_h = gl.program_id(0), gl.program_id(1)
    seq = gl.load(chunk_indices + 2 * i_c)
    bos = gl.load(cu_seqlens + seq)
    start = bos + gl.load(chunk_indices + 2 * i_c + 1) * C
    n = gl.minimum(gl.load(cu_seqlens + seq + 1) - start, C)

    k_smem = gl.allocate_shared_memory(dt, [C, K], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dt, [C, V], v_desc.layout)
    # the tf32 products' operands: the left [m, k] row-major, the right [k, n] K-major (wgmma takes fp32 operands
    # K-major only)
    operands = (gl.allocate_shared_memory(gl.float32, [C, C], gl.NVMMASharedLayout.get_default_for([C, C], gl.float32)),
                gl.allocate_shared_memory(gl.float32, [C, C],
                                          gl.NVMMASharedLayout.get_default_for([C, C], gl.float32, transposed=True)))
    loaded = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(loaded.index(0), count=1)
    mbarrier.init(loaded.index(1), count=1)
    fence_async_shared()  # the barriers' initialization before TMA sees them
    mbarrier.expect(loaded.index(0), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [start, i_h * K], loaded.index(0), k_smem)
    mbarrier.expect(loaded.index(1), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [start, i_h * V], loaded.index(1), v_smem)

    acc_layout: gl.constexpr = tf32_accumulator_layout(num_warps, C)
    ri = gl.arange(0, C, layout=gl.SliceLayout(1, acc_layout))
    cj = gl.arange(0, C, layout=gl.SliceLayout(0, acc_layout))
    eye = gl.where(ri[:, None] == cj[None, :], 1.0, 0.0)
    beta_h = beta + i_h
    beta_r = gl.load(beta_h + (start + ri).to(gl.int64) * H, mask=ri < n, other=0.0).to(gl.float32)

    mbarrier.wait(loaded.index(0), 0)
    a = warpgroup_mma(k_smem, k_smem.permute((1, 0)), gl.zeros([C, C], gl.float32, accumulator_layout(num_warps, C)),
                      use_acc=False)
    a = gl.convert_layout(a, acc_layout)
    # beta scales rows after the fp32 product (16-bit inputs are not rounded twice); rows past n are zero. The
    # tile held is -A: every product below subtracts, and negating the operand once costs nothing here
    na = gl.where((ri[:, None] > cj[None, :]) & (ri[:, None] < n), a * -beta_r[:, None], 0.0)

    # level S = 1 from T = I: T = I - E_1; then T <- T + T (-E_S T)
    t = eye + gl.where((ri[:, None] // 2 == cj[None, :] // 2) & (ri[:, None] > cj[None, :]), na, 0.0)
    for level in gl.static_range(1, 6):  # S = 2, 4, 8 (inside the diagonal 16-blocks), 16, 32 (the merges)
        S = 1 << level
        ne = gl.where((ri[:, None] // (2 * S) == cj[None, :] // (2 * S)) & (ri[:, None] // S > cj[None, :] // S),
                      na, 0.0)
        if BLOCKED_LEVELS:
            t = blocked_level(ne, t, operands, level, num_warps)
        else:
            net = product_tf32(ne, t, operands, t, use_acc=False)
            t = product_tf32(t, net, operands, t)

    # Newton: R = I - T - A T with A T in tf32x3 (R is a small difference of O(1) terms), then T + T R in tf32
    # (tf32_hi keeps the sign: the hi and lo parts of -A are those of A negated). The lo part of -A goes first, so
    # that -A is dead after it; each later term changes one operand tile only (-A_hi T_hi: T_hi still in rhs;
    # -A_hi T_lo: -A_hi still in lhs)
    lhs, rhs = operands
    na_hi = tf32_hi(na)
    t_hi = tf32_hi(t)
    residual = product_tf32(na - na_hi, t_hi, operands, eye - t)
    lhs.store(na_hi)
    fence_async_shared()
    residual = warpgroup_mma(lhs, rhs, residual)
    rhs.store(t - t_hi)
    fence_async_shared()
    residual = warpgroup_mma(lhs, rhs, residual)
    t = product_tf32(t, residual, operands, t)

    if STORE_TINV:
        o_t = (start + ri[:, None]).to(gl.int64) * (H * C) + i_h * C + cj[None, :]
        gl.store(tinv + o_t, t, mask=ri[:, None] < n)

    # Tb = T diag(beta) as hi + lo of the input dtype: W's rows cancel with nearly parallel keys, where Tb
    # rounded to 16 bits alone would be 7e-2 off (wy.tinv_beta_pair)
    beta_c = gl.load(beta_h + (start + cj).to(gl.int64) * H, mask=cj < n, other=0.0).to(gl.float32)
    tb = t * beta_c[None, :]
    tb_hi = tb.to(dt)
    tb_lo = (tb - tb_hi.to(gl.float32)).to(dt)
    apply_pair(tb_hi, tb_lo, k_smem, w, start, n, i_h, H, num_warps)
    mbarrier.wait(loaded.index(1), 0)
    apply_pair(tb_hi, tb_lo, v_smem, u, start, n, i_h, H, num_warps)
    mbarrier.invalidate(loaded.index(0))
    mbarrier.invalidate(loaded.index(1))


@gluon.jit
def apply_pair(tb_hi, tb_lo, x_smem, y, start, n, i_h, H: gl.constexpr, num_warps: gl.constexpr):
    """y = (tb_hi + tb_lo) x [C, D] of one chunk (fp32 accumulation, rounded to y's dtype), rows at or past n not
    stored; x the chunk's [C, D] tile in shared memory (its [k, n] as the B operand: 16-bit wgmma takes it
    N-major)."""
    C: gl.constexpr = x_smem.shape[0]
    D: gl.constexpr = x_smem.shape[1]
    layout: gl.constexpr = accumulator_layout(num_warps, D)
    operand: gl.constexpr = register_operand(layout)
    acc = warpgroup_mma(gl.convert_layout(tb_hi, operand), x_smem, gl.zeros([C, D], gl.float32, layout=layout),
                        use_acc=False)
    acc = warpgroup_mma(gl.convert_layout(tb_lo, operand), x_smem, acc)
    ri = gl.arange(0, C, layout=gl.SliceLayout(1, layout))
    cd = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    o_y = (start + ri[:, None]).to(gl.int64) * (H * D) + i_h * D + cd[None, :]
    gl.store(y + o_y, acc.to(y.dtype.element_ty), mask=ri[:, None] < n)


def check_inputs(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, info: SeqInfo, chunk_size: int) -> None:
    """What the kernel takes: k, v of one 16-bit dtype, K = V in HEAD_SIZES, C = C_WY, the batch's tokens as
    contiguous rows (the descriptors and the stores address row r of head h at r * H * D + h * D), 16-byte
    aligned bases (TMA), beta [.., H] contiguous."""
    if k.dtype != v.dtype or k.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gluon_wy: k and v must share one 16-bit dtype, got {k.dtype} and {v.dtype}")
    H, K, V = k.shape[2], k.shape[3], v.shape[3]
    if K != V or K not in HEAD_SIZES or v.shape[2] != H:
        raise ValueError(f"gluon_wy: K = V in {HEAD_SIZES} only, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if chunk_size != C_WY:
        raise ValueError(f"gluon_wy: chunk_size {C_WY} only, got {chunk_size}")
    TT = info.total_tokens
    if any(x.numel() != TT * H * K or not x.is_contiguous() for x in (k, v)):
        raise ValueError(f"gluon_wy: k, v must hold {TT} tokens of {H} heads, contiguous")
    if beta.numel() != TT * H or not beta.is_contiguous():
        raise ValueError(f"gluon_wy: beta must hold {TT} tokens of {H} heads, contiguous")
    if any(x.data_ptr() % 16 for x in (k, v)):
        raise ValueError("gluon_wy: k, v must start 16-byte aligned (TMA)")


def gluon_wy_fwd(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, info: SeqInfo, chunk_size: int = C_WY,
                 store_tinv: bool = True, blocked_levels: Optional[bool] = None
                 ) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """wy.wy_fwd's contract ((Tinv [B, T, H, C] fp32 or None without store_tinv, w, u)) on the Gluon kernel: k, v
    [B, T, H, D] or packed [1, TT, H, D] (cu_seqlens in info), 16-bit, D = K = V in HEAD_SIZES, C = 64. Rows past
    each sequence's end are not written (Tinv's rows there stay as allocated). With no chunk at all nothing is
    launched (a TMA descriptor's shape must be positive). blocked_levels: the doubling levels on pieces of their
    nonzero blocks (blocked_level) or on the whole tile; BLOCKED_LEVELS unless given."""
    check_inputs(k, v, beta, info, chunk_size)
    H, D = k.shape[2], k.shape[3]
    tinv = k.new_empty(*k.shape[:3], chunk_size, dtype=torch.float32) if store_tinv else None
    w, u = torch.empty_like(k), torch.empty_like(v)
    chunks = info.chunks(chunk_size)
    if chunks.num_chunks:
        TT = info.total_tokens
        # [TT, H * D] views (all B * T rows), tile [C, D] at (the chunk's first row, head * D); rows past TT are
        # TMA's zero fill
        k_desc, v_desc = (TensorDescriptor(x, [TT, H * D], [H * D, 1], [C_WY, D], tile_layout(x.dtype, C_WY, D))
                          for x in (k, v))
        blocked = BLOCKED_LEVELS if blocked_levels is None else blocked_levels
        launch(gluon_wy_kernel, (chunks.num_chunks, H), k_desc, v_desc, beta, tinv, w, u, info.cu_seqlens,
               chunks.chunk_indices, H, store_tinv, blocked, num_warps=4, maxnreg=MAX_REGISTERS)
    return tinv, w, u
