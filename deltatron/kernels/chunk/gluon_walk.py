"""The forward's fused state+output walk (state.state_output_fwd) as a warp-specialized Gluon kernel for Hopper
(triton 3.6, sm_90, 16-bit, K = V = 128, C = 64): state_output_fwd runs it where state.gluon_walk_pays (from 64
sequences x heads; the measurements are there).

One program per (sequence, head) walks its chunks as state.transposed_walk does, with S^T [V, K] fp32 in
registers, but split over three partitions that run side by side:
    loader (1 warp): TMA loads of each chunk's W, U, K, Q tiles [C, 128] into a ring of STAGES slots, each
        slot guarded by a `ready` mbarrier (TMA bytes) and an `empty` one (the chain and the output done);
    chain (the default partition, 8 warps = 2 warp groups, S^T rows split over them):
        V'^T = U^T - S^T W^T        (S^T rounded to the input dtype, from registers)
        S^T += V'^T K               (V'^T rounded to the input dtype, from registers)
        and hands S^T (rounded, the state entering the chunk) and V'^T to the output through a
        double-buffered pair of shared-memory tiles (mbarriers sv_ready / sv_empty);
    output (4 warps = 1 warp group):
        O = scale (Q S + (Q K^T ⊙ M) V')   (Q K^T masked j <= i and rounded as output.causal_output)
        stored straight from the accumulator's registers, rows past the sequence's end masked.
So the serial chain S -> W S -> V' -> K^T V' -> S runs only its two products, while the output's three and
the loads of the next chunks run in the other warps (plain Triton 3.6 waits on every product in program
order, so there all five products of a chunk are serial within a program).

Packed sequences: the descriptors span all B*T rows; a sequence's partial last chunk reads rows of the next
sequence (or TMA's zero fill past the end), which touch only V' rows past the end: those are zeroed before
K^T V' (so the final state is right) and O rows past the end are not stored (causal M keeps them out of the
valid rows). Initial state (HAS_H0): the chain loads S^T before its loop; final state (STORE_HT): the chain
stores S^T after it. The host wrapper takes [B, T, H, 128] or packed [1, TT, H, 128] (the descriptors are
[B * T, H * 128] either way) and, with no token at all, launches nothing (a TMA descriptor's shape must be
positive) and passes the initial state (or zeros) through as the final one.

Checked without a GPU (session 9 review): the TTGIR maps each partition's captures to the right ring slots and
descriptors; each mbarrier.arrive lowers to one thread's arrive after a partition-wide bar.sync (so count 1 a
partition, 2 for the ring's empties); each [64, 128] TMA load is two 128-byte-swizzled [64, 64] boxes, 8,192 B
each, 65,536 B a slot as expected; tests/test_gluon_walk_model.py runs a PyTorch model of this arithmetic
through the GPU test's check() (bitwise equal to the shipped walk in the interpreter at fp16, and check()
fails on a missing V' mask or causal diagonal).

Offline sm_90 compile (triton 3.6, bf16; benchmarks/diagnostics/gluon_walk.py --offline): 16 warps (8 + 4 + 1
padded to 4), setmaxnreg 176 / 128 / 24, no spills without the states (12 B in the chain with them); shared
memory 229,704 B of sm_90's 232,448 (ring 131,072, S^T tiles 65,536, V'^T tiles 32,768, the rest barriers
and scratch), so one program per SM and no room for a third ring slot. In the PTX each partition's loop
synchronizes only on its own named barrier (bar.sync 0, 256 in the chain; 2, 128 in the output; none in the
loader) and on mbarriers; the CTA-wide barrier 1 appears only where the partitions start and end, and each
wgmma.wait_group waits on its own warp group's products only. On the H200 (session 9): tests/gpu's checks
pass (o within 2e-5 of the Triton walk, the final state bitwise equal, reruns bitwise equal).

Imported only where it can run (state.gluon_walk_applies imports it lazily, on a CUDA sm_90 device): Gluon
does not run in TRITON_INTERPRET, and CI's triton may lack its Hopper API."""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..utils import SeqInfo

C_WALK, D_WALK = 64, 128  # chunk size and head size (K = V) of this kernel
CHAIN_WARPS, OUTPUT_WARPS = 8, 4
# registers a thread per partition (setmaxnreg; 16 warps: the loader's 1 warp is padded to a warp group):
# loader 24, output 128, and the chain what is left of 65,536, (65536 - 128 (24 + 128)) / 256 = 176. Offline
# (ptxas, sm_90a): no spills at output 128 (none at 152 either, where the chain's 168 spill 20 B with the
# states); the chain spills 12 B (3 registers) at 176 when it loads and stores the states, none without
LOADER_REGS, OUTPUT_REGS = 24, 128
STAGES = 2  # ring slots of W, U, K, Q tiles (64 KiB a slot at bf16)


