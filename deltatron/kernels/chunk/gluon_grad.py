"""The backward's chunk-gradient stage (output_bwd.dqkw + wy_bwd.wy_bwd) as one warp-specialized Gluon kernel for
Hopper (triton 3.6, sm_90, 16-bit, K = V = 128, C = 64): backward.py runs it where GLUON_GRAD is on and
gluon_grad_applies (off by default until the GPU has measured it). NOTES R1 (notes/flashqla_backward.md).

Per (chunk, head), from q, k, v, beta, dO, S = h (the state entering the chunk), dS' = dh (the gradient of the
state leaving it), dV' (the reverse pass's full dV' = dU) and T~ = (I + A)^{-1} (fp32, saved by the forward), it
writes the final dq, dk, dv, dbeta. V' is recomputed on chip, so v_new, dW and the direct dK never exist.

The algebra (DESIGN.md §3 rewritten through V' = U - W S = T~ diag(beta) (V - K S) = T X, with T = T~ diag(beta)
and X = V - K S; tests/test_gluon_grad_model.py checks it against the float64 oracle to 1e-10):
    dT~ = dW Kb^T + dU Vb^T = -dV' S^T K^T diag(beta) + dV' V^T diag(beta) = dV' X^T diag(beta): so with
          dT = dV' X^T, dT~ = dT diag(beta) (columns scaled);
    dV  = beta ⊙ T~^T dU = beta ⊙ T~^T dV' =: dX;
    beta dKb = -beta ⊙ T~^T dV' S^T = -dX S^T;
    dbeta = rowsum(T~^T dV' ⊙ V) - rowsum(T~^T dV' S^T ⊙ K) + rowsum(dA K ⊙ K) = rowsum(T~^T dV' ⊙ X) +
          rowsum(dA ⊙ K K^T), and rowsum(T~^T dV' ⊙ X)_j = sum_i T~_ij dT_ij (a column sum of dT ⊙ T~);
    beta (dA K) + dA^T (beta K) = (diag(beta) dA + (diag(beta) dA)^T) K = (R^T + R) K, R = (diag(beta) dA)^T;
    dQ  = scale (dO S^T + (dO V'^T ⊙ M) K),
    dK  = dPm^T Q + V' dS'^T - dX S^T + (R^T + R) K,  dPm = scale (dO V'^T ⊙ M), M keeping j <= i;
    dA  = strictly_lower(-T~^T dT~ T~^T), computed as its transpose G = dA^T = -T~ (T~^T dT~)^T (strictly upper),
          so that both products take T~ or T~^T from registers and dT~, M1 = T~^T dT~ from shared memory.

Precision. 16-bit operands where the pair has them: K S (S rounded as h is stored), X's high half in dV' X^T, T~^T
dV' with T~ rounded (wy_bwd's T~^T dU), dV' X^T (wy_bwd's dW Kb^T + dU Vb^T on rounded operands), dO V'^T and the
dQ, dK products (dqkw's). Where wy_bwd keeps fp32 (tf32) operands, because nearly parallel keys cancel there, this
kernel multiplies 16-bit hi + lo pairs (x = hi + lo, lo = x - hi rounded; products hi hi + hi lo + lo hi, or hi b +
lo b where b is exact in the dtype): 16 significant bits at bf16 against tf32's 11, 22 at fp16. triton 3.6 lowers
no tf32 wgmma from Gluon (offline: fp32 operands, A in registers or in shared memory, fail in ConvertNVGPUToLLVM),
hence the pairs. They are used for dA^T's two products (3 wgmma each), (R^T + R) K (2 + 2) and V' = T X (3: T and X
as pairs; the pair's v_new is rounded once, where the state pass makes it). X rounded alone there (the first
version) left V' 5x further from T X than the pair's v_new on nearly parallel keys (bf16: 1.1e-2 against 2.2e-3 rel
RMS; tests/test_gluon_grad_model.py's inputs), where T X cancels, and with it dk 3x further from the exact stage
than the pair's (9.7e-3 against 3.2e-3); with X's low half, 2.8e-3. At fp16 the low half of a pair may underflow
(|x| below 2^-14 / 2^-11) or the high half overflow (|x| > 65504) where tf32 would not: dT~ and dA are gradients of
the same scale as dk, which is stored in fp16 anyway (on the GPU test's nearly parallel keys, unit dO, |R| reaches
1.7e3: overflow takes dO about 40 times larger there).

Partial chunks: the descriptors span all B*T rows, so a sequence's partial last chunk reads the next sequence's
rows (and T~'s) where the Triton pair reads zeros. Every product is kept clean of them: T~ is masked to its
support in rows and columns < n (so T, T~^T and dA vanish outside the chunk, and with them V', dX, dbeta and the
(R^T + R) K term); beta reads 0 from n on; X's rows, dT's rows and columns and dPm's rows (dO's) from n on are
zeroed; dq, dk, dv, dbeta rows from n on are not stored. K, Q, dO, dV' rows past n then reach nothing.

Roles (three partitions; a program per (chunk, head)):
    loader (1 warp): TMA of the tile's inputs in three groups, each on its own mbarrier: S, K, V, T~ (what
        the WY chain starts with), dO (the dQ/dK partition's first product), dV', Q, dS';
    WY chain (the default partition, 1 warp group): K S; X = V - K S as a pair, its high half stored over V's
        tile, its low half in V''s until V' = T X replaces it (handed over: vn_ready); dX = beta T~^T dV' (dv
        stored; -dX handed over: dx_ready) beside dT = dV' X^T; dbeta's column sums; M1 = T~^T dT~, G = dA^T,
        K K^T and dbeta's second part; R handed over (r_ready) as a 16-bit pair in the tile that held dT~ and M1;
    dQ/dK (1 warp group): dO S^T at once, then dP = dO V'^T and dPm once V' is there, dQ = scale dO S^T + dPm K
        (stored), dK accumulated as dPm^T Q + V' dS'^T, then - dX S^T and (R^T + R) K as they arrive (stored).
Every mbarrier completes one phase in a program's life (no ring, no reuse across tiles), so every wait is on
phase 0: there is no parity to get wrong. Each hand-off tile is written for the other partition once and never
reused after (V''s tile and the pair hold the WY chain's own operands before: X's low half; dT~, M1), so no
`empty` barriers either.

Grid: one program per (chunk, head), (NT, H). Not persistent: consecutive tiles share nothing to reuse, and a
persistent loop would need per-buffer release barriers on a single-buffered 216 KiB working set (no second
buffer fits), with their phases, for an overlap of one tile's loads with the previous tile's products that the
other SMs' tiles give the HBM in any case (the tiles of different SMs are out of step). The cost is a launch per
tile (its prologue: the loads of the first group before any product) and no overlap inside an SM.

Offline sm_90 compile (triton 3.6, bf16 and fp16; benchmarks/diagnostics/gluon_grad.py --offline): 12 warps (4 + 4
+ 1 padded to 4), 168 registers a thread at launch, setmaxnreg 248 (the WY chain: what is left of the CTA's 64,512,
168 x 384, after the dQ/dK partition's 232 and the loader's 24; 256 only outside the partitions) / 232 / 24. Shared
memory 222,272 B of sm_90's 232,448: the inputs 163,840 (q, k, v (then X), dO, dV' [64, 128] 16-bit, S and dS'
[128, 128], T~ [64, 64] fp32), the hand-off 49,152 (V', -dX [64, 128], the pair [2, 64, 64] that holds dT~, then
M1, then R), dPm 8,192, and 1,088 of barriers and the compiler's scratch: one program an SM. Spills: 164 B at bf16,
140 at fp16, in the WY chain (at 248 registers; the dQ/dK partition's budget does not change them between 200 and
232, and they grow to 408 B when the chain gets 232). They were 332 B with T~ and T~^T loaded beside K S and K K^T
issued beside dT (their fp32 tiles live across the dX stage); moved, 164. 120 wgmma instructions (72 m64n128k16, 48
m64n64k16), from 13 products in the WY chain (K S; T X three times; T~^T dV'; dV' X^T; M1 and G three each; K K^T)
and 10 in the dQ/dK partition (dO S^T, dO V'^T, dPm K, dPm^T Q, V' dS'^T, -dX S^T, (R^T + R) K four); 16 TMA boxes
(8 loads, each two 128-byte-swizzled halves). In the PTX the partitions synchronize only on their own named
barriers (bar.sync 0, 128 in the WY chain; 2, 128 in the dQ/dK partition) and on the six mbarriers (the WY chain
waits 2 and arrives 3, the dQ/dK partition waits 6, the loader waits none); the CTA-wide barrier 1 only where the
partitions start and end, as in gluon_reverse.py. Each publish (a shared-memory store that a wgmma reads) is the
store, fence.proxy.async and the partition's bar.sync.

Predicted on the H200 (unmeasured; R1's 0.27-0.35 ms at b8 refined by this kernel's shape): per tile 208 KiB
read (q, k, v, dO, dV' 80 KiB, S and dS' 64 KiB, T~ 16 KiB) and 48 KiB written: b8-t2048-h16 moves 1.07 GB, 0.25
ms at 4.27 TB/s. 44 wgmma a tile (26 MFLOP: 11.5 in the WY chain, 14.2 in the dQ/dK partition), the WY chain's
dependent path K S -> T X -> dT -> M1 -> dA^T -> R -> (R^T + R) K about 8 dependent products of 0.3-0.6 us
(with their roundings and shared-memory round trips) after the first load group's 3-4 us: about 7-9 us a tile.
One program an SM: b8 has 4,096 tiles, 31 an SM, so 0.22-0.28 ms of tile latency against the 0.25 ms of bytes;
both overlap only across SMs: predicted 0.28-0.36 ms at b8 (the pair 0.574), b4-t4096-h16 the same tiles (0.28-
0.36), b2-t8192-h32 twice (0.55-0.70), b1-t32768-h16 twice (0.55-0.70, the pair about 1.0-1.15). The backward
then saves 0.21-0.29 ms at b8 (0.966 -> 0.68-0.76), not counting v_new's write, which the recompute still does.

Imported only where it can run (backward.gluon_grad_applies imports it lazily, on a CUDA sm_90 device): Gluon does
not run in TRITON_INTERPRET, and CI's triton may lack its Hopper API.

Reviewed without a GPU (session 12, branch wip/gluon-grad-review; the offline compile's PTX and ptxas's SASS, bf16
and fp16; nothing has run on a GPU yet):
- mbarriers: six, at 222,208-222,256 B (ready 0-2, then vn_ready, dx_ready, r_ready), each initialized to count 1
  by one thread of the default warp group before the CTA barrier that starts the partitions (one SYNCS.EXCH init
  value for all six). The WY chain waits on ready 0 and 2, the dQ/dK partition on all six, every wait on parity 0;
  the loader's three arrive.expect_tx come from lane 0 of its one warp with 81,920 B (S 32,768; K, V, T~ 16,384
  each), 16,384 (dO) and 65,536 (dV', Q 16,384; dS' 32,768): the full boxes, two a tile, 16 in all, whatever TMA
  zero-fills. The compiled tensor maps agree: boxes 64 x 64 16-bit, 128 x 64 for the states, 64 x 32 fp32 (data
  type FLOAT32) for T~, 128-byte swizzle. The WY chain's three arrives are each one thread's (tid % 128 == 0) right
  after the bar.sync 0, 128 that follows the publish's fence. The partitions depend on each other as a DAG (loader,
  then WY chain, then dQ/dK), each barrier completes its one phase, so no wait can outlast its arrive.
- Barriers inside partitions: gl.thread_barrier and the compiler's own lower to bar.sync 0, 128 (WY chain, 21) and
  bar.sync 2, 128 (dQ/dK, 3); the CTA-wide barrier 1 (15) only where the partitions start and end (the captures at
  221,184 are read between the two starting ones, before the WY chain's dbeta reductions reuse that scratch).
  setmaxnreg 248 / 232 / 24 over 128 threads each sum to the CTA's 64,512 exactly (168 x 384), so no setmaxnreg.inc
  waits forever.
- Races: benchmarks/diagnostics/gluon_grad_protocol.py models the partitions' accesses and barriers in the PTX's
  order (per warp; a wgmma reading its operands until every warp's share completes; hardware parity and byte-count
  semantics): clean in 1,000 random interleavings, and it catches each of 9 broken variants. Every overwrite of a
  tile a wgmma read (V by X, X's low half by V', dT~ by M1, M1 by R) comes after a bar.sync that follows every
  warp's wait_group. Proxies: each generic store a wgmma reads (X's halves, V', -dX, the pair three times, dPm) is
  the store, fence.proxy.async (FENCE.VIEW.ASYNC.S) and the bar.sync; TMA writes each tile once, before any generic
  access to it, so the loader needs no fence (gluon_walk.py's ring does).
- Layouts: each descriptor's TMA lands where its consumers read (S 0, dS' 32,768, Q 65,536, K 81,920, V 98,304, dO
  114,688, dV' 131,072, T~ 147,456; coordinates ((i_t H + i_h) 128, 0) for the states, (start, i_h 128) or (start,
  i_h 64) else); the transpose flags of all 120 wgmma match their products (A from shared memory transposed for
  dPm^T and R^T, new in these kernels) and their descriptors the boxes (LBO 8,192 for [64, 128] and 16,384 for
  [128, 128] MN-major tiles, SBO 1,024, k-steps of 32 B K-major and 2,048 B MN-major). T~'s fp32 loads, both
  orientations, evaluated per thread from the PTX, are exactly each thread's accumulator-layout elements (on T~'s
  support) under TMA's 128-byte swizzle (the formula without its XOR fails all 128 threads). Stores: start x H x
  128 in 64 bits (mad.wide.s32), the tile's offsets in 32. Partial chunks, T = 1, empty sequences: as above, in the
  model (tests/test_gluon_grad_model.py).
- Found and fixed: (1) V' = T X took X rounded (Precision above): now a pair. (2) The GPU test would have failed a
  right kernel: on nearly parallel keys the model of this arithmetic is 2.4e-2 (dq), 1.1e-2 (dk), 1.55e-2 (dbeta)
  from the pair at bf16 against the bound 1e-2 (2.9e-3 of 3e-3 at fp16), both being about that far from the exact
  stage on roundings both make (dq's and dbeta's sums cancel). There both are now compared with the exact stage,
  the kernel within max(bound, 1.5 x the pair's error): the model passes with margins 1.6 / 3.7 / 1.5 / 1.9 at bf16
  (dq, dk, dv (equal to the pair's), dbeta), 1.7 / 8.6 / 1.5 / 2.4 at fp16, and on the test's random configs at >=
  2.4 against the pair. (3) check() stopped at its first assert: it now prints every error, the worst (chunk, head)
  tiles of a failing output, and compares the kernel with the model itself (bound / 4; the model's fp32-order floor
  measured on the CPU is 1e-4 at bf16, 1.8e-3 on nearly parallel keys, where the bound itself applies). Every term
  of dq, dk, dbeta is at least 23 % of its output's norm on the random configs (4.8 % on nearly parallel keys: dk's
  -dX S^T and R^T K), so a missing, negated or misoriented one fails both comparisons. (4) The WY chain's
  setmaxnreg is 248, not 256. Also: a host test passes the backward's own inputs through the wrapper's checks.
- Open (what only the hardware shows): the first transposed shared-memory A operands and the first fp32 TMA tile in
  these kernels (both checked in the PTX, not run); register A operands across async wgmma (ptxas reports no
  serialization); fp16 overflow of the pairs' high halves where dO is about 40x the test's scale on nearly parallel
  keys; every time (spills 164 B at bf16, unmeasured)."""
