"""The forward's walk as a warp-specialized Gluon kernel for sm_90 (triton 3.6; 16-bit, K = V = 128, C = 64): the
contract of portable/walk.py's state_output_fwd, run where the plan chooses the Hopper walk (DESIGN.md §5, §6).

One program per (sequence, head, V-block of BV rows of S^T); three partitions run side by side:
    loader (1 warp): TMA loads of each chunk's W, K, Q tiles [C, 128] and U's V-block [C, BV] into a ring of slots,
        each guarded by a `ready` mbarrier (TMA bytes) and an `empty` one (the chain and the output done);
    chain (BV / 16 warps, S^T [BV, K] fp32 in registers): V'^T = U^T - S^T W^T, S^T += V'^T K, each product taking
        the rounded S^T or V'^T from registers as wgmma's A operand (hence S^T, not S); it hands the rounded S^T and
        V'^T to the output through double-buffered shared tiles (sv_ready / sv_empty);
    output (1 warp group): O = scale (Q S + (Q K^T ⊙ M) V'), stored from the accumulator's registers.
So the serial chain runs only its two products while the output's three and the next chunks' loads run in other
warps (plain Triton waits on every product in program order).
Gated (USE_G, DESIGN.md §11): W carries exp(γ) already (the WY stage's), so V' = U - W S is unchanged (in the residual
form the chain puts exp(γ) on K S's rows: V' = Tb (V - diag(exp(γ)) K S)); the chain
decays S^T by exp(γ_C) and takes V'^T's columns times exp(γ_C - γ_j) into the state product (V' goes to the output
undecayed), and the output scales Q S's rows by exp(γ_i) and Q K^T by E_ij = exp(γ_i - γ_j): every exponent <= 0.
Grouped value heads: a program walks a value head and its loader reads the Q, K tiles of the head's key head.
Variants (constexprs of gluon_walk_kernel): RESIDUAL, V'^T = (V^T - S^T K^T) Tb^T with Tb = T~ diag(beta) as its
16-bit pair in W's slot (DESIGN.md §3); WITH_OUTPUT = False, final states only, for the sequence split's pass 1 (no Q
tiles, no hand-off, the chain's arithmetic unchanged: the full walk's final states bit for bit); SAVE_STATES, each
chunk's S^T and V'^T also stored by TMA from the hand-off, for the backward (plan.keep_states).

BV (plan.hopper_block_v): 128, one program a head, or 64, two programs a head that are neighbours in the grid and
share W, K, Q in L2 (only Q K^T is computed by both). Narrower blocks do not fit wgmma's 64-row M per warp group, and
two programs an SM do not fit shared memory. Packed sequences: the descriptors span all rows; a partial last chunk
reads the next sequence's rows (or TMA's zero fill), so V' rows past the end are zeroed before K^T V' and O rows past
the end are not stored. With no token at all nothing launches (a TMA descriptor's shape must be positive) and the
final state is the initial one (or zeros). Imported only where it runs (plan.gluon_available: a CUDA sm_90 device
with this Gluon API); Gluon does not run in the interpreter."""
from __future__ import annotations

import functools
from typing import Dict, NamedTuple, Optional, Tuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...launch import launch
from ...utils import SeqInfo, num_sms
from ..plan import hopper_block_v

C_WALK, D_WALK = 64, 128  # chunk size and head size (K = V) of this kernel
OUTPUT_WARPS, LOADER_REGS = 4, 24


class WalkConfig(NamedTuple):
    chain_warps: int  # BV / 16: the chain's S^T rows are split 16 a warp
    output_regs: int  # the output partition's setmaxnreg; the chain gets what is left
    stages: int  # ring slots of W, U, K, Q tiles
    final_only_stages: int  # ring slots of W, U, K tiles in the walk without its output (no Q tile, no S^T, V'^T)


# per V-block width BV (the S^T rows a program walks): the chain's warps, the output partition's setmaxnreg (the
# loader's 1 warp is padded to a warp group; the chain gets the rest of the register file: 176 a thread at
# BV = 128, setmaxnreg's maximum 256 at 64) and the ring slots that fit sm_90's 232,448 B of shared memory: a slot
# is W, K, Q [64, 128] and U [64, BV], 2 slots at BV = 128 and 3 at 64; without the output a slot has no Q tile
# and there is no hand-off, so 4 and 5 fit and the loader runs further ahead.
WALK_CONFIGS = {128: WalkConfig(chain_warps=8, output_regs=128, stages=2, final_only_stages=4),
                64: WalkConfig(chain_warps=4, output_regs=128, stages=3, final_only_stages=5)}