@functools.lru_cache(maxsize=None)
def tile_layout(dtype: torch.dtype, rows: int, cols: int) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a [rows, cols] TMA tile of a 16-bit dtype (cached: building it took 17 us of
    host time a call on the development CPU, triton 3.6; descriptors 5 us each)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


@gluon.jit
def loader_partition(descs, ring, ready, empty, bos, num_chunks, i_h, C: gl.constexpr, D: gl.constexpr):
    """TMA of chunk t's W, U, K, Q tiles into slot t % STAGES once both consumers released it."""
    w_desc, u_desc, k_desc, q_desc = descs
    w_ring, u_ring, k_ring, q_ring = ring
    NS: gl.constexpr = w_ring.shape[0]
    for t in range(num_chunks):
        s = t % NS
        mbarrier.wait(empty.index(s), ((t // NS) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
        # the consumers read U from this slot through the generic proxy: order it before TMA's writes
        fence_async_shared()
        bar = ready.index(s)
        mbarrier.expect(bar, 4 * w_desc.block_type.nbytes)
        row = bos + t * C
        tma.async_copy_global_to_shared(w_desc, [row, i_h * D], bar, w_ring.index(s))
        tma.async_copy_global_to_shared(u_desc, [row, i_h * D], bar, u_ring.index(s))
        tma.async_copy_global_to_shared(k_desc, [row, i_h * D], bar, k_ring.index(s))
        tma.async_copy_global_to_shared(q_desc, [row, i_h * D], bar, q_ring.index(s))


@gluon.jit
def chain_partition(ring, ready, empty, st_bufs, vt_bufs, sv_ready, sv_empty, h0, ht, i_nh, bos, eos, num_chunks,
                    C: gl.constexpr, D: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr,
                    num_warps: gl.constexpr):
    """The serial chain on S^T [D, D] fp32 (rows V, columns K), both products with the rounded S^T or V'^T
    as the register operand; S^T and V'^T of each chunk go to the output partition."""
    w_ring, u_ring, k_ring, q_ring = ring
    NS: gl.constexpr = w_ring.shape[0]
    dt: gl.constexpr = w_ring.dtype
    # warps stacked along the V rows (16 rows a warp): the two products' accumulators and the operand made
    # from one accumulator for the other share the row split, so no data moves between threads
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    vn_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, C, 16])
    sd_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=vn_layout, k_width=2)
    vn_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)

    rv = gl.arange(0, D, layout=gl.SliceLayout(1, s_layout))
    ck = gl.arange(0, D, layout=gl.SliceLayout(0, s_layout))
    o_st = ck[None, :] * D + rv[:, None]  # S^T's [V, K] view of a state [K, V]
    if HAS_H0:
        b_st = gl.load(h0 + i_nh.to(gl.int64) * D * D + o_st).to(gl.float32)
    else:
        b_st = gl.zeros([D, D], gl.float32, layout=s_layout)
    tokens = gl.arange(0, C, layout=gl.SliceLayout(0, vn_layout))

    for t in range(num_chunks):
        s = t % NS
        b = t % 2
        mbarrier.wait(ready.index(s), (t // NS) & 1)
        b_sd = b_st.to(dt)
        b_wst = warpgroup_mma(gl.convert_layout(b_sd, sd_operand), w_ring.index(s).permute((1, 0)),
                              gl.zeros([D, C], gl.float32, layout=vn_layout), use_acc=False, is_async=True)
        # while S^T W^T runs: hand S^T to the output (once it is done with the buffer two chunks back)
        mbarrier.wait(sv_empty.index(b), ((t // 2) & 1) ^ 1)
        st_bufs.index(b).store(b_sd)
        b_ut = u_ring.index(s).permute((1, 0)).load(vn_layout).to(gl.float32)
        b_wst = warpgroup_mma_wait(num_outstanding=0, deps=(b_wst, ))
        # V' rows past the sequence's end (the next sequence's tokens) must not reach the state
        b_vnt = gl.where(tokens[None, :] < eos - bos - t * C, b_ut - b_wst, 0.0).to(dt)
        b_st = warpgroup_mma(gl.convert_layout(b_vnt, vn_operand), k_ring.index(s), b_st, is_async=True)
        vt_bufs.index(b).store(b_vnt)
        fence_async_shared()  # the output reads both buffers through wgmma (the async proxy)
        mbarrier.arrive(sv_ready.index(b), count=1)
        b_st = warpgroup_mma_wait(num_outstanding=0, deps=(b_st, ))
        mbarrier.arrive(empty.index(s), count=1)

    if STORE_HT:
        gl.store(ht + i_nh.to(gl.int64) * D * D + o_st, b_st)


@gluon.jit
def output_partition(ring, ready, empty, st_bufs, vt_bufs, sv_ready, sv_empty, o, scale, bos, eos, num_chunks, i_h,
                     H: gl.constexpr, C: gl.constexpr, D: gl.constexpr):
    """O = scale (Q S + (Q K^T ⊙ M) V') of each chunk, from the ring's Q, K and the chain's S^T, V'^T."""
    w_ring, u_ring, k_ring, q_ring = ring
    NS: gl.constexpr = w_ring.shape[0]
    dt: gl.constexpr = w_ring.dtype
    WARPS: gl.constexpr = gl.num_warps()
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, C, 16])
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    pi = gl.arange(0, C, layout=gl.SliceLayout(1, p_layout))
    pj = gl.arange(0, C, layout=gl.SliceLayout(0, p_layout))
    ri = gl.arange(0, C, layout=gl.SliceLayout(1, o_layout))
    cv = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))

    for t in range(num_chunks):
        s = t % NS
        b = t % 2
        mbarrier.wait(ready.index(s), (t // NS) & 1)
        q_s = q_ring.index(s)
        # Q K^T does not depend on the chain: before waiting for it
        b_p = warpgroup_mma(q_s, k_ring.index(s).permute((1, 0)), gl.zeros([C, C], gl.float32, layout=p_layout),
                            use_acc=False, is_async=True)
        b_p = warpgroup_mma_wait(num_outstanding=0, deps=(b_p, ))
        b_p = gl.convert_layout(gl.where(pi[:, None] >= pj[None, :], b_p, 0.0).to(dt), p_operand)
        mbarrier.wait(sv_ready.index(b), (t // 2) & 1)
        b_o = warpgroup_mma(q_s, st_bufs.index(b).permute((1, 0)), gl.zeros([C, D], gl.float32, layout=o_layout),
                            use_acc=False, is_async=True)
        b_o = warpgroup_mma(b_p, vt_bufs.index(b).permute((1, 0)), b_o, is_async=True)
        b_o = warpgroup_mma_wait(num_outstanding=0, deps=(b_o, ))
        mbarrier.arrive(sv_empty.index(b), count=1)
        mbarrier.arrive(empty.index(s), count=1)
        start = bos + t * C
        o_o = (start + ri[:, None]).to(gl.int64) * (H * D) + i_h * D + cv[None, :]
        gl.store(o + o_o, (b_o * scale).to(dt), mask=ri[:, None] < eos - start)


@gluon.jit
def gluon_walk_kernel(w_desc, u_desc, k_desc, q_desc, o, h0, ht, scale, cu_seqlens, H: gl.constexpr,
                      HAS_H0: gl.constexpr, STORE_HT: gl.constexpr, LOADER_REGS: gl.constexpr,
                      OUTPUT_WARPS: gl.constexpr, OUTPUT_REGS: gl.constexpr, STAGES: gl.constexpr,
                      num_warps: gl.constexpr):
    C: gl.constexpr = w_desc.block_type.shape[0]
    D: gl.constexpr = w_desc.block_type.shape[1]
    NS: gl.constexpr = STAGES
    dt: gl.constexpr = w_desc.dtype
    i_nh = gl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    bos = gl.load(cu_seqlens + i_n)
    eos = gl.load(cu_seqlens + i_n + 1)
    num_chunks = gl.cdiv(eos - bos, C)

    tile: gl.constexpr = w_desc.layout
    ring = (gl.allocate_shared_memory(dt, [NS, C, D], tile), gl.allocate_shared_memory(dt, [NS, C, D], tile),
            gl.allocate_shared_memory(dt, [NS, C, D], tile), gl.allocate_shared_memory(dt, [NS, C, D], tile))
    st_bufs = gl.allocate_shared_memory(dt, [2, D, D], gl.NVMMASharedLayout.get_default_for([D, D], dt))
    vt_bufs = gl.allocate_shared_memory(dt, [2, D, C], gl.NVMMASharedLayout.get_default_for([D, C], dt))
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    sv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    sv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # the chain and the output
    for i in gl.static_range(2):
        mbarrier.init(sv_ready.index(i), count=1)
        mbarrier.init(sv_empty.index(i), count=1)

    gl.warp_specialize([
        (chain_partition, (ring, ready, empty, st_bufs, vt_bufs, sv_ready, sv_empty, h0, ht, i_nh, bos, eos,
                           num_chunks, C, D, HAS_H0, STORE_HT, num_warps)),
        (output_partition, (ring, ready, empty, st_bufs, vt_bufs, sv_ready, sv_empty, o, scale, bos, eos, num_chunks,
                            i_h, H, C, D)),
        (loader_partition, ((w_desc, u_desc, k_desc, q_desc), ring, ready, empty, bos, num_chunks, i_h, C, D)),
    ], [OUTPUT_WARPS, 1], [OUTPUT_REGS, LOADER_REGS])


def gluon_walk_launch(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, o: torch.Tensor,
                      scale: float, initial_state: Optional[torch.Tensor], final_state: Optional[torch.Tensor],
                      info: SeqInfo):
    """Launches (or, under benchmarks/diagnostics' offline compile, compiles) the kernel on q, k, w, u [B, T, H,
    128] (packed [1, TT, H, 128] with cu_seqlens; contiguous rows: the descriptors and o's offsets address row
    r of head h at r * H * 128 + h * 128) into o (contiguous, u's shape). With no tokens at all (TT = 0, where
    a TMA descriptor cannot be built: its shape must be positive) nothing is launched and final_state gets
    the initial state (or zeros), as the shipped walk's programs without chunks store it."""
    H, D = k.shape[2], k.shape[3]
    if any(x.dtype != k.dtype for x in (q, w, u)) or k.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gluon_walk: q, k, w, u must share one 16-bit dtype, got {q.dtype}, {k.dtype}, "
                         f"{w.dtype}, {u.dtype}")
    if D != D_WALK or any(tuple(x.shape[2:]) != (H, D_WALK) for x in (q, w, u)):
        raise ValueError(f"gluon_walk: 16-bit K = V = {D_WALK} only, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"w {tuple(w.shape)}, u {tuple(u.shape)}")
    TT = info.total_tokens
    if any(x.numel() != TT * H * D for x in (q, k, w, u)) or not o.is_contiguous() or o.shape != u.shape:
        raise ValueError(f"gluon_walk: q, k, w, u must hold {TT} tokens of {H} heads (o contiguous, u's shape)")
    N = info.num_seqs
    if initial_state is not None and (tuple(initial_state.shape) != (N, H, D, D) or not initial_state.is_contiguous()):
        raise ValueError(f"gluon_walk: initial_state must be contiguous [{N}, {H}, {D}, {D}], got "
                         f"{tuple(initial_state.shape)}")
    if TT == 0 or N * H == 0:
        if final_state is not None and initial_state is not None:
            final_state.copy_(initial_state)
        elif final_state is not None:
            final_state.zero_()
        return
    layout = tile_layout(k.dtype, C_WALK, D)
    # [TT, H * 128] per tensor (all B * T rows, whatever B is), tile [C, 128] at (row, head * 128); rows past
    # TT are TMA's zero fill
    descs = [TensorDescriptor.from_tensor(x.reshape(TT, H * D), [C_WALK, D], layout) for x in (w, u, k, q)]
    grid = (N * H, )
    gluon_walk_kernel[grid](*descs, o, initial_state, final_state, scale, info.cu_seqlens, H,
                            initial_state is not None, final_state is not None, LOADER_REGS, OUTPUT_WARPS,
                            OUTPUT_REGS, STAGES, num_warps=CHAIN_WARPS)


def gluon_state_output_fwd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, scale: float,
                           initial_state: Optional[torch.Tensor], output_final_state: bool, info: SeqInfo,
                           chunk_size: int = C_WALK) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """state.state_output_fwd's contract ((o, final_state or None)) on the Gluon walk: 16-bit, K = V = 128,
    C = 64, q, k, w, u [B, T, H, 128] or packed [1, TT, H, 128]."""
    if chunk_size != C_WALK:
        raise ValueError(f"gluon_walk: chunk_size {C_WALK} only, got {chunk_size}")
    o = torch.empty(u.shape, dtype=u.dtype, device=u.device)  # contiguous, whatever u's strides
    N, H = info.num_seqs, k.shape[2]
    final_state = k.new_empty(N, H, D_WALK, D_WALK, dtype=torch.float32) if output_final_state else None
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    gluon_walk_launch(q, k, w, u, o, scale, h0, final_state, info)
    return o, final_state