from __future__ import annotations

from typing import Tuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..launch import launch
from ..utils import SeqInfo
from .gluon_walk import (C_WALK, LOADER_REGS, accumulator_layout, check_inputs, register_operand, tile_layout,
                         tma_descriptors)

# the inputs of gluon_grad, in its order (tests and the probe pass them by name)
INPUTS = ("q", "k", "v", "beta", "tinv", "h", "dh", "dv_prime", "do")
DQDK_WARPS = 4
# registers a thread (setmaxnreg): the loader's 1 warp padded to a warp group gets 24, the dQ/dK partition
# DQDK_REGS, the WY chain what is left of the CTA's 64,512 (168 a thread at launch) over 128 threads: 248
DQDK_REGS = 232


@gluon.jit
def loader_partition(descs, bufs, ready, start, i_t, i_h, H: gl.constexpr, C: gl.constexpr, D: gl.constexpr):
    """TMA of the tile's inputs in three groups: ready[0] S, K, V, T~; ready[1] dO; ready[2] dV', Q, dS'."""
    q_desc, k_desc, v_desc, do_desc, dvp_desc, s_desc, dh_desc, t_desc = descs
    q_s, k_s, v_s, do_s, dvp_s, s_s, dh_s, t_s = bufs
    state_row = (i_t * H + i_h) * D
    bar = ready.index(0)
    mbarrier.expect(bar, s_desc.block_type.nbytes + 2 * k_desc.block_type.nbytes + t_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(s_desc, [state_row, 0], bar, s_s)
    tma.async_copy_global_to_shared(k_desc, [start, i_h * D], bar, k_s)
    tma.async_copy_global_to_shared(v_desc, [start, i_h * D], bar, v_s)
    tma.async_copy_global_to_shared(t_desc, [start, i_h * C], bar, t_s)
    bar = ready.index(1)
    mbarrier.expect(bar, do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(do_desc, [start, i_h * D], bar, do_s)
    bar = ready.index(2)
    mbarrier.expect(bar, 2 * q_desc.block_type.nbytes + dh_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(dvp_desc, [start, i_h * D], bar, dvp_s)
    tma.async_copy_global_to_shared(q_desc, [start, i_h * D], bar, q_s)
    tma.async_copy_global_to_shared(dh_desc, [state_row, 0], bar, dh_s)


@gluon.jit
def tile_rows(x, start, i_h, H: gl.constexpr, D: gl.constexpr):
    """The address of token start, head i_h, of a [TT, H, D] tensor: the 64-bit part of a tile's offsets (the
    [C, D] rest, under C * H * D, is 32-bit)."""
    return x + start.to(gl.int64) * (H * D) + i_h * D


@gluon.jit
def publish(buf, x):
    """Stores x into buf for wgmma (the async proxy) to read, this partition's or another's: every thread's
    store, then the proxy fence, then the partition's barrier."""
    buf.store(x)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def publish_pair(pair, x):
    """x (fp32) as a 16-bit pair hi + lo into pair[0], pair[1] (see the module docstring's precision)."""
    hi = x.to(pair.dtype)
    pair.index(0).store(hi)
    pair.index(1).store((x - hi.to(gl.float32)).to(pair.dtype))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def pair_product(a, b_hi, b_lo, acc_layout: gl.constexpr):
    """a @ b on pairs, hi hi + hi lo + lo hi (the lo lo term is below their rounding): a fp32 in registers, b as
    the two 16-bit shared-memory halves."""
    op: gl.constexpr = register_operand(acc_layout)
    M: gl.constexpr = a.shape[0]
    N: gl.constexpr = b_hi.shape[1]
    a_hi = a.to(b_hi.dtype)
    a_lo = gl.convert_layout((a - a_hi.to(gl.float32)).to(b_hi.dtype), op)
    a_hi = gl.convert_layout(a_hi, op)
    acc = warpgroup_mma(a_hi, b_hi, gl.zeros([M, N], gl.float32, layout=acc_layout), use_acc=False, is_async=True)
    acc = warpgroup_mma(a_hi, b_lo, acc, is_async=True)
    acc = warpgroup_mma(a_lo, b_hi, acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))


@gluon.jit
def wy_partition(bufs, vn_s, dx_s, pair_s, ready, vn_ready, dx_ready, r_ready, beta, dv, dbeta, start, n, i_h,
                 H: gl.constexpr, C: gl.constexpr, D: gl.constexpr, num_warps: gl.constexpr):
    """The WY chain: V' = T X and dX handed over with dv stored, dbeta stored, R handed over as a pair."""
    q_s, k_s, x_s, do_s, dvp_s, s_s, dh_s, t_s = bufs  # X is written over V's tile
    dt: gl.constexpr = k_s.dtype
    acc_d: gl.constexpr = accumulator_layout(num_warps, D)
    acc_c: gl.constexpr = accumulator_layout(num_warps, C)
    op_d: gl.constexpr = register_operand(acc_d)
    ri = gl.arange(0, C, layout=gl.SliceLayout(1, acc_c))
    cj = gl.arange(0, C, layout=gl.SliceLayout(0, acc_c))
    rd = gl.arange(0, C, layout=gl.SliceLayout(1, acc_d))
    cd = gl.arange(0, D, layout=gl.SliceLayout(0, acc_d))

    mbarrier.wait(ready.index(0), 0)
    b_ks = warpgroup_mma(k_s, s_s, gl.zeros([C, D], gl.float32, layout=acc_d), use_acc=False, is_async=True)
    # while K S runs: beta (0 from n on)
    beta_c = gl.load(beta + (start + cj) * H + i_h, mask=cj < n, other=0.0).to(gl.float32)
    beta_d = gl.load(beta + (start + rd) * H + i_h, mask=rd < n, other=0.0).to(gl.float32)
    b_ks = warpgroup_mma_wait(num_outstanding=0, deps=(b_ks, ))
    b_x = gl.where(rd[:, None] < n, x_s.load(acc_d).to(gl.float32) - b_ks, 0.0)
    x_hi = b_x.to(dt)
    gl.thread_barrier()  # every thread has read V before X overwrites it
    x_s.store(x_hi)
    # X's low half, for V' = T X alone, in V''s tile until V' replaces it (publish fences both stores)
    publish(vn_s, (b_x - x_hi.to(gl.float32)).to(dt))
    # T~ and T~^T on their support inside the chunk (the rest is the next sequence's); loaded after X, not beside
    # K S, where the two [C, C] fp32 tiles beside K S's and X's [C, D] made the partition spill
    b_t = gl.where((cj[None, :] <= ri[:, None]) & (ri[:, None] < n), t_s.load(acc_c), 0.0)
    b_tt = gl.where((ri[:, None] <= cj[None, :]) & (cj[None, :] < n), t_s.permute((1, 0)).load(acc_c), 0.0)

    # V' = T X on pairs, T = T~ diag(beta) and X (hi in x_s, lo in vn_s): T_hi X_hi + T_lo X_hi + T_hi X_lo
    b_tb = b_t * beta_c[None, :]
    t_hi = b_tb.to(dt)
    t_lo = gl.convert_layout((b_tb - t_hi.to(gl.float32)).to(dt), op_d)
    t_hi = gl.convert_layout(t_hi, op_d)
    b_vn = warpgroup_mma(t_hi, x_s, gl.zeros([C, D], gl.float32, layout=acc_d), use_acc=False, is_async=True)
    b_vn = warpgroup_mma(t_lo, x_s, b_vn, is_async=True)
    b_vn = warpgroup_mma(t_hi, vn_s, b_vn, is_async=True)
    b_vn = warpgroup_mma_wait(num_outstanding=0, deps=(b_vn, ))
    gl.thread_barrier()  # every warp's products have read X's low half before V' overwrites it
    publish(vn_s, b_vn.to(dt))
    mbarrier.arrive(vn_ready, count=1)

    mbarrier.wait(ready.index(2), 0)
    # dX = beta T~^T dV' (T~ rounded, as wy_bwd), and beside it dT = dV' X^T
    b_dx = warpgroup_mma(gl.convert_layout(b_tt.to(dt), op_d), dvp_s, gl.zeros([C, D], gl.float32, layout=acc_d),
                         use_acc=False, is_async=True)
    b_dt = warpgroup_mma(dvp_s, x_s.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=acc_c), use_acc=False,
                         is_async=True)
    b_dx = warpgroup_mma_wait(num_outstanding=1, deps=(b_dx, ))
    b_dx = (b_dx * beta_d[:, None]).to(dt)
    gl.store(tile_rows(dv, start, i_h, H, D) + rd[:, None] * (H * D) + cd[None, :], b_dx, mask=rd[:, None] < n)
    publish(dx_s, -b_dx)  # negated (exactly): the dQ/dK partition accumulates - dX S^T as a sum
    mbarrier.arrive(dx_ready, count=1)

    b_dt = warpgroup_mma_wait(num_outstanding=0, deps=(b_dt, ))
    b_dt = gl.where((ri[:, None] < n) & (cj[None, :] < n), b_dt, 0.0)
    b_dbeta = gl.sum(b_dt * b_t, axis=0)
    # M1 = T~^T dT~, dT~ = dT diag(beta) in shared memory as a pair; then G = dA^T = -T~ M1^T, strictly upper
    publish_pair(pair_s, b_dt * beta_c[None, :])
    b_m1 = pair_product(b_tt, pair_s.index(0), pair_s.index(1), acc_c)
    publish_pair(pair_s, b_m1)
    # K K^T for dbeta runs with G's products (issued earlier, its accumulator spilled)
    b_kk = warpgroup_mma(k_s, k_s.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=acc_c), use_acc=False,
                         is_async=True)
    b_g = pair_product(b_t, pair_s.index(0).permute((1, 0)), pair_s.index(1).permute((1, 0)), acc_c)
    b_g = gl.where(ri[:, None] < cj[None, :], -b_g, 0.0)
    b_kk = warpgroup_mma_wait(num_outstanding=0, deps=(b_kk, ))
    # dbeta_i += sum_j dA_ij (K K^T)_ij: a column sum of G ⊙ K K^T (symmetric)
    b_dbeta += gl.sum(b_g * b_kk, axis=0)
    gl.store(dbeta + (start + cj) * H + i_h, b_dbeta, mask=cj < n)
    # R = (diag(beta) dA)^T = G diag(beta); dK gains (R^T + R) K
    publish_pair(pair_s, b_g * beta_c[None, :])
    mbarrier.arrive(r_ready, count=1)


