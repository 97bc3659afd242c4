"""The backward's reverse pass as a warp-specialized Gluon kernel for sm_90 (triton 3.6; 16-bit, K = V = 128, C = 64):
the contract of portable/reverse.py's state_bwd with dV'_local fused, run where the plan chooses the Hopper reverse
pass (DESIGN.md §5, §6).

One program per (sequence, head, V-block of BV rows of dS^T) walks its chunks backwards from dS = dht (or 0); three
partitions run side by side:
    loader (1 warp): walk.loader_partition with REVERSE: each chunk's W, K, Q tiles and dO's V-block, last chunk first;
    off-chain (1 warp group): A^T = K Q^T (kept for j <= i < n, scaled, rounded as grads.causal_scores_t), dV'_local
        = A^T dO and scale dO^T Q, handed to the chain in fp32 through shared tiles (hand_ready / hand_empty);
    chain (BV / 16 warps, dS^T [BV, K] fp32 in registers): dV'^T = dV'_local^T + dS_next^T K^T, dS^T += scale dO^T Q,
        dS^T -= dV'^T W, storing dh (dS_next, rounded) and dv (dV', rounded) per chunk and dh0 (fp32) at the end.
Holding dS^T rather than dS makes both chain products take their chain operand from registers as wgmma's A operand,
in the walk's accumulator layouts, so no data moves between threads and the serial chain runs only its two products.

Gated (USE_G, DESIGN.md §11) and grouped value heads as the walk takes them: the off-chain partition scales K Q^T by
E^T and dO^T's columns by exp(γ) (scale (exp(γ) ⊙ dO)^T Q, where the portable pass rounds exp(γ) ⊙ Q), and the
chain forms dS_next^T K^T apart, scales its columns by exp(γ_C - γ) before the fp32 local part joins, and decays
dS by exp(γ_C); the loader reads the value head's key head's Q, K tiles.

Rounding points are the portable pass's (DESIGN.md §4); the two differ by the order of fp32 sums. Packed sequences:
a partial chunk reads the next sequence's rows (or TMA's zero fill), so A^T's and dO^T's columns i >= n are zeroed
off the chain and dV'^T's columns j >= n before W^T dV'; dv rows from n on are not stored. With no token at all
nothing launches: dh is empty, dh0 is dht (or zeros).

The ring and the fp32 hand-off fill sm_90's shared memory, so the hand-off is single-buffered: the off-chain
partition computes chunk i's A^T and dV'_local while the chain is on chunk i - 1, then waits for the chain to have
read the previous tiles (early in its step) before storing; both sides access the hand-off through the generic proxy,
so it needs no fence (the ring is ordered by ready / empty and the loader's fence). BV (plan.hopper_block_v): 128,
one program a head, or 64, two neighbouring programs a head sharing W, K, Q in L2 (only A^T is computed by both), as
in the walk. Imported only where it runs (plan.gluon_available); Gluon does not run in the interpreter."""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from ...launch import launch
from ...utils import SeqInfo, num_sms
from ..plan import hopper_block_v
# D_WALK: this kernel's head size as well (re-exported from here)
from .walk import (C_WALK, D_WALK, LOADER_REGS, accumulator_layout, check_inputs, load_gamma,  # noqa: F401
                   loader_partition, pass_state_through, register_operand, tma_descriptors)

OFFCHAIN_WARPS = 4


class ReverseConfig(NamedTuple):
    chain_warps: int  # BV / 16: the chain's dS^T rows are split 16 a warp
    offchain_regs: int  # the off-chain partition's setmaxnreg; the chain gets what is left
    stages: int  # ring slots of W, dO, K, Q tiles


# per V-block width BV (the dS^T rows a program walks), as walk.WALK_CONFIGS: the chain's warps, the off-chain
# partition's setmaxnreg (the chain gets the rest: 176 a thread at BV = 128, setmaxnreg's maximum 256 at 64) and the
# ring slots that fit beside the fp32 hand-off (96 KiB at BV = 128, 48 KiB at 64): 2 and 3.
REVERSE_CONFIGS = {128: ReverseConfig(chain_warps=8, offchain_regs=128, stages=2),
                   64: ReverseConfig(chain_warps=4, offchain_regs=128, stages=3)}