def states_shapes(H: int, K: int, V: int, info: SeqInfo, chunk_size: int):
    """The shapes of states_buffers'."""
    NT = info.chunks(chunk_size).num_chunks
    return (NT, H, V, K), (NT, H, V, chunk_size)


def states_buffers(k: torch.Tensor, v: torch.Tensor, info: SeqInfo,
                   chunk_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The per-chunk states a training forward keeps for the backward (the plan's keep_states), as the walk stores
    them from its hand-off and portable/grads.dqkw reads them (states_t), in k's dtype: st [NT, H, V, K], st[c, h] =
    S_c^T, the state entering chunk c (rounded as the walk's operand); vt [NT, H, V, C], vt[c, h, :, i] = V' of the
    chunk's token i, zero past a sequence's end. c: the batch's chunks in info.chunks' global order."""
    return tuple(k.new_empty(shape) for shape in states_shapes(k.shape[2], k.shape[3], v.shape[3], info, chunk_size))


@functools.lru_cache(maxsize=None)
def tile_layout(dtype: torch.dtype, rows: int, cols: int) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a [rows, cols] TMA tile of a 16-bit dtype (cached: building one costs host
    time on every call)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


@gluon.constexpr_function
def accumulator_layout(num_warps, n):
    """A wgmma accumulator's layout, [rows, n] fp32: warps stacked along the rows (16 a warp). In the chains
    (this walk's and hopper/reverse.py's) the two products' accumulators and the register operand made from one
    for the other share this row split, so no data moves between threads."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def register_operand(accumulator):
    """A 16-bit wgmma A operand in registers with an accumulator layout's rows."""
    return gl.DotOperandLayout(operand_index=0, parent=accumulator, k_width=2)


@gluon.jit
def loader_partition(descs, ring, ready, empty, bos, num_chunks, i_h, i_hk, i_v, C: gl.constexpr, D: gl.constexpr,
                     REVERSE: gl.constexpr = False):
    """TMA of chunk t's W, K, Q tiles [C, D] and U's V-block [C, BV] into slot t % STAGES once its consumers
    released it; descs and ring are (W, U, K, Q), or (W, U, K) where no partition reads Q (the walk without its
    output). i_h: the value head (W, U), i_hk: its key head (K, Q). REVERSE, for hopper/reverse.py: the t-th tiles
    loaded are those of chunk num_chunks - 1 - t, the sequence walked backwards, and dO's V-block [C, BV] takes U's
    place."""
    w_desc, u_desc, k_desc = descs[0], descs[1], descs[2]
    w_ring, u_ring, k_ring = ring[0], ring[1], ring[2]
    LOAD_Q: gl.constexpr = len(descs) == 4
    NS: gl.constexpr = w_ring.shape[0]
    BV: gl.constexpr = u_desc.block_type.shape[1]
    for t in range(num_chunks):
        s = t % NS
        mbarrier.wait(empty.index(s), ((t // NS) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
        # the consumers read U from this slot through the generic proxy: order it before TMA's writes
        fence_async_shared()
        bar = ready.index(s)
        mbarrier.expect(bar, (2 + LOAD_Q) * w_desc.block_type.nbytes + u_desc.block_type.nbytes)
        row = bos + ((num_chunks - 1 - t) if REVERSE else t) * C
        tma.async_copy_global_to_shared(w_desc, [row, i_h * D], bar, w_ring.index(s))
        tma.async_copy_global_to_shared(u_desc, [row, i_h * D + i_v * BV], bar, u_ring.index(s))
        tma.async_copy_global_to_shared(k_desc, [row, i_hk * D], bar, k_ring.index(s))
        if LOAD_Q:
            tma.async_copy_global_to_shared(descs[3], [row, i_hk * D], bar, ring[3].index(s))


@gluon.jit
def load_gamma(gam, start, n, i_h, H: gl.constexpr, layout: gl.constexpr, C: gl.constexpr):
    """(γ [C] of a chunk's tokens in `layout` (a 1-D slice of an accumulator layout), 0 past the sequence's end;
    γ_C, its last token's: the decay over the chunk). n: the tokens left in the sequence from start."""
    r = gl.arange(0, C, layout=layout)
    b_gam = gl.load(gam + (start + r).to(gl.int64) * H + i_h, mask=r < n, other=0.0)
    return b_gam, gl.sum(gl.where(r == gl.minimum(n, C) - 1, b_gam, 0.0), axis=0)


@gluon.jit
def chain_partition(ring, ready, empty, handoff, h0, ht, gam, i_nh, i_v, bos, eos, num_chunks, H: gl.constexpr,
                    C: gl.constexpr, D: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr,
                    WITH_OUTPUT: gl.constexpr, RESIDUAL: gl.constexpr, USE_G: gl.constexpr, num_warps: gl.constexpr):
    """The serial chain on the V-block i_v of S^T, [BV, D] fp32 (rows V, columns K), its products with the
    rounded S^T or V'^T (RESIDUAL: also Y^T) as the register operand; WITH_OUTPUT: S^T and V'^T of each chunk go
    to the output partition through handoff (st_bufs, vt_bufs, sv_ready, sv_empty; () without the output). The
    hand-off only copies operands the products have already taken: the chain's arithmetic, so the final state,
    is the same bit for bit either way. RESIDUAL: the ring's W slot holds Tb = T~ diag(beta) as its 16-bit pair
    (hi | lo, [C, 2C]) and its U slot V's block, and V' = Tb (V - K S) (gluon_walk_kernel). USE_G: gated by γ (gam,
    [TT, H] fp32): S <- exp(γ_C) S + K^T (exp(γ_C - γ) ⊙ V'), and in the residual form V' = Tb (V - diag(exp(γ)) K S)
    (W = Tb diag(exp(γ)) K)."""
    w_ring, u_ring, k_ring = ring[0], ring[1], ring[2]
    NS: gl.constexpr = w_ring.shape[0]
    BV: gl.constexpr = u_ring.shape[2]
    dt: gl.constexpr = w_ring.dtype
    s_layout: gl.constexpr = accumulator_layout(num_warps, D)  # S^T's V rows split over the warps
    vn_layout: gl.constexpr = accumulator_layout(num_warps, C)
    sd_operand: gl.constexpr = register_operand(vn_layout)
    vn_operand: gl.constexpr = register_operand(s_layout)

    rv = gl.arange(0, BV, layout=gl.SliceLayout(1, s_layout))
    ck = gl.arange(0, D, layout=gl.SliceLayout(0, s_layout))
    o_st = ck[None, :] * D + (i_v * BV + rv)[:, None]  # S^T's [V, K] view of a state [K, V], rows of block i_v
    if HAS_H0:
        b_st = gl.load(h0 + i_nh.to(gl.int64) * D * D + o_st).to(gl.float32)
    else:
        b_st = gl.zeros([BV, D], gl.float32, layout=s_layout)
    tokens = gl.arange(0, C, layout=gl.SliceLayout(0, vn_layout))
    if WITH_OUTPUT:
        st_bufs, vt_bufs, sv_ready, sv_empty = handoff

    for t in range(num_chunks):
        s = t % NS
        b = t % 2  # the hand-off's buffer (WITH_OUTPUT)
        if USE_G:  # before the wait: the load's latency hides behind it
            b_gam, b_gam_last = load_gamma(gam, bos + t * C, eos - bos - t * C, i_nh % H, H,
                                           gl.SliceLayout(0, vn_layout), C)
        mbarrier.wait(ready.index(s), (t // NS) & 1)
        b_sd = b_st.to(dt)
        # S^T W^T (residual form: S^T K^T)
        b_wst = warpgroup_mma(gl.convert_layout(b_sd, sd_operand), (k_ring if RESIDUAL else w_ring).index(s).permute(
            (1, 0)), gl.zeros([BV, C], gl.float32, layout=vn_layout), use_acc=False, is_async=True)
        if WITH_OUTPUT:
            # while that product runs: hand S^T to the output (once it is done with the buffer two chunks back)
            mbarrier.wait(sv_empty.index(b), ((t // 2) & 1) ^ 1)
            st_bufs.index(b).store(b_sd)
        b_ut = u_ring.index(s).permute((1, 0)).load(vn_layout).to(gl.float32)  # U^T (residual form: V^T)
        b_wst = warpgroup_mma_wait(num_outstanding=0, deps=(b_wst, ))
        if RESIDUAL:
            # V'^T = Y^T Tb^T, Y = V - K S rounded to the input dtype, Tb = Tb_hi + Tb_lo (the two halves of the
            # slot): the same V' as U - W S, since U = Tb V and W = Tb K
            if USE_G:  # (K S)^T's columns, the chunk's tokens, decayed by exp(γ_j) <= 1
                b_wst = b_wst * gl.exp(b_gam)[None, :]
            b_yt = gl.convert_layout((b_ut - b_wst).to(dt), sd_operand)
            tb = w_ring.index(s)
            b_vt = warpgroup_mma(b_yt, tb.slice(0, C, 1).permute((1, 0)), gl.zeros([BV, C], gl.float32,
                                 layout=vn_layout), use_acc=False, is_async=True)
            b_vt = warpgroup_mma(b_yt, tb.slice(C, C, 1).permute((1, 0)), b_vt, is_async=True)
            b_vt = warpgroup_mma_wait(num_outstanding=0, deps=(b_vt, ))
        else:
            b_vt = b_ut - b_wst
        # V' rows past the sequence's end (the next sequence's tokens) must not reach the state
        b_vt = gl.where(tokens[None, :] < eos - bos - t * C, b_vt, 0.0)
        b_vnt = b_vt.to(dt)
        if USE_G:  # the decayed V' rounded as V' is; the output takes V' itself
            b_st = b_st * gl.exp(b_gam_last)
            b_vdt = (b_vnt.to(gl.float32) * gl.exp(b_gam_last - b_gam)[None, :]).to(dt)
        else:
            b_vdt = b_vnt
        b_st = warpgroup_mma(gl.convert_layout(b_vdt, vn_operand), k_ring.index(s), b_st, is_async=True)
        if WITH_OUTPUT:
            vt_bufs.index(b).store(b_vnt)
            fence_async_shared()  # the output reads both buffers through wgmma (the async proxy)
            mbarrier.arrive(sv_ready.index(b), count=1)
        b_st = warpgroup_mma_wait(num_outstanding=0, deps=(b_st, ))
        mbarrier.arrive(empty.index(s), count=1)

    if STORE_HT:
        gl.store(ht + i_nh.to(gl.int64) * D * D + o_st, b_st)


@gluon.jit
def output_partition(ring, ready, empty, handoff, states, o, gam, scale, bos, eos, num_chunks, first_chunk, i_h, i_v,
                     H: gl.constexpr, C: gl.constexpr, D: gl.constexpr, SAVE_STATES: gl.constexpr,
                     USE_G: gl.constexpr):
    """O's columns of V-block i_v, scale (Q S + (Q K^T ⊙ M) V') [C, BV] of each chunk, from the ring's Q, K
    and the chain's S^T, V'^T (Q K^T is the same for every V-block: each program of a head computes it).
    SAVE_STATES: the hand-off's S^T and V'^T of each chunk also go to HBM, TMA stores straight from the
    hand-off buffers into states = (S^T [NT, H, 128, 128], V'^T [NT, H, 128, C]) at the chunk's global number
    first_chunk + t, for the backward (chunk_delta_rule's save_states); the stores run beside this chunk's
    products and are waited for before the buffers go back to the chain. USE_G: O = scale (exp(γ) ⊙ Q S +
    (Q K^T ⊙ E ⊙ M) V'), E_ij = exp(γ_i - γ_j)."""
    w_ring, u_ring, k_ring, q_ring = ring
    st_bufs, vt_bufs, sv_ready, sv_empty = handoff
    NS: gl.constexpr = w_ring.shape[0]
    BV: gl.constexpr = u_ring.shape[2]
    dt: gl.constexpr = w_ring.dtype
    WARPS: gl.constexpr = gl.num_warps()
    o_layout: gl.constexpr = accumulator_layout(WARPS, BV)
    p_layout: gl.constexpr = accumulator_layout(WARPS, C)
    p_operand: gl.constexpr = register_operand(o_layout)
    pi = gl.arange(0, C, layout=gl.SliceLayout(1, p_layout))
    pj = gl.arange(0, C, layout=gl.SliceLayout(0, p_layout))
    ri = gl.arange(0, C, layout=gl.SliceLayout(1, o_layout))
    cv = gl.arange(0, BV, layout=gl.SliceLayout(0, o_layout))

    for t in range(num_chunks):
        s = t % NS
        b = t % 2
        if USE_G:
            n = eos - bos - t * C
            b_gam_i, _ = load_gamma(gam, bos + t * C, n, i_h, H, gl.SliceLayout(1, p_layout), C)
            b_gam_j, _ = load_gamma(gam, bos + t * C, n, i_h, H, gl.SliceLayout(0, p_layout), C)
            b_gam_o, _ = load_gamma(gam, bos + t * C, n, i_h, H, gl.SliceLayout(1, o_layout), C)
        mbarrier.wait(ready.index(s), (t // NS) & 1)
        q_s = q_ring.index(s)
        # Q K^T does not depend on the chain: before waiting for it
        b_p = warpgroup_mma(q_s, k_ring.index(s).permute((1, 0)), gl.zeros([C, C], gl.float32, layout=p_layout),
                            use_acc=False, is_async=True)
        b_p = warpgroup_mma_wait(num_outstanding=0, deps=(b_p, ))
        if USE_G:  # the exponent clamped above the diagonal, which the mask removes: never positive
            b_p = b_p * gl.exp(gl.minimum(b_gam_i[:, None] - b_gam_j[None, :], 0.0))
        b_p = gl.convert_layout(gl.where(pi[:, None] >= pj[None, :], b_p, 0.0).to(dt), p_operand)
        mbarrier.wait(sv_ready.index(b), (t // 2) & 1)
        if SAVE_STATES:
            # rows of S^T (V'^T) block i_v of this chunk and head; the chain fenced its stores before sv_ready
            row = ((first_chunk + t) * H + i_h) * D + i_v * BV
            tma.async_copy_shared_to_global(states[0], [row, 0], st_bufs.index(b))
            tma.async_copy_shared_to_global(states[1], [row, 0], vt_bufs.index(b))
        b_o = warpgroup_mma(q_s, st_bufs.index(b).permute((1, 0)), gl.zeros([C, BV], gl.float32, layout=o_layout),
                            use_acc=False, is_async=True)
        if USE_G:  # exp(γ_i) on Q S's rows before the intra-chunk term joins the accumulator
            b_o = warpgroup_mma_wait(num_outstanding=0, deps=(b_o, ))
            b_o = b_o * gl.exp(b_gam_o)[:, None]
        b_o = warpgroup_mma(b_p, vt_bufs.index(b).permute((1, 0)), b_o, is_async=True)
        b_o = warpgroup_mma_wait(num_outstanding=0, deps=(b_o, ))
        if SAVE_STATES:
            tma.store_wait(0)  # the stores have read both buffers before the chain may refill them
        mbarrier.arrive(sv_empty.index(b), count=1)
        mbarrier.arrive(empty.index(s), count=1)
        start = bos + t * C
        o_o = (start + ri[:, None]).to(gl.int64) * (H * D) + i_h * D + i_v * BV + cv[None, :]
        gl.store(o + o_o, (b_o * scale).to(dt), mask=ri[:, None] < eos - start)


@gluon.jit
def gluon_walk_kernel(w_desc, u_desc, k_desc, q_desc, st_desc, vt_desc, o, h0, ht, gam, scale, cu_seqlens,
                      chunk_offsets, H: gl.constexpr, HK: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr,
                      WITH_OUTPUT: gl.constexpr, SAVE_STATES: gl.constexpr, RESIDUAL: gl.constexpr,
                      USE_G: gl.constexpr, LOADER_REGS: gl.constexpr,
                      OUTPUT_WARPS: gl.constexpr, OUTPUT_REGS: gl.constexpr, STAGES: gl.constexpr,
                      num_warps: gl.constexpr):
    """WITH_OUTPUT: the forward's walk (o written); else the final states only (STORE_HT): no output partition,
    no Q tiles (q_desc, o and scale unused), no S^T / V'^T hand-off, the ring's empties released by the chain
    alone; the chain's arithmetic as with the output, so the same final states bit for bit. SAVE_STATES (with the
    output only): each chunk's S^T and V'^T also stored through st_desc and vt_desc (output_partition); else
    st_desc, vt_desc and chunk_offsets are unused.

    RESIDUAL (the residual form): w_desc is Tb's (T~ diag(beta) as its 16-bit pair, wy.tinv_pair_fwd: [.., H, 2C],
    whose [C, 2C] box has W's shape) and u_desc V's, and the chain forms V' = Tb (V - K S) with one more dependent
    product (a pair: two wgmma of [BV, C] x [C, C]), so the WY stage writes Tb alone instead of W and U. The
    loader and the output partition are the same code: only what the ring's W and U slots hold changes.

    H value heads (W, U, O, states), HK key heads (Q, K); USE_G: gated by γ (gam [TT, H] fp32), in the residual form
    V' = Tb (V - diag(exp(γ)) K S); not with SAVE_STATES (the kept states' backward is the ungated rule's)."""
    C: gl.constexpr = w_desc.block_type.shape[0]
    D: gl.constexpr = w_desc.block_type.shape[1]
    BV: gl.constexpr = u_desc.block_type.shape[1]  # the V-block of S^T this program walks
    NV: gl.constexpr = D // BV
    gl.static_assert(NV * BV == D and num_warps * 16 == BV, "the chain's warps hold 16 rows of S^T each")
    gl.static_assert(WITH_OUTPUT or STORE_HT, "a walk without its output stores the final states")
    gl.static_assert(WITH_OUTPUT or not SAVE_STATES, "the states are saved from the output's hand-off")
    gl.static_assert(not RESIDUAL or 2 * C == D, "the residual form's Tb pair [C, 2C] takes W's slot [C, D]")
    gl.static_assert(not USE_G or not SAVE_STATES, "the gate takes no kept states")
    NS: gl.constexpr = STAGES
    dt: gl.constexpr = w_desc.dtype
    # the V-blocks of a head are neighbouring programs: they run at the same time and share W, K, Q in L2
    pid = gl.program_id(0)
    i_nh, i_v = pid // NV, pid % NV
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    bos = gl.load(cu_seqlens + i_n)
    eos = gl.load(cu_seqlens + i_n + 1)
    num_chunks = gl.cdiv(eos - bos, C)

    tile: gl.constexpr = w_desc.layout
    ring = (gl.allocate_shared_memory(dt, [NS, C, D], tile), gl.allocate_shared_memory(dt, [NS, C, BV], u_desc.layout),
            gl.allocate_shared_memory(dt, [NS, C, D], tile))
    descs = (w_desc, u_desc, k_desc)
    if WITH_OUTPUT:
        ring = ring + (gl.allocate_shared_memory(dt, [NS, C, D], tile), )
        descs = descs + (q_desc, )
        st_bufs = gl.allocate_shared_memory(dt, [2, BV, D], gl.NVMMASharedLayout.get_default_for([BV, D], dt))
        vt_bufs = gl.allocate_shared_memory(dt, [2, BV, C], gl.NVMMASharedLayout.get_default_for([BV, C], dt))
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    CONSUMERS: gl.constexpr = 2 if WITH_OUTPUT else 1  # of each ring slot: the chain (and the output)
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)

    if WITH_OUTPUT:
        sv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        sv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(sv_ready.index(i), count=1)
            mbarrier.init(sv_empty.index(i), count=1)
        handoff = (st_bufs, vt_bufs, sv_ready, sv_empty)
        first_chunk = gl.load(chunk_offsets + i_n) if SAVE_STATES else 0
        gl.warp_specialize([
            (chain_partition, (ring, ready, empty, handoff, h0, ht, gam, i_nh, i_v, bos, eos, num_chunks, H, C, D,
                               HAS_H0, STORE_HT, WITH_OUTPUT, RESIDUAL, USE_G, num_warps)),
            (output_partition, (ring, ready, empty, handoff, (st_desc, vt_desc), o, gam, scale, bos, eos, num_chunks,
                                first_chunk, i_h, i_v, H, C, D, SAVE_STATES, USE_G)),
            (loader_partition, (descs, ring, ready, empty, bos, num_chunks, i_h, i_hk, i_v, C, D)),
        ], [OUTPUT_WARPS, 1], [OUTPUT_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (chain_partition, (ring, ready, empty, (), h0, ht, gam, i_nh, i_v, bos, eos, num_chunks, H, C, D, HAS_H0,
                               STORE_HT, WITH_OUTPUT, RESIDUAL, USE_G, num_warps)),
            (loader_partition, (descs, ring, ready, empty, bos, num_chunks, i_h, i_hk, i_v, C, D)),
        ], [1], [LOADER_REGS])


def check_inputs(kernel: str, tensors: Dict[str, torch.Tensor], info: SeqInfo) -> None:
    """The checks of both Gluon kernels' wrappers (this walk's and hopper/reverse.py's) before TMA descriptors are
    built on their inputs: one 16-bit dtype, heads of K = V = 128, the batch's tokens as contiguous rows (the
    descriptors and the kernels' offsets address row r of head h at r * heads * 128 + h * 128), 16-byte aligned
    bases. tensors: the inputs by name, q and k with the key heads, the others with the value heads (a multiple)."""
    names, xs, k = ", ".join(tensors), list(tensors.values()), tensors["k"]
    HK, D = k.shape[2], k.shape[3]
    H = next(x.shape[2] for n, x in tensors.items() if n not in ("q", "k"))
    if any(x.dtype != k.dtype for x in xs) or k.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{kernel}: {names} must share one 16-bit dtype, got "
                         + ", ".join(str(x.dtype) for x in xs))
    heads = {n: HK if n in ("q", "k") else H for n in tensors}
    if D != D_WALK or H % HK or any(tuple(x.shape[2:]) != (heads[n], D_WALK) for n, x in tensors.items()):
        raise ValueError(f"{kernel}: 16-bit K = V = {D_WALK} only, q and k with key heads dividing the others' value "
                         "heads, got " + ", ".join(f"{n} {tuple(x.shape)}" for n, x in tensors.items()))
    TT = info.total_tokens
    if any(x.numel() != TT * heads[n] * D or not x.is_contiguous() for n, x in tensors.items()):
        raise ValueError(f"{kernel}: {names} must hold {TT} tokens of their heads, contiguous")
    if any(x.data_ptr() % 16 for x in xs):
        raise ValueError(f"{kernel}: {names} must start 16-byte aligned (TMA)")


@functools.lru_cache(maxsize=256)
def descriptor_template(dtype: torch.dtype, rows: int, cols: int, block_rows: int, block_cols: int) -> TensorDescriptor:
    """A TMA descriptor of a contiguous [rows, cols] view of dtype with block [block_rows, block_cols], built (so
    checked by TensorDescriptor) once per shape, with no base (base None: the cache holds no tensor)."""
    d = TensorDescriptor(torch.empty(0, dtype=dtype), [rows, cols], [cols, 1], [block_rows, block_cols],
                         tile_layout(dtype, block_rows, block_cols))
    d.base = None
    return d


def tma_descriptor(x: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> TensorDescriptor:
    """TensorDescriptor(x, [rows, cols], [cols, 1], [block_rows, block_cols], tile_layout(..)) for a contiguous x of
    rows * cols elements: descriptor_template's fields with x as the base. TensorDescriptor's constructor checks its
    arguments in Python (about 2.5 µs a descriptor); all but the base's alignment depend on the shape only, checked
    once by the template; the alignment is checked here."""
    if x.data_ptr() % 16:
        raise ValueError(f"gluon_walk: a TMA descriptor's base must be 16-byte aligned, got {x.data_ptr():#x}")
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(descriptor_template(x.dtype, rows, cols, block_rows, block_cols).__dict__)
    d.base = x
    return d


def tma_descriptors(tensors, TT: int) -> list:
    """The TMA descriptors of contiguous [.., heads, 128] tensors viewed as [TT, heads * 128] (all B * T rows,
    whatever B is), each with its block [C_WALK, width] of (tensor, width) pairs: the shape and strides of that view
    given directly (the descriptor uses only its base's address and dtype), no reshape."""
    return [tma_descriptor(x, TT, x.shape[2] * D_WALK, C_WALK, width) for x, width in tensors]


def pass_state_through(out: Optional[torch.Tensor], state: Optional[torch.Tensor]) -> None:
    """Where nothing launches (no token at all: a TMA descriptor's shape must be positive), the state a walk
    would store is the one it starts from, or zeros."""
    if out is not None and state is not None:
        out.copy_(state)
    elif out is not None:
        out.zero_()


def gluon_walk_launch(q: Optional[torch.Tensor], k: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
                      o: Optional[torch.Tensor], scale: float, initial_state: Optional[torch.Tensor],
                      final_state: Optional[torch.Tensor], info: SeqInfo, block_v: int = D_WALK,
                      checked: bool = False, states: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                      residual: bool = False, gam: Optional[torch.Tensor] = None):
    """Launches the kernel on q, k, w, u [B, T, H, 128] (packed [1, TT, H, 128] with cu_seqlens; contiguous rows: the
    descriptors and o's offsets address row r of head h at r * H * 128 + h * 128) into o (contiguous, u's shape),
    128 / block_v programs a sequence and head (WALK_CONFIGS' V-block widths). o None: the walk without its output,
    into final_state only (q and scale unused, q may be None). With no tokens at all nothing is launched and
    final_state gets the initial state (or zeros), as the kernel's programs without chunks store it. checked: the
    caller (the chunk forward, on the plan's Hopper walk) has made check_inputs' checks and built states with
    states_buffers, so they are not made again. states: (st, vt) from states_buffers, into which the walk with its
    output also stores each chunk's S^T and V'^T. residual: the residual form (gluon_walk_kernel's RESIDUAL), w being
    Tb [.., H, 2 * 64] from wy.tinv_pair_fwd and u being V. q, k may have fewer heads than w, u (grouped value
    heads). gam: the gated rule's γ [.., TT, H] fp32 (gate.chunk_gamma), without states."""
    with_output = o is not None
    if not checked:
        check_inputs("gluon_walk", dict(q=q, k=k, w=w, u=u) if with_output else dict(k=k, w=w, u=u), info)
    if block_v not in WALK_CONFIGS:
        raise ValueError(f"gluon_walk: block_v (the V-block a program walks) must be one of "
                         f"{sorted(WALK_CONFIGS)}, got {block_v}")
    if with_output and (not o.is_contiguous() or o.shape != u.shape):
        raise ValueError(f"gluon_walk: o must be contiguous in u's shape {tuple(u.shape)}, got {tuple(o.shape)}")
    if not with_output and final_state is None:
        raise ValueError("gluon_walk: a walk without its output (o None) must store the final states")
    if gam is not None and states is not None:
        raise ValueError("gluon_walk: the gate (gam) takes no kept states")
    TT, N, H, HK, D = info.total_tokens, info.num_seqs, u.shape[2], k.shape[2], k.shape[3]
    if gam is not None and (gam.dtype != torch.float32 or gam.numel() != TT * H or not gam.is_contiguous()):
        raise ValueError(f"gluon_walk: gam must be contiguous fp32 [.., {TT}, {H}], got {tuple(gam.shape)} {gam.dtype}")
    if states is not None and not checked:
        expected = states_shapes(H, D, D, info, C_WALK)
        if not with_output or any(tuple(x.shape) != e or x.dtype != k.dtype or not x.is_contiguous()
                                  for x, e in zip(states, expected)):
            raise ValueError(f"gluon_walk: states must be the walk with its output's contiguous {k.dtype} buffers "
                             f"{expected}, got " + ", ".join(f"{tuple(x.shape)} {x.dtype}" for x in states))
    if initial_state is not None and (tuple(initial_state.shape) != (N, H, D, D) or not initial_state.is_contiguous()):
        raise ValueError(f"gluon_walk: initial_state must be contiguous [{N}, {H}, {D}, {D}], got "
                         f"{tuple(initial_state.shape)}")
    if TT == 0 or N * H == 0:
        pass_state_through(final_state, initial_state)
        return
    # [TT, H * 128] per tensor (all B * T rows, whatever B is), tile [C, 128] at (row, head * 128), U's
    # [C, block_v] at (row, head * 128 + V-block * block_v); rows past TT are TMA's zero fill. No Q tile
    # without the output
    tiles = ((w, D), (u, block_v), (k, D)) + (((q, D), ) if with_output else ())
    w_desc, u_desc, k_desc, *q_desc = tma_descriptors(tiles, TT)
    st_desc = vt_desc = chunk_offsets = None
    if states is not None:  # rows of block_v S^T (V'^T) rows, as the hand-off buffers hold them
        st, vt = states
        st_desc, vt_desc = (tma_descriptor(x, x.shape[0] * H * D, x.shape[3], block_v, x.shape[3]) for x in (st, vt))
        chunk_offsets = info.chunks(C_WALK).chunk_offsets
    cfg = WALK_CONFIGS[block_v]
    grid = (N * H * (D // block_v), )
    launch(gluon_walk_kernel, grid, w_desc, u_desc, k_desc, q_desc[0] if with_output else None, st_desc, vt_desc, o,
           initial_state, final_state, gam, scale, info.cu_seqlens, chunk_offsets, H, HK, initial_state is not None,
           final_state is not None, with_output, states is not None, residual, gam is not None, LOADER_REGS,
           OUTPUT_WARPS,
           cfg.output_regs, cfg.stages if with_output else cfg.final_only_stages, num_warps=cfg.chain_warps)


def gluon_state_output_fwd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, scale: float,
                           initial_state: Optional[torch.Tensor], output_final_state: bool, info: SeqInfo,
                           chunk_size: int = C_WALK, block_v: Optional[int] = None, checked: bool = False,
                           states: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, residual: bool = False,
                           gam: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """portable walk.state_output_fwd's contract ((o, final_state or None)) on the Gluon walk: 16-bit, K = V = 128,
    C = 64, q, k [B, T, HK, 128], w, u [B, T, H, 128] or packed [1, TT, .., 128]; block_v (the V-block a program
    walks) as plan.hopper_block_v chooses unless given; checked, states, residual (w = Tb, u = V) and gam (the gated
    rule's γ) as gluon_walk_launch's."""
    # contiguous: u is (checked by the caller, or by gluon_walk_launch before o is used)
    o = torch.empty_like(u)
    final_state = run_walk(q, k, w, u, o, scale, initial_state, output_final_state, info, chunk_size, block_v, checked,
                           states, residual, gam)
    return o, final_state


def gluon_state_final_fwd(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, initial_state: Optional[torch.Tensor],
                          info: SeqInfo, chunk_size: int = C_WALK, block_v: Optional[int] = None,
                          checked: bool = False, residual: bool = False) -> torch.Tensor:
    """The final states [N, H, 128, 128] fp32 of gluon_state_output_fwd's walk, bit for bit, without its output (no Q
    read, no O written): the sequence split's pass 1. Arguments as there."""
    return run_walk(None, k, w, u, None, 1.0, initial_state, True, info, chunk_size, block_v, checked,
                    residual=residual)


def run_walk(q, k, w, u, o, scale, initial_state, output_final_state, info, chunk_size, block_v, checked, states=None,
             residual=False, gam=None):
    """Both wrappers' launch: the final state allocated (if asked for), the initial state as fp32, plan.hopper_block_v's
    V-block unless one is given."""
    if chunk_size != C_WALK:
        raise ValueError(f"gluon_walk: chunk_size {C_WALK} only, got {chunk_size}")
    N, H = info.num_seqs, u.shape[2]
    final_state = k.new_empty(N, H, D_WALK, D_WALK, dtype=torch.float32) if output_final_state else None
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    block_v = hopper_block_v(N * H, num_sms(u.device)) if block_v is None else block_v
    gluon_walk_launch(q, k, w, u, o, scale, h0, final_state, info, block_v, checked=checked, states=states,
                      residual=residual, gam=gam)
    return final_state