@gluon.jit
def dqdk_partition(bufs, vn_s, dx_s, pair_s, dpm_s, ready, vn_ready, dx_ready, r_ready, dq, dk, scale, start, n, i_h,
                   H: gl.constexpr, C: gl.constexpr, D: gl.constexpr):
    """dQ = scale dO S^T + dPm K and dK = dPm^T Q + V' dS'^T - dX S^T + (R^T + R) K, dPm = scale (dO V'^T ⊙ M)."""
    q_s, k_s, x_s, do_s, dvp_s, s_s, dh_s, t_s = bufs
    dt: gl.constexpr = k_s.dtype
    WARPS: gl.constexpr = gl.num_warps()
    acc_d: gl.constexpr = accumulator_layout(WARPS, D)
    acc_c: gl.constexpr = accumulator_layout(WARPS, C)
    ri = gl.arange(0, C, layout=gl.SliceLayout(1, acc_c))
    cj = gl.arange(0, C, layout=gl.SliceLayout(0, acc_c))
    rd = gl.arange(0, C, layout=gl.SliceLayout(1, acc_d))
    cd = gl.arange(0, D, layout=gl.SliceLayout(0, acc_d))

    mbarrier.wait(ready.index(0), 0)
    mbarrier.wait(ready.index(1), 0)
    b_dq = warpgroup_mma(do_s, s_s.permute((1, 0)), gl.zeros([C, D], gl.float32, layout=acc_d), use_acc=False,
                         is_async=True)
    mbarrier.wait(vn_ready, 0)
    b_dp = warpgroup_mma(do_s, vn_s.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=acc_c), use_acc=False,
                         is_async=True)
    b_dq, b_dp = warpgroup_mma_wait(num_outstanding=0, deps=(b_dq, b_dp))
    # dO's rows from n on are the next sequence's: out of dPm, so out of dK
    b_dpm = gl.where((ri[:, None] >= cj[None, :]) & (ri[:, None] < n), b_dp * scale, 0.0).to(dt)
    b_dq = warpgroup_mma(gl.convert_layout(b_dpm, register_operand(acc_d)), k_s, b_dq * scale, is_async=True)
    publish(dpm_s, b_dpm)
    mbarrier.wait(ready.index(2), 0)
    b_dk = warpgroup_mma(dpm_s.permute((1, 0)), q_s, gl.zeros([C, D], gl.float32, layout=acc_d), use_acc=False,
                         is_async=True)
    b_dk = warpgroup_mma(vn_s, dh_s.permute((1, 0)), b_dk, is_async=True)
    b_dq = warpgroup_mma_wait(num_outstanding=2, deps=(b_dq, ))
    o_d = rd[:, None] * (H * D) + cd[None, :]
    gl.store(tile_rows(dq, start, i_h, H, D) + o_d, b_dq.to(dt), mask=rd[:, None] < n)
    mbarrier.wait(dx_ready, 0)
    b_dk = warpgroup_mma(dx_s, s_s.permute((1, 0)), b_dk, is_async=True)
    mbarrier.wait(r_ready, 0)
    r_hi, r_lo = pair_s.index(0), pair_s.index(1)
    b_dk = warpgroup_mma(r_hi.permute((1, 0)), k_s, b_dk, is_async=True)
    b_dk = warpgroup_mma(r_lo.permute((1, 0)), k_s, b_dk, is_async=True)
    b_dk = warpgroup_mma(r_hi, k_s, b_dk, is_async=True)
    b_dk = warpgroup_mma(r_lo, k_s, b_dk, is_async=True)
    b_dk = warpgroup_mma_wait(num_outstanding=0, deps=(b_dk, ))
    gl.store(tile_rows(dk, start, i_h, H, D) + o_d, b_dk.to(dt), mask=rd[:, None] < n)


