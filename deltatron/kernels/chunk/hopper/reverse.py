"""The backward's reverse state pass (state_bwd.state_bwd with dv_local=None, the fused pass) as a
warp-specialized Gluon kernel for Hopper (triton 3.6, sm_90, 16-bit, K = V = 128, C = 64), the mirror of
gluon_walk.py. state_bwd runs it where state_bwd.gluon_reverse_pays (16 sequences x heads up to one program a
head per SM; the measurements are there), and where GLUON_REVERSE forces it.

One program per (sequence, head, V-block of BV rows of dS^T) walks its chunks backwards from dS = dht (or 0), as
state_bwd_kernel does, with its dS^T rows [BV, K] fp32 in registers, split over three partitions that run side
by side:
    loader (1 warp): gluon_walk.loader_partition (REVERSE): TMA of each chunk's W, K, Q tiles [C, 128] and
        dO's V-block [C, BV] into a ring of STAGES slots, last chunk first, each slot guarded by a `ready`
        mbarrier (TMA bytes) and an `empty` one (both consumers done);
    off-chain (4 warps = 1 warp group): per chunk, from Q, K and dO's V-block,
        A^T = K Q^T, kept for j <= i < n, scaled and rounded (output_bwd.causal_scores_t's rounding),
        dV'_local = A^T dO                                 [C, BV] fp32,
        scale dO^T Q (dO's rows from n on zeroed)          [BV, K] fp32, 64 V rows a product (a [128, 128]
            fp32 accumulator does not fit one warp group's 128 registers a thread: two products at BV = 128),
        handed to the chain through one pair of shared-memory tiles (mbarriers hand_ready / hand_empty);
    chain (the default partition, BV / 16 warps, dS^T rows split over them: 2 warp groups at BV = 128):
        dV'^T = dV'_local^T + dS_next^T K^T     (dS_next^T rounded, from registers; dV'_local^T loaded from
                                                 the hand-off tile as the accumulator's start)
        dS^T += scale dO^T Q                    (the hand-off tile, added while the product above runs)
        dS^T -= dV'^T W                         (dV'^T, its columns from n on zeroed, rounded and negated
                                                 (exact), from registers)
        storing dh[chunk] = dS_next (rounded) and dv = dV' (rounded, rows before the end), the V-block's
        columns, straight from registers while the second product runs, and dh0 = dS (fp32) after the last
        chunk.
So the serial chain dS -> K dS -> dV' -> W^T dV' -> dS runs only its two products, while the three
off-chain products and the loads of the next chunks run in the other warps.

Orientation: dS^T, as gluon_walk.py holds S^T. With dS [K, V] as the accumulator, K dS_next would need dS_next
as wgmma's B operand, i.e. stored to shared memory every chunk on the chain. With dS^T [V, K] both chain
products take their chain operand as the register A operand: dS_next^T [V, K] against K^T (the K tile,
permuted) into dV'^T [V, C], then -dV'^T [V, C] against the W tile [C, K] into dS^T; both accumulators
split their V rows over the warps alike, so each one's rounding becomes the other product's operand without
data moving between threads (gluon_walk.py's two layouts, unchanged).

Rounding points are state_bwd_kernel's (fused): dS_next to the input dtype for K dS_next and for dh, A^T after
scaling, dV' once for dv and W^T dV'; dV'_local and scale Q^T dO stay fp32. The two passes differ by the order
of fp32 sums only (tests/test_gluon_reverse_model.py: a PyTorch model of this arithmetic within 3e-5 of the
Triton pass in the interpreter at fp16, through the GPU test's check()).

Packed sequences: the descriptors span all B*T rows; a sequence's partial first-walked (last) chunk reads rows
of the next sequence (or TMA's zero fill past TT). In the Triton pass those rows read as zeros, so here: A^T's
columns i >= n and dO^T's columns i >= n are zeroed off the chain (the next sequence's q and dO stay out of
dV'_local and Q^T dO), and dV'^T's columns j >= n are zeroed before W^T dV' (its K rows stay out of dS); dv
rows from n on are not stored. The host wrapper takes [B, T, H, 128] or packed [1, TT, H, 128] and, with no
token at all, launches nothing (a TMA descriptor's shape must be positive): dh is empty, dh0 is dht (or
zeros). Empty sequences launch programs without chunks: dh0 = dht (or zeros).

Shared memory at BV = 128: the ring (2 slots of four [64, 128] tiles, 131,072 B) and the fp32 hand-off tiles
(dV'_local 32,768 B, scale dO^T Q 65,536 B) fill sm_90's 232,448 B: the hand-off is single-buffered, so the
off-chain partition computes chunk i's A^T and dV'_local while the chain is on chunk i - 1, then waits for the
chain to have read chunk i - 1's tiles (early in its step, while its first product runs) before storing them
and computing scale dO^T Q into them. (At BV = 64 the same protocol, on half the hand-off and a third ring slot.)

The V-block width BV (dO's descriptor's block width; REVERSE_CONFIGS; gluon_state_bwd's block_v):
    BV = 128, one program a head: the kernel measured on the H200 (below);
    BV = 64, two programs a head, each owning 64 rows of dS^T (the V-block i_v = program % 2), for few
        sequences x heads, where BV = 128 runs one program a head on at most half the SMs and the Triton pass
        splits V (measured slower there, below). The pass separates by V columns: the chain's dV'^T =
        dV'_local^T + dS_next^T K^T and dS^T -= dV'^T W touch only the program's BV rows of dS^T and dV'^T;
        off the chain dV'_local = A^T dO and scale dO^T Q are the V-block's (one [64, 128] product for the
        latter instead of two), and only A^T = K Q^T (8 of the program's 28 wgmma instructions, off the
        chain) is computed by both programs of a head. The loader loads dO's V-block [C, 64] beside whole
        W, K, Q (56 KiB a slot), the chain loads dht's and stores dh's, dv's and dh0's V-block; the chain is one
        warp group, its per-thread registers those of one of BV = 128's two chain warp groups (dS^T 64 fp32 a
        thread). The two programs of a head are neighbours in the grid: they run at once and share W, K, Q in
        L2 (HBM reads as at BV = 128). Narrower blocks and two programs an SM do not fit, as in gluon_walk.py.
    gluon_state_bwd chooses as gluon_walk.split_v (64 while 2 x sequences x heads fit one wave of the SMs),
    for the walk's reason: two programs an SM do not fit (221,504 B of shared memory a program), so past one
    wave the doubled grid runs in two and A^T is computed twice for nothing (the walk measured no gain at 8 x 16
    heads). Measured faster than the Triton pass and than BV = 128 at 16 to 64 sequences x heads (below), so
    state_bwd's default (gluon_reverse_pays) takes the split wherever split_v gives it.

Offline sm_90 compile (triton 3.6, bf16 and fp16; benchmarks/diagnostics/gluon_reverse.py --offline), BV = 128: 16
warps (8 + 4 + 1 padded to 4), setmaxnreg 176 / 128 / 24 (gluon_walk.py's), no spills without dht / dh0, 56 B with
them (all but 8 B before and after the loop; 8 B, two registers, stored and reloaded once a chunk). With dh stored
beside the first product instead the chain spilled 124 B; adding the off-chain term after that product instead of
beside it also avoids the spills, but puts its 64 KiB read on the chain. Shared memory 229,664 B. In the PTX each
partition's loop synchronizes only on its own named barrier (bar.sync 0, 256 in the chain; 2, 128 in the off-chain;
none in the loader) and on mbarriers; the CTA-wide barrier 1 only where the partitions start and end; each
wgmma.wait_group 0 waits on its own warp group's products (2 in the chain, 4 off it). The chain's products lower to 8
HGMMA.64x64x16 and 4 HGMMA.64x128x16 per warp group with register A operands; dO^T's halves are read with
ldmatrix.trans. The chain's loop has one bar.sync 0, 256 more than gluon_walk's, before its second product: the
barrier the compiler puts ahead of the first shared-memory access after an mbarrier arrive, here hand_empty's (with
that arrive after the second product's issue it is gone, but the off-chain partition would wait for the whole first
product before storing its next tiles). The V-block changes nothing in BV = 128's PTX (the same instructions as
before BV was a parameter, debug information apart: i_v folds to 0).

BV = 64 (same compile, both dtypes): 12 warps (4 + 4 + 1 padded to 4), 168 registers a thread at launch, setmaxnreg
256 / 128 / 24 (the chain setmaxnreg's maximum, as gluon_walk.py's BV = 64); no spills without dht / dh0 or with
either alone; 52 B with both, all in the chain: 48 B of values used only after the loop (byte offsets of dh0's
stores), stored once before it and reloaded once after it, and 4 B, one register (the high half of such an offset),
stored and reloaded once a chunk, which none of the loop's instructions reads (ptxas's choice at 252 of the chain's
256 registers; BV = 128's chain spills 56 B alike). Shared memory 221,504 B: 3 ring slots of 57,344 B (W, K, Q
[64, 128], dO [64, 64]; the loader's expect 57,344 B, 7 TMA boxes a slot), the hand-off 16,384 + 32,768 B. wgmma
instructions 28 (BV = 128: 32): in the chain 8 m64n64k16 (dS_next^T K^T) and 4 m64n128k16 (dV'^T W), one warp group's
share of BV = 128's; off it 8 m64n64k16 (K Q^T), 4 m64n64k16 (A^T dO, n64 instead of n128) and 4 m64n128k16 (one
dO^T Q product instead of two); dO^T read with 4 ldmatrix.trans (the [64, 64] tile and layout of gluon_walk's BV = 64
U^T load). In the PTX each partition's loop synchronizes only on its own named barrier (bar.sync 0, 128 four times in
the chain; 2, 128 three times off it, one fewer with one dO^T Q product; none in the loader) and on mbarriers (the
chain 2 waits and 2 arrives, the off-chain partition 2 and 2, the loader 1 and its expect); the CTA-wide barrier 1
only where the partitions start and end; wgmma.wait_group 0 twice in the chain and three times off it, each on its
own warp group's products. The barriers and their phases are BV = 128's: ready / empty indexed and phased by the
ring's slot count (3 here, as the walk's BV = 64), hand_ready / hand_empty single and phased by the chunk's parity,
init counts 1 / 2 / 1 / 1 (checked in the PTX).

Reviewed at BV = 128 (session 9, without a GPU): the SASS's barrier addresses and init counts (ready 1, empty 2,
hand_ready and hand_empty 1) match each partition's waits and arrives; every mbarrier.arrive of the chain and the
off-chain partition lowers to one thread's arrive (tid % 256 or % 128 == 0) right after its partition's bar.sync, so
the chain's hand_empty arrive follows all its warps' hand-off loads; the loader's expect is 4 x 16,384 B, the full
boxes that TMA counts even where it zero-fills. A random-interleaving model of the protocol (the review's, not kept;
hardware parity semantics, TMA completing at random; 0 to 8 chunks) neither hangs nor reads a stale or overwritten
slot or hand-off tile, and fails on each of four broken variants (hand_empty not waited, empty counting 1, a wrong
hand_ready parity, a short expect). Proxies: the only async-proxy accesses are TMA writes and wgmma reads of the ring
(ordered by ready / empty, the loader's fence before TMA overwrites the generic ldmatrix reads of dO); the hand-off
is generic on both sides, so it needs no fence. The TTGIR maps each capture to the right ring (do / k / q) and
descriptor; operands: register A with kWidth 2 from an accumulator of the same row split, smem B K-major (the K and Q
tiles permuted) or MN-major (tnspB: W, dO, Q). The new shared-memory paths, evaluated per thread from the PTX: the
ldmatrix.trans addresses of dO^T's two halves are those of gluon_walk's U^T load (warps 0-3 and 4-7), which passed on
the H200; the fp32 hand-off's store and load addresses are, thread by thread, the accumulator layouts' elements under
the swizzle's formula (dV'_local read transposed). Math and masks against state_bwd_kernel (fused): the same rounding
points, dh at (chunk_offsets[seq] + t) * H + h in [K, V], dv rows and dV' columns from n on masked, A^T and dO^T
columns from n on zeroed (so the next sequence's rows reach nothing). The forward's gluon_walk.py compiles to the
same PTX as before the loader's REVERSE (outside debug info). Not checkable here: what the hardware makes of it (a
hang shows only in the GPU test's smoke child), the register order within those layouts (Triton's, as in the walk),
the bank conflicts (counted from those addresses, not measured) and every time below.

Expected on the H200 for BV = 128 (session 9, unmeasured then): the forward's Gluon walk, with the same ring (64 KiB
of tiles a chunk), settles at about 2.6 us a chunk with 64 programs (4 x 16, 2 x 32, 1 x 64 heads), against 4.1 for
the Triton walk; the Triton reverse pass takes about 3.6 us a chunk there (0.234 ms over 64 chunks at 4 x 16). Here
the chain is about 1,200 cycles a chunk (two products of 1 MFLOP a warp group with their K / W reads, the roundings,
the 64 KiB hand-off read beside the first product); the off-chain partition, after the chain has read the hand-off
tiles, needs about 1,300 more (dV'_local's store, two products and 64 KiB of stores) before the chain can go on, so
the programs' step is about 2,100 cycles, 1.2 us. The floor is shared memory: about 416 KiB a chunk (the TMA writes,
the products' operand reads, the 96 KiB hand-off written and read) at 128 B a cycle is 3,300 cycles, 1.8 us (the
forward's Gluon walk moves about 290 KiB, 1.2 us), still under the 2.6 us the forward settles at, and the pass also
writes dh and dv (48 KiB a chunk to HBM, stores no one waits for). So about 2.7 to 3.2 us a chunk: b4-t4096-h16
0.17-0.20 ms (Triton 0.234), b2-t8192-h32 0.35-0.41 (0.463), b1-t32768-h64 1.4-1.65 (1.830); b8-t2048-h16 (128
programs, 470 MB through HBM, where the forward's Gluon walk gained 3 %) 0.18-0.21 (0.183), no gain.

Measured on the H200 (session 10, benchmarks/diagnostics/gluon_reverse.py, bf16), Triton pass against this one,
ms: b8-t2048-h16 0.202 / 0.162, b4-t4096-h16 0.232 / 0.289, b2-t8192-h32 0.453 / 0.561, b1-t32768-h64
1.793 / 2.226. The prediction was wrong both ways: about 4.5 us a chunk with 64 programs (not 2.7-3.2), and
5.1 with 128 programs, where the Triton pass, at one program a head too, takes 6.3. With 64 programs the
Triton pass splits V over two programs a head (128 programs, 3.6 us a chunk), which BV = 128 does not.

Predicted for BV = 64 (session 10, before it ran; bf16, dht and dh0, the probe's configs): the walk's split is
the anchor. Its programs, halved the same way (one chain warp group instead of two, per-thread work unchanged, the
SM's tensor cores and shared memory shared with half as much work), went from 2.6 to 1.4-1.7 us a chunk, x0.55 at 32
programs (1 x 16 heads) to x0.63 at 128 (4 x 16, 2 x 32). This pass at BV = 128 takes 4.4-4.5 us a chunk with
64 programs, 1.8 more than the walk, which the walk does not have: the fp32 hand-off (96 KiB written and read a
chunk, single-buffered) and the off-chain tail the chain waits for (dV'_local's store, two dO^T Q products, 64
KiB of stores); at BV = 64 all of these halve (48 KiB, one product, 32 KiB), and A^T, repeated, stays off the
chain before the hand-off wait. So x0.55-0.65 as the walk: 2.5-2.9 us a chunk with 128 programs. HBM stays
under its ceiling there: a head moves 112 KiB a chunk (W, K, Q, dO read once if its two programs run together,
dh and dv written), 64 heads at 2.7 us are 2.7 TB/s of 4.3. Triton pass / BV = 128 / BV = 64 (predicted), ms:
    b4-t4096-h16 (64 chunks):   0.232 / 0.289 / 0.16-0.19 (about 0.175): faster than the Triton pass;
    b2-t8192-h32 (128 chunks):  0.453 / 0.561 / 0.31-0.36 (about 0.34);
    b1-t32768-h64 (512 chunks): 1.793 / 2.226 / 1.22-1.45 (about 1.35);
    b1-t32768-h16 (512 chunks, 32 programs): unmeasured / about 2.15 (4.2 us a chunk, as the walk's 16 programs
        ran 4 % faster a chunk than 64) / 1.1-1.4 (about 1.2, the walk's x0.55); the Triton pass (BV = 16,
        128 programs, each repeating K Q^T) unmeasured, so no prediction of the winner there.
Measured (H200, session 11, the same probe; dh, dv, dh0 bitwise equal to BV = 128's), Triton pass / BV = 128 /
BV = 64, ms: b4-t4096-h16 0.230 / 0.291 / 0.167; b2-t8192-h32 0.449 / 0.567 / 0.320-0.337; b1-t32768-h64
1.757 / 2.233 / 1.295-1.316; b1-t32768-h16 1.304 / 2.378 / 1.214; b8-t2048-h16 (split_v: 128) 0.201 / 0.163 /
0.173. Within the predicted ranges at b4, b2 and b1-h64, at the low end of b1-h16's; so gluon_reverse_pays
runs the Gluon pass from 16 sequences x heads (the fewest measured) to one wave, split as split_v chooses.

Imported only where it can run (state_bwd.gluon_reverse_applies imports it lazily, on a CUDA sm_90 device):
Gluon does not run in TRITON_INTERPRET, and CI's triton may lack its Hopper API."""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from ...launch import launch
from ...utils import SeqInfo, num_sms
from ..plan import hopper_block_v
# D_WALK: this kernel's head size as well (its tests and probe read it here)
from .walk import (C_WALK, D_WALK, LOADER_REGS, accumulator_layout, check_inputs, loader_partition,  # noqa: F401
                         pass_state_through, register_operand, tma_descriptors)