@gluon.jit
def chain_partition(ring, ready, empty, dvl_buf, qdo_buf, hand_ready, hand_empty, dh, dv, dht, dh0, gam, i_nh, i_h,
                    i_v, bos, eos, first_chunk, num_chunks, H: gl.constexpr, C: gl.constexpr, D: gl.constexpr,
                    USE_DHT: gl.constexpr, STORE_DH0: gl.constexpr, USE_G: gl.constexpr, num_warps: gl.constexpr):
    """The serial chain on the V-block i_v of dS^T, [BV, D] fp32 (rows V, columns K), backwards over the chunks,
    both products with the rounded dS_next^T or dV'^T as the register operand; stores dh (dS_next) and dv (dV')
    of each chunk, the V-block's columns. USE_G: dV'^T = dV'_local^T + (dS_next^T K^T) ⊙ exp(γ_C - γ) by columns,
    dS = exp(γ_C) dS_next + (the off-chain's scale (exp(γ) ⊙ Q)^T dO) - W^T dV'."""
    w_ring, do_ring, k_ring, q_ring = ring
    NS: gl.constexpr = w_ring.shape[0]
    BV: gl.constexpr = do_ring.shape[2]
    dt: gl.constexpr = w_ring.dtype
    # warps stacked along the V rows, as the walk's chain
    s_layout: gl.constexpr = accumulator_layout(num_warps, D)
    vn_layout: gl.constexpr = accumulator_layout(num_warps, C)
    sd_operand: gl.constexpr = register_operand(vn_layout)
    vn_operand: gl.constexpr = register_operand(s_layout)

    rv = gl.arange(0, BV, layout=gl.SliceLayout(1, s_layout))
    ck = gl.arange(0, D, layout=gl.SliceLayout(0, s_layout))
    o_st = ck[None, :] * D + (i_v * BV + rv)[:, None]  # dS^T's [V, K] view of a state [K, V], rows of block i_v
    if USE_DHT:
        b_dst = gl.load(dht + i_nh.to(gl.int64) * D * D + o_st).to(gl.float32)
    else:
        b_dst = gl.zeros([BV, D], gl.float32, layout=s_layout)
    vv = gl.arange(0, BV, layout=gl.SliceLayout(1, vn_layout))
    tokens = gl.arange(0, C, layout=gl.SliceLayout(0, vn_layout))

    for i in range(num_chunks):
        t = num_chunks - 1 - i
        s = i % NS
        n = eos - bos - t * C
        if USE_G:  # before the waits: the load's latency hides behind them
            b_gam, b_gam_last = load_gamma(gam, bos + t * C, n, i_h, H, gl.SliceLayout(0, vn_layout), C)
        mbarrier.wait(ready.index(s), (i // NS) & 1)
        mbarrier.wait(hand_ready, i & 1)
        b_dsd = b_dst.to(dt)  # dS_next, rounded: the operand of K dS_next and the stored dh
        if USE_G:
            # dS_next^T K^T alone: its columns take exp(γ_C - γ_j) before the local part (fp32) joins
            b_dvt = warpgroup_mma(gl.convert_layout(b_dsd, sd_operand), k_ring.index(s).permute((1, 0)),
                                  gl.zeros([BV, C], gl.float32, layout=vn_layout), use_acc=False, is_async=True)
            b_dst = b_dst * gl.exp(b_gam_last) + qdo_buf.load(s_layout)
            b_dvt = warpgroup_mma_wait(num_outstanding=0, deps=(b_dvt, ))
            b_dvt = b_dvt * gl.exp(b_gam_last - b_gam)[None, :] + dvl_buf.permute((1, 0)).load(vn_layout)
            mbarrier.arrive(hand_empty, count=1)
        else:
            # dV'^T = dV'_local^T + dS_next^T K^T, the local part (fp32) as the accumulator's start
            b_dvt = warpgroup_mma(gl.convert_layout(b_dsd, sd_operand), k_ring.index(s).permute((1, 0)),
                                  dvl_buf.permute((1, 0)).load(vn_layout), is_async=True)
            # while it runs: the off-chain term scale Q^T dO joins dS
            b_dst = b_dst + qdo_buf.load(s_layout)
            mbarrier.arrive(hand_empty, count=1)
            b_dvt = warpgroup_mma_wait(num_outstanding=0, deps=(b_dvt, ))
        # dV' rows past the sequence's end (K rows of the next sequence) must not reach dS
        b_dvd = gl.where(tokens[None, :] < n, b_dvt, 0.0).to(dt)
        # dS^T -= dV'^T W: the negation of the rounded dV' is exact
        b_dst = warpgroup_mma(gl.convert_layout(-b_dvd, vn_operand), w_ring.index(s), b_dst, is_async=True)
        # while that runs: the stores (here rather than beside the first product, where they spill)
        o_dv = (bos + t * C + tokens[None, :]).to(gl.int64) * (H * D) + i_h * D + i_v * BV + vv[:, None]
        gl.store(dv + o_dv, b_dvd, mask=tokens[None, :] < n)
        o_dh = ((first_chunk + t) * H + i_h).to(gl.int64) * D * D
        gl.store(dh + o_dh + o_st, b_dsd)
        b_dst = warpgroup_mma_wait(num_outstanding=0, deps=(b_dst, ))
        mbarrier.arrive(empty.index(s), count=1)

    if STORE_DH0:
        gl.store(dh0 + i_nh.to(gl.int64) * D * D + o_st, b_dst)


@gluon.jit
def offchain_partition(ring, ready, empty, dvl_buf, qdo_buf, hand_ready, hand_empty, gam, scale, bos, eos,
                       num_chunks, i_h, H: gl.constexpr, C: gl.constexpr, D: gl.constexpr, USE_G: gl.constexpr):
    """Per chunk, from the ring's Q, K and dO's V-block [C, BV]: dV'_local = scale (K Q^T ⊙ M^T) dO [C, BV] and
    scale dO^T Q [BV, K] (fp32), handed to the chain through dvl_buf and qdo_buf (K Q^T is the same for every
    V-block: each program of a head computes it). USE_G: K Q^T times E^T (E_ij = exp(γ_i - γ_j), row j, column
    i) and dO^T's columns i times exp(γ_i), rounded as the operand: scale (exp(γ) ⊙ dO)^T Q."""
    w_ring, do_ring, k_ring, q_ring = ring
    NS: gl.constexpr = w_ring.shape[0]
    BV: gl.constexpr = do_ring.shape[2]
    dt: gl.constexpr = w_ring.dtype
    WARPS: gl.constexpr = gl.num_warps()
    # rows of scale dO^T Q a product: [G, D] fp32 is 64 registers a thread of the warp group (a [128, 128]
    # accumulator would not fit its 128), so BV / G products a chunk: 2 at BV = 128, 1 at 64
    G: gl.constexpr = 16 * WARPS
    p_layout: gl.constexpr = accumulator_layout(WARPS, C)
    l_layout: gl.constexpr = accumulator_layout(WARPS, BV)
    g_layout: gl.constexpr = accumulator_layout(WARPS, D)
    at_operand: gl.constexpr = register_operand(l_layout)
    dot_operand: gl.constexpr = register_operand(g_layout)
    pj = gl.arange(0, C, layout=gl.SliceLayout(1, p_layout))
    pi = gl.arange(0, C, layout=gl.SliceLayout(0, p_layout))

    for i in range(num_chunks):
        t = num_chunks - 1 - i
        s = i % NS
        n = eos - bos - t * C
        if USE_G:
            b_gam_j, _ = load_gamma(gam, bos + t * C, n, i_h, H, gl.SliceLayout(1, p_layout), C)
            b_gam_i, _ = load_gamma(gam, bos + t * C, n, i_h, H, gl.SliceLayout(0, p_layout), C)
        mbarrier.wait(ready.index(s), (i // NS) & 1)
        q_s, do_s = q_ring.index(s), do_ring.index(s)
        # A^T = K Q^T, kept for j <= i < n (row j, column i; the next sequence's tokens i >= n are left out,
        # their dO rows with them), scaled and rounded as grads.causal_scores_t
        b_at = warpgroup_mma(k_ring.index(s), q_s.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=p_layout),
                             use_acc=False, is_async=True)
        b_at = warpgroup_mma_wait(num_outstanding=0, deps=(b_at, ))
        if USE_G:  # the exponent clamped below the diagonal (row j > column i), which the mask removes
            b_at = b_at * gl.exp(gl.minimum(b_gam_i[None, :] - b_gam_j[:, None], 0.0))
        b_at = gl.where((pj[:, None] <= pi[None, :]) & (pi[None, :] < n), b_at * scale, 0.0).to(dt)
        b_dvl = warpgroup_mma(gl.convert_layout(b_at, at_operand), do_s,
                              gl.zeros([C, BV], gl.float32, layout=l_layout), use_acc=False, is_async=True)
        b_dvl = warpgroup_mma_wait(num_outstanding=0, deps=(b_dvl, ))
        mbarrier.wait(hand_empty, (i & 1) ^ 1)  # the chain has read the previous chunk's tiles
        dvl_buf.store(b_dvl)
        # scale dO^T Q, G rows of V at a time; dO^T's columns i >= n zeroed, the register operand
        for h in gl.static_range(BV // G):
            b_dot = do_s.slice(h * G, G, dim=1).permute((1, 0)).load(p_layout)
            if USE_G:
                b_dot = (b_dot.to(gl.float32) * gl.exp(b_gam_i)[None, :]).to(dt)
            b_dot = gl.convert_layout(gl.where(pi[None, :] < n, b_dot, gl.zeros_like(b_dot)), dot_operand)
            b_g = warpgroup_mma(b_dot, q_s, gl.zeros([G, D], gl.float32, layout=g_layout), use_acc=False,
                                is_async=True)
            b_g = warpgroup_mma_wait(num_outstanding=0, deps=(b_g, ))
            qdo_buf.slice(h * G, G, dim=0).store(b_g * scale)
        mbarrier.arrive(empty.index(s), count=1)
        mbarrier.arrive(hand_ready, count=1)


@gluon.jit
def gluon_reverse_kernel(w_desc, do_desc, k_desc, q_desc, dh, dv, dht, dh0, gam, scale, cu_seqlens, chunk_offsets,
                         H: gl.constexpr, HK: gl.constexpr, USE_DHT: gl.constexpr, STORE_DH0: gl.constexpr,
                         USE_G: gl.constexpr, LOADER_REGS: gl.constexpr,
                         OFFCHAIN_WARPS: gl.constexpr, OFFCHAIN_REGS: gl.constexpr, STAGES: gl.constexpr,
                         num_warps: gl.constexpr):
    C: gl.constexpr = w_desc.block_type.shape[0]
    D: gl.constexpr = w_desc.block_type.shape[1]
    BV: gl.constexpr = do_desc.block_type.shape[1]  # the V-block of dS^T this program walks
    NV: gl.constexpr = D // BV
    gl.static_assert(NV * BV == D and num_warps * 16 == BV, "the chain's warps hold 16 rows of dS^T each")
    NS: gl.constexpr = STAGES
    dt: gl.constexpr = w_desc.dtype
    # the V-blocks of a head are neighbouring programs: they run at the same time and share W, K, Q in L2
    pid = gl.program_id(0)
    i_nh, i_v = pid // NV, pid % NV
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)  # the key head whose Q, K tiles the value head reads
    bos = gl.load(cu_seqlens + i_n)
    eos = gl.load(cu_seqlens + i_n + 1)
    first_chunk = gl.load(chunk_offsets + i_n)
    num_chunks = gl.cdiv(eos - bos, C)

    tile: gl.constexpr = w_desc.layout
    ring = (gl.allocate_shared_memory(dt, [NS, C, D], tile),
            gl.allocate_shared_memory(dt, [NS, C, BV], do_desc.layout),
            gl.allocate_shared_memory(dt, [NS, C, D], tile), gl.allocate_shared_memory(dt, [NS, C, D], tile))
    # one chunk's fp32 hand-off (single: the ring and a double buffer would not fit sm_90's shared memory),
    # written in one accumulator layout and read in another. A warp's 8-byte accesses of the accumulator
    # layouts cover 8 rows x 4 column pairs (8 columns): groups of 8 columns swizzled over 8 rows put those
    # 32 pairs in distinct banks (vec=2 would leave 4 rows of a half-warp on 4 banks); dvl's transposed
    # 4-byte loads take 2 passes instead of 1
    handoff: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    dvl_buf = gl.allocate_shared_memory(gl.float32, [C, BV], handoff)
    qdo_buf = gl.allocate_shared_memory(gl.float32, [BV, D], handoff)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    hand_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    hand_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for j in gl.static_range(NS):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=2)  # the chain and the off-chain partition
    mbarrier.init(hand_ready, count=1)
    mbarrier.init(hand_empty, count=1)

    gl.warp_specialize([
        (chain_partition, (ring, ready, empty, dvl_buf, qdo_buf, hand_ready, hand_empty, dh, dv, dht, dh0, gam, i_nh,
                           i_h, i_v, bos, eos, first_chunk, num_chunks, H, C, D, USE_DHT, STORE_DH0, USE_G,
                           num_warps)),
        (offchain_partition, (ring, ready, empty, dvl_buf, qdo_buf, hand_ready, hand_empty, gam, scale, bos, eos,
                              num_chunks, i_h, H, C, D, USE_G)),
        (loader_partition, ((w_desc, do_desc, k_desc, q_desc), ring, ready, empty, bos, num_chunks, i_h, i_hk, i_v,
                            C, D, True)),
    ], [OFFCHAIN_WARPS, 1], [OFFCHAIN_REGS, LOADER_REGS])


def gluon_state_bwd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, do: torch.Tensor, dht: Optional[torch.Tensor],
                    scale: float, need_dh0: bool, info: SeqInfo, chunk_size: int = C_WALK,
                    block_v: Optional[int] = None, checked: bool = False, gam: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """portable reverse.state_bwd's contract with the local dV' fused (dv_local=None): (dh [NT, H, 128, 128] in q's
    dtype, dv in do's shape and dtype, dh0 [N, H, 128, 128] fp32 or None), on q, k, w, do [B, T, H, 128] or packed
    [1, TT, H, 128], one 16-bit dtype, contiguous rows (the descriptors and the stores address row r of head h
    at r * H * 128 + h * 128). 128 / block_v programs a sequence and head (REVERSE_CONFIGS' V-block widths);
    block_v as plan.hopper_block_v chooses unless given. With no tokens at all nothing is launched (a TMA
    descriptor's shape must be positive): dh is empty, dh0 the dht (or zeros). checked: the caller (the chunk
    backward, on the plan's Hopper reverse pass) has made check_inputs' checks, so they are not made again. q, k may
    have fewer heads than w, do (grouped value heads: H is w's). gam: the gated rule's γ [.., TT, H] fp32."""
    if chunk_size != C_WALK:
        raise ValueError(f"gluon_reverse: chunk_size {C_WALK} only, got {chunk_size}")
    if block_v is not None and block_v not in REVERSE_CONFIGS:
        raise ValueError(f"gluon_reverse: block_v (the V-block of dS^T a program walks) must be one of "
                         f"{sorted(REVERSE_CONFIGS)}, got {block_v}")
    if not checked:
        check_inputs("gluon_reverse", dict(q=q, k=k, w=w, do=do), info)
    TT, N, H, HK, D = info.total_tokens, info.num_seqs, w.shape[2], k.shape[2], k.shape[3]
    if gam is not None and (gam.dtype != torch.float32 or gam.numel() != TT * H or not gam.is_contiguous()):
        raise ValueError(f"gluon_reverse: gam must be contiguous fp32 [.., {TT}, {H}], got {tuple(gam.shape)} "
                         f"{gam.dtype}")
    if dht is not None and tuple(dht.shape) != (N, H, D, D):
        raise ValueError(f"gluon_reverse: dht must be [{N}, {H}, {D}, {D}], got {tuple(dht.shape)}")
    chunks = info.chunks(chunk_size)
    dh = q.new_empty(chunks.num_chunks, H, D, D)
    dv = torch.empty_like(do)  # contiguous: do is (checked)
    dh0 = q.new_empty(N, H, D, D, dtype=torch.float32) if need_dh0 else None
    dht = dht.float().contiguous() if dht is not None else None
    if TT == 0 or N * H == 0:
        pass_state_through(dh0, dht)
        return dh, dv, dh0
    block_v = hopper_block_v(N * H, num_sms(k.device)) if block_v is None else block_v
    # [TT, H * 128] per tensor, tile [C, 128] at (row, head * 128), dO's [C, block_v] at (row, head * 128 +
    # V-block * block_v); rows past TT are TMA's zero fill
    descs = tma_descriptors(((w, D), (do, block_v), (k, D), (q, D)), TT)
    cfg = REVERSE_CONFIGS[block_v]
    launch(gluon_reverse_kernel, (N * H * (D // block_v), ), *descs, dh, dv, dht, dh0, gam, scale, info.cu_seqlens,
           chunks.chunk_offsets, H, HK, dht is not None, need_dh0, gam is not None, LOADER_REGS, OFFCHAIN_WARPS,
           cfg.offchain_regs, cfg.stages, num_warps=cfg.chain_warps)
    return dh, dv, dh0