@gluon.jit
def gluon_grad_kernel(q_desc, k_desc, v_desc, do_desc, dvp_desc, s_desc, dh_desc, t_desc, beta, dq, dk, dv, dbeta,
                      chunk_indices, cu_seqlens, scale, H: gl.constexpr, LOADER_REGS: gl.constexpr,
                      DQDK_WARPS: gl.constexpr, DQDK_REGS: gl.constexpr, num_warps: gl.constexpr):
    C: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    dt: gl.constexpr = q_desc.dtype
    i_t, i_h = gl.program_id(0), gl.program_id(1)
    i_n = gl.load(chunk_indices + 2 * i_t)
    bos = gl.load(cu_seqlens + i_n)
    start = bos + gl.load(chunk_indices + 2 * i_t + 1) * C
    n = gl.minimum(gl.load(cu_seqlens + i_n + 1) - start, C)  # the chunk's tokens: rows from n on are not its own

    tile: gl.constexpr = q_desc.layout
    bufs = (gl.allocate_shared_memory(dt, [C, D], tile), gl.allocate_shared_memory(dt, [C, D], tile),
            gl.allocate_shared_memory(dt, [C, D], tile), gl.allocate_shared_memory(dt, [C, D], tile),
            gl.allocate_shared_memory(dt, [C, D], tile), gl.allocate_shared_memory(dt, [D, D], s_desc.layout),
            gl.allocate_shared_memory(dt, [D, D], s_desc.layout),
            gl.allocate_shared_memory(gl.float32, [C, C], t_desc.layout))
    vn_s = gl.allocate_shared_memory(dt, [C, D], tile)
    dx_s = gl.allocate_shared_memory(dt, [C, D], tile)
    small: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, C], dt)
    pair_s = gl.allocate_shared_memory(dt, [2, C, C], small)
    dpm_s = gl.allocate_shared_memory(dt, [C, C], small)
    ready = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    hand = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())  # vn, dx, r ready
    for j in gl.static_range(3):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(hand.index(j), count=1)

    gl.warp_specialize([
        (wy_partition, (bufs, vn_s, dx_s, pair_s, ready, hand.index(0), hand.index(1), hand.index(2), beta, dv, dbeta,
                        start, n, i_h, H, C, D, num_warps)),
        (dqdk_partition, (bufs, vn_s, dx_s, pair_s, dpm_s, ready, hand.index(0), hand.index(1), hand.index(2), dq, dk,
                          scale, start, n, i_h, H, C, D)),
        (loader_partition, ((q_desc, k_desc, v_desc, do_desc, dvp_desc, s_desc, dh_desc, t_desc), bufs, ready, start,
                            i_t, i_h, H, C, D)),
    ], [DQDK_WARPS, 1], [DQDK_REGS, LOADER_REGS])