OFFCHAIN_WARPS = 4


class ReverseConfig(NamedTuple):
    chain_warps: int  # BV / 16: the chain's dS^T rows are split 16 a warp
    offchain_regs: int  # the off-chain partition's setmaxnreg; the chain gets what is left
    stages: int  # ring slots of W, dO, K, Q tiles


# per V-block width BV (the dS^T rows a program walks), as gluon_walk.WALK_CONFIGS (offline, ptxas, sm_90a):
# BV = 128: 16 warps, loader 24, off-chain 128, the chain (65536 - 128 (24 + 128)) / 256 = 176 a thread; 2 ring
#     slots (64 KiB a slot; with the 96 KiB fp32 hand-off no third fits).
# BV = 64: 12 warps (4 + 4 + 1 padded to 4), loader 24, off-chain 128, the chain setmaxnreg's maximum, 256; 3 ring
#     slots (56 KiB a slot at 16 bits: W, K, Q [64, 128], dO [64, 64]; the hand-off 48 KiB).
REVERSE_CONFIGS = {128: ReverseConfig(chain_warps=8, offchain_regs=128, stages=2),
                   64: ReverseConfig(chain_warps=4, offchain_regs=128, stages=3)}


@gluon.jit
def chain_partition(ring, ready, empty, dvl_buf, qdo_buf, hand_ready, hand_empty, dh, dv, dht, dh0, i_nh, i_h, i_v,
                    bos, eos, first_chunk, num_chunks, H: gl.constexpr, C: gl.constexpr, D: gl.constexpr,
                    USE_DHT: gl.constexpr, STORE_DH0: gl.constexpr, STORE_OUTPUTS: gl.constexpr,
                    num_warps: gl.constexpr):
    """The serial chain on the V-block i_v of dS^T, [BV, D] fp32 (rows V, columns K), backwards over the chunks,
    both products with the rounded dS_next^T or dV'^T as the register operand; stores dh (dS_next) and dv (dV')
    of each chunk, the V-block's columns, where STORE_OUTPUTS (else dh0 alone: the reverse split's pass 1)."""
    w_ring, do_ring, k_ring, q_ring = ring
    NS: gl.constexpr = w_ring.shape[0]
    BV: gl.constexpr = do_ring.shape[2]
    dt: gl.constexpr = w_ring.dtype
    # warps stacked along the V rows, as gluon_walk's chain
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
        mbarrier.wait(ready.index(s), (i // NS) & 1)
        mbarrier.wait(hand_ready, i & 1)
        b_dsd = b_dst.to(dt)  # dS_next, rounded: the operand of K dS_next and the stored dh
        # dV'^T = dV'_local^T + dS_next^T K^T, the local part (fp32) as the accumulator's start
        b_dvt = warpgroup_mma(gl.convert_layout(b_dsd, sd_operand), k_ring.index(s).permute((1, 0)),
                              dvl_buf.permute((1, 0)).load(vn_layout), is_async=True)
        # while it runs: the off-chain term scale Q^T dO joins dS
        b_dst = b_dst + qdo_buf.load(s_layout)
        mbarrier.arrive(hand_empty, count=1)
        b_dvt = warpgroup_mma_wait(num_outstanding=0, deps=(b_dvt, ))
        # dV' rows past the sequence's end (K rows of the next sequence) must not reach dS
        n = eos - bos - t * C
        b_dvd = gl.where(tokens[None, :] < n, b_dvt, 0.0).to(dt)
        # dS^T -= dV'^T W: the negation of the rounded dV' is exact
        b_dst = warpgroup_mma(gl.convert_layout(-b_dvd, vn_operand), w_ring.index(s), b_dst, is_async=True)
        # while that runs: the stores (here rather than beside the first product, where they spill)
        if STORE_OUTPUTS:
            o_dv = (bos + t * C + tokens[None, :]).to(gl.int64) * (H * D) + i_h * D + i_v * BV + vv[:, None]
            gl.store(dv + o_dv, b_dvd, mask=tokens[None, :] < n)
            o_dh = ((first_chunk + t) * H + i_h).to(gl.int64) * D * D
            gl.store(dh + o_dh + o_st, b_dsd)
        b_dst = warpgroup_mma_wait(num_outstanding=0, deps=(b_dst, ))
        mbarrier.arrive(empty.index(s), count=1)

    if STORE_DH0:
        gl.store(dh0 + i_nh.to(gl.int64) * D * D + o_st, b_dst)


@gluon.jit
def offchain_partition(ring, ready, empty, dvl_buf, qdo_buf, hand_ready, hand_empty, scale, bos, eos, num_chunks,
                       C: gl.constexpr, D: gl.constexpr):
    """Per chunk, from the ring's Q, K and dO's V-block [C, BV]: dV'_local = scale (K Q^T ⊙ M^T) dO [C, BV] and
    scale dO^T Q [BV, K] (fp32), handed to the chain through dvl_buf and qdo_buf (K Q^T is the same for every
    V-block: each program of a head computes it)."""
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
        mbarrier.wait(ready.index(s), (i // NS) & 1)
        n = eos - bos - t * C
        q_s, do_s = q_ring.index(s), do_ring.index(s)
        # A^T = K Q^T, kept for j <= i < n (row j, column i; the next sequence's tokens i >= n are left out,
        # their dO rows with them), scaled and rounded as output_bwd.causal_scores_t
        b_at = warpgroup_mma(k_ring.index(s), q_s.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=p_layout),
                             use_acc=False, is_async=True)
        b_at = warpgroup_mma_wait(num_outstanding=0, deps=(b_at, ))
        b_at = gl.where((pj[:, None] <= pi[None, :]) & (pi[None, :] < n), b_at * scale, 0.0).to(dt)
        b_dvl = warpgroup_mma(gl.convert_layout(b_at, at_operand), do_s,
                              gl.zeros([C, BV], gl.float32, layout=l_layout), use_acc=False, is_async=True)
        b_dvl = warpgroup_mma_wait(num_outstanding=0, deps=(b_dvl, ))
        mbarrier.wait(hand_empty, (i & 1) ^ 1)  # the chain has read the previous chunk's tiles
        dvl_buf.store(b_dvl)
        # scale dO^T Q, G rows of V at a time; dO^T's columns i >= n zeroed, the register operand
        for h in gl.static_range(BV // G):
            b_dot = do_s.slice(h * G, G, dim=1).permute((1, 0)).load(p_layout)
            b_dot = gl.convert_layout(gl.where(pi[None, :] < n, b_dot, gl.zeros_like(b_dot)), dot_operand)
            b_g = warpgroup_mma(b_dot, q_s, gl.zeros([G, D], gl.float32, layout=g_layout), use_acc=False,
                                is_async=True)
            b_g = warpgroup_mma_wait(num_outstanding=0, deps=(b_g, ))
            qdo_buf.slice(h * G, G, dim=0).store(b_g * scale)
        mbarrier.arrive(empty.index(s), count=1)
        mbarrier.arrive(hand_ready, count=1)


@gluon.jit
def gluon_reverse_kernel(w_desc, do_desc, k_desc, q_desc, dh, dv, dht, dh0, scale, cu_seqlens, chunk_offsets,
                         H: gl.constexpr, USE_DHT: gl.constexpr, STORE_DH0: gl.constexpr,
                         STORE_OUTPUTS: gl.constexpr, LOADER_REGS: gl.constexpr,
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
    # 32 pairs in distinct banks (pairs swizzled alone, vec=2, left 4 rows of a half-warp on 4 banks, 2-4
    # times the shared-memory passes); dvl's transposed 4-byte loads (8 rows x 4 columns j = 2(lane % 4) + c)
    # take 2 passes instead of 1
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
        (chain_partition, (ring, ready, empty, dvl_buf, qdo_buf, hand_ready, hand_empty, dh, dv, dht, dh0, i_nh, i_h,
                           i_v, bos, eos, first_chunk, num_chunks, H, C, D, USE_DHT, STORE_DH0, STORE_OUTPUTS,
                           num_warps)),
        (offchain_partition, (ring, ready, empty, dvl_buf, qdo_buf, hand_ready, hand_empty, scale, bos, eos,
                              num_chunks, C, D)),
        (loader_partition, ((w_desc, do_desc, k_desc, q_desc), ring, ready, empty, bos, num_chunks, i_h, i_v,
                            C, D, True)),
    ], [OFFCHAIN_WARPS, 1], [OFFCHAIN_REGS, LOADER_REGS])


def gluon_state_bwd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, do: torch.Tensor, dht: Optional[torch.Tensor],
                    scale: float, need_dh0: bool, info: SeqInfo, chunk_size: int = C_WALK,
                    block_v: Optional[int] = None, checked: bool = False, store_outputs: bool = True
                    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """state_bwd.state_bwd's contract with dv_local=None (the fused pass): (dh [NT, H, 128, 128] in q's dtype,
    dv in do's shape and dtype, dh0 [N, H, 128, 128] fp32 or None), on q, k, w, do [B, T, H, 128] or packed
    [1, TT, H, 128], one 16-bit dtype, contiguous rows (the descriptors and the stores address row r of head h
    at r * H * 128 + h * 128). 128 / block_v programs a sequence and head (REVERSE_CONFIGS' V-block widths);
    block_v as gluon_walk.split_v chooses unless given (see the module docstring). With no tokens at all
    nothing is launched (a TMA descriptor's shape must be positive): dh is empty, dh0 the dht (or zeros).
    checked: the caller has made check_inputs' checks (the chunk backward's state_bwd.state_bwd: the API's shapes,
    gluon_reverse_applies), so they are not made again. Without store_outputs dh and dv are neither allocated nor
    written (None, None, dh0; state_bwd.state_bwd's store_outputs)."""
    if chunk_size != C_WALK:
        raise ValueError(f"gluon_reverse: chunk_size {C_WALK} only, got {chunk_size}")
    if block_v is not None and block_v not in REVERSE_CONFIGS:
        raise ValueError(f"gluon_reverse: block_v (the V-block of dS^T a program walks) must be one of "
                         f"{sorted(REVERSE_CONFIGS)}, got {block_v}")
    if not checked:
        check_inputs("gluon_reverse", dict(q=q, k=k, w=w, do=do), info)
    TT, N, H, D = info.total_tokens, info.num_seqs, k.shape[2], k.shape[3]
    if dht is not None and tuple(dht.shape) != (N, H, D, D):
        raise ValueError(f"gluon_reverse: dht must be [{N}, {H}, {D}, {D}], got {tuple(dht.shape)}")
    chunks = info.chunks(chunk_size)
    dh = q.new_empty(chunks.num_chunks, H, D, D) if store_outputs else None
    dv = torch.empty_like(do) if store_outputs else None  # contiguous: do is (checked)
    dh0 = q.new_empty(N, H, D, D, dtype=torch.float32) if need_dh0 else None
    dht = dht.float().contiguous() if dht is not None else None
    if TT == 0 or N * H == 0:
        pass_state_through(dh0, dht)
        return dh, dv, dh0
    block_v = hopper_block_v(N * H, num_sms(k.device)) if block_v is None else block_v
    # [TT, H * 128] per tensor, tile [C, 128] at (row, head * 128), dO's [C, block_v] at (row, head * 128 +
    # V-block * block_v); rows past TT are TMA's zero fill
    descs = tma_descriptors(((w, D), (do, block_v), (k, D), (q, D)), TT, H)
    cfg = REVERSE_CONFIGS[block_v]
    launch(gluon_reverse_kernel, (N * H * (D // block_v), ), *descs, dh, dv, dht, dh0, scale, info.cu_seqlens,
           chunks.chunk_offsets, H, dht is not None, need_dh0, store_outputs, LOADER_REGS, OFFCHAIN_WARPS,
           cfg.offchain_regs, cfg.stages, num_warps=cfg.chain_warps)
    return dh, dv, dh0