def check_grad_inputs(q, k, v, beta, tinv, h, dh, dv_prime, do, info: SeqInfo) -> None:
    """gluon_walk.check_inputs on the token tensors, and the states, T~ and beta against them (TMA: contiguous,
    16-byte aligned)."""
    check_inputs("gluon_grad", dict(q=q, k=k, v=v, dv_prime=dv_prime, do=do), info)
    TT, H, D = info.total_tokens, k.shape[2], k.shape[3]
    NT = info.chunks(C_WALK).num_chunks
    for name, x in (("h", h), ("dh", dh)):
        if x.dtype != k.dtype or tuple(x.shape) != (NT, H, D, D) or not x.is_contiguous() or x.data_ptr() % 16:
            raise ValueError(f"gluon_grad: {name} must be contiguous 16-byte aligned [{NT}, {H}, {D}, {D}] in "
                             f"{k.dtype}, got {tuple(x.shape)} {x.dtype}")
    if (tinv.dtype != torch.float32 or tinv.numel() != TT * H * C_WALK or tuple(tinv.shape[-2:]) != (H, C_WALK)
            or not tinv.is_contiguous() or tinv.data_ptr() % 16):
        raise ValueError(f"gluon_grad: tinv must be the forward's contiguous fp32 [1, {TT}, {H}, {C_WALK}], got "
                         f"{tuple(tinv.shape)} {tinv.dtype}")
    if beta.numel() != TT * H or beta.shape[-1] != H or not beta.is_contiguous() or not beta.is_floating_point():
        raise ValueError(f"gluon_grad: beta must be contiguous floats of {TT} tokens of {H} heads, got "
                         f"{tuple(beta.shape)} {beta.dtype}")


def gluon_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, tinv: torch.Tensor,
               h: torch.Tensor, dh: torch.Tensor, dv_prime: torch.Tensor, do: torch.Tensor, scale: float,
               info: SeqInfo, chunk_size: int = C_WALK
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dqkw + wy_bwd's contract: (dq in q's dtype, dk in k's, dv in v's, dbeta fp32 in beta's shape), on q, k, v,
    dv_prime, do [B, T, H, 128] or packed [1, TT, H, 128] of one 16-bit dtype, h and dh [NT, H, 128, 128] in that
    dtype, tinv [1, TT, H, 64] fp32, beta [.., H]; all contiguous (the descriptors and the stores address row r
    of head h at r * H * 128 + h * 128). With no tokens at all nothing is launched (a TMA descriptor's shape must
    be positive) and the outputs are empty."""
    if chunk_size != C_WALK:
        raise ValueError(f"gluon_grad: chunk_size {C_WALK} only, got {chunk_size}")
    check_grad_inputs(q, k, v, beta, tinv, h, dh, dv_prime, do, info)
    TT, H, D, C = info.total_tokens, k.shape[2], k.shape[3], C_WALK
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dbeta = torch.empty(beta.shape, dtype=torch.float32, device=beta.device)
    NT = info.chunks(C).num_chunks
    if NT == 0 or H == 0:
        return dq, dk, dv, dbeta
    # [TT, H * 128] per token tensor, tile [C, 128] at (row, head * 128); the states [NT * H * 128, 128], tile
    # [128, 128] at ((chunk * H + head) * 128, 0); T~ [TT, H * C] fp32, tile [C, C] at (row, head * C): each view's
    # shape and strides given directly (the tensors are contiguous: checked), no reshape. Rows past TT are TMA's
    # zero fill
    descs = tma_descriptors([(x, D) for x in (q, k, v, do, dv_prime)], TT, H)
    descs += [TensorDescriptor(x, [NT * H * D, D], [D, 1], [D, D], tile_layout(k.dtype, D, D)) for x in (h, dh)]
    descs.append(TensorDescriptor(tinv, [TT, H * C], [H * C, 1], [C, C],
                                  gl.NVMMASharedLayout.get_default_for([C, C], gl.float32)))
    launch(gluon_grad_kernel, (NT, H), *descs, beta, dq, dk, dv, dbeta, info.chunks(C).chunk_indices,
           info.cu_seqlens, scale, H, LOADER_REGS, DQDK_WARPS, DQDK_REGS, num_warps=4)
    return dq, dk, dv, dbeta
