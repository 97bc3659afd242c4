"""Stage 4 of the chunk forward: the serial pass over chunks (DESIGN.md §2), in variants of one kernel.

One program per (V-block, sequence, head) walks the chunks of its sequence with the state block
S [K, BV] in registers (fp32). Per chunk, with S the state entering it:
    V' = U - W S                    (S rounded to the input dtype for the product, V' rounded to it)
    S  = S + K^T V'
By variant (FUSE_OUTPUT):
    state_fwd (the unfused stage contract, and the backward's recompute where W, U come from HBM): writes
        h[chunk] = S (in the input dtype) and V' (v_new), which output.output_fwd and the backward stages
        read back;
    state_output_fwd (the forward, where fused_output_pays): writes the chunk's output while S and V' are
        on chip,
        O = scale (Q S + (Q K^T ⊙ M) V')      (M keeping j <= i; output.causal_output, the same rounding)
    and neither h nor V': no output launch, no h / V' round trip through HBM. S is whole in K, so Q is
    loaded whole [C, K] (no K loop as in output.py) and Q K^T is one product with the K^T tile the walk
    loads anyway. It depends on K only and is recomputed by every V-block program of a head (C^2 K flops
    per chunk and V-block): the price of V-blocking, the walk's only parallelism besides sequences x heads.
and, of the plain walk (WY_ON_CHIP):
    state_wy_fwd (the backward's recompute, where wy_on_chip): W and U are not read but computed per chunk
        from the stored Tinv, beta and the K, V tiles, with wy.py's products (wy.tinv_beta_pair,
        wy.wy_product: the same bits as wy.recompute_w_u), so no recompute_w_u launch and U never reaches
        HBM; the V-block-0 programs write W, which the reverse state pass reads. Like Q K^T above, W is
        recomputed by every V-block program of a head.
The loads of W, U, K (and Q, or Tinv, beta, V) do not depend on S, so the compiler fetches the next chunk's
tiles while the current chunk's products run. The W, U products do not depend on S either, but triton 3.6
does not overlap them with the chain's products: it waits for every product of the loop right after issuing
it, in program order (offline sm_90 TTGIR, K = 128 bf16), so within a program they lengthen each chunk's
step; the second program an SM holds (16-bit, K <= 128) is what can fill the tensor cores meanwhile. The
fused walk has a variant on S^T (transposed_walk), run where transposed_walk_pays, in which two of its five
products are left in flight; on Hopper, from 16 sequences x heads, state_output_fwd runs gluon_walk.py's
warp-specialized kernel instead (gluon_walk_pays), where the chain's two products, the output's three and the
loads run in separate warps. state_final_fwd (the sequence split's pass 1) gives state_output_fwd's final states
alone: from that kernel without its output partition where it runs, else from state_output_fwd itself."""
from __future__ import annotations

import functools
import importlib
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..launch import launch
from ..utils import (INTERPRET, PIPELINE_STAGES, SeqInfo, cdiv, dot_precision, head_block, load_rows, mm,
                     state_block_v, state_offsets)
from .output import causal_output
from .output_bwd import causal_scores_t
from .wy import tinv_beta_pair, wy_product


@triton.jit
def state_fwd_kernel(q, k, v, beta, tinv, w, u, h0, h, v_new, o, ht, scale, cu_seqlens, chunk_offsets,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, FUSE_OUTPUT: tl.constexpr,
                     WY_ON_CHIP: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                     TRANSPOSED: tl.constexpr):
    """FUSE_OUTPUT: writes o (from q, scale); else h and v_new (q, o, scale unused). TRANSPOSED (with
    FUSE_OUTPUT only): the fused walk on S^T, transposed_walk.
    WY_ON_CHIP: W and U's V-block computed from tinv, beta, k, v (SPLIT: Tinv diag(beta) as a 16-bit
    pair, wy.tinv_beta_pair), W written to w by the V-block-0 programs, u unused; else W, U read from w, u
    (v, beta, tinv unused)."""
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    if TRANSPOSED:  # its own state tile (S^T) and offsets
        transposed_walk(q, k, w, u, h0, o, ht, scale, bos, eos, i_nh, i_h, i_v, H, K, V, C, BK, BV, HAS_H0,
                        STORE_HT, PRECISION)
        return
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
        if not FUSE_OUTPUT:
            h_kv, _ = state_offsets((first_chunk + i_t) * H + i_h, 0, i_v * BV, K, V, BK, BV)
            tl.store(h + h_kv, b_s.to(h.dtype.element_ty), mask=m_kv)

        o_qk = (start + rows[:, None]) * (H * K) + i_h * K + ck[None, :]
        m_qk = m_rows[:, None] & (ck[None, :] < K)
        # K^T [BK, C], loaded transposed
        b_kt = tl.load(k + (start + rows[None, :]) * (H * K) + i_h * K + ck[:, None],
                       mask=(ck[:, None] < K) & m_rows[None, :], other=0.0)
        o_uv = (start + rows[:, None]) * (H * V) + i_h * V + cv[None, :]
        m_uv = m_rows[:, None] & (cv[None, :] < V)
        if WY_ON_CHIP:
            # W = (Tinv diag(beta)) K and U's V-block = (Tinv diag(beta)) V, by wy.py's products (the same
            # bits as recompute_w_u's W, U). They do not depend on S: off the chain S -> V' -> S
            dt = k.dtype.element_ty
            b_t = load_rows(tinv, start, eos - start, i_h, 0, H, C, C, C)
            b_tb_hi, b_tb_lo = tinv_beta_pair(b_t, beta + start * H + i_h, eos - start, H, C, dt)
            b_w = wy_product(b_tb_hi, b_tb_lo, tl.trans(b_kt), SPLIT, PRECISION).to(dt)
            b_v = tl.load(v + o_uv, mask=m_uv, other=0.0)
            b_u = wy_product(b_tb_hi, b_tb_lo, b_v, SPLIT, PRECISION).to(dt)
            if i_v == 0:  # W is the same in every V-block program; the reverse pass reads it
                tl.store(w + o_qk, b_w, mask=m_qk)
        else:
            b_w = tl.load(w + o_qk, mask=m_qk, other=0.0)
            b_u = tl.load(u + o_uv, mask=m_uv, other=0.0)

        # S in the input dtype: what h holds for the unfused output stage
        b_sd = b_s.to(b_w.dtype)
        b_vn = b_u.to(tl.float32) - mm(b_w, b_sd, PRECISION)
        b_vn = b_vn.to(b_u.dtype)
        if FUSE_OUTPUT:
            # Q S with the S entering the chunk; the rest of O after S moves on (fewer registers live at
            # once than the whole of O first: offline sm_90 compile)
            b_q = tl.load(q + o_qk, mask=m_qk, other=0.0)
            b_qs = mm(b_q, b_sd, PRECISION)
        else:
            tl.store(v_new + o_uv, b_vn, mask=m_uv)
        b_s += mm(b_kt, b_vn, PRECISION)
        if FUSE_OUTPUT:
            b_o = causal_output(b_qs, mm(b_q, b_kt, PRECISION), b_vn, scale, C, PRECISION)
            tl.store(o + o_uv, b_o.to(o.dtype.element_ty), mask=m_uv)

    if STORE_HT:
        tl.store(ht + o_kv, b_s, mask=m_kv)


@triton.jit
def transposed_walk(q, k, w, u, h0, o, ht, scale, bos, eos, i_nh, i_h, i_v, H: tl.constexpr, K: tl.constexpr,
                    V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr,
                    STORE_HT: tl.constexpr, PRECISION: tl.constexpr):
    """The fused walk of one program on S^T [BV, BK] (state_fwd_kernel's TRANSPOSED), the same products
    transposed:
        V'^T = U^T - S^T W^T,   O^T = scale (V'^T (Q K^T ⊙ M)^T + S^T Q^T),   S^T += V'^T K
    so that every product has its computed operand (S^T or V'^T, rounded to the input dtype) on the left,
    which a Hopper product reads from registers, and a loaded tile on the right: neither S nor V' is written
    to shared memory. triton 3.6 leaves a product in flight past the next ones (no wait after it) only when
    its result is merely carried to the next iteration and its shared-memory operand is a pipelined load:
    here the state update and the last product of O^T, issued back to back at the end of a chunk; O^T is
    stored in the next iteration (the last chunk's after the loop), after Q K^T's wait, which completes both.
    In the plain orientation every product but Q K^T has S or V' in shared memory, so all of them wait at
    once (offline sm_90 TTGIR, triton 3.6)."""
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    dt = k.dtype.element_ty
    m_vk = (cv[:, None] < V) & (ck[None, :] < K)
    o_vk = i_nh.to(tl.int64) * K * V + ck[None, :] * V + cv[:, None]  # S^T's [BV, BK] slice of [K, V]
    if HAS_H0:
        b_st = tl.load(h0 + o_vk, mask=m_vk, other=0.0).to(tl.float32)
    else:
        b_st = tl.zeros([BV, BK], dtype=tl.float32)
    b_ot = tl.zeros([BV, C], dtype=tl.float32)  # the previous chunk's O^T, unscaled

    num_chunks = tl.cdiv(eos - bos, C).to(tl.int32)
    for i_t in range(0, num_chunks):
        start = bos + i_t * C
        m_rows = rows < eos - start
        o_kt = (start + rows[None, :]) * (H * K) + i_h * K + ck[:, None]
        m_kt = (ck[:, None] < K) & m_rows[None, :]
        b_k = tl.load(k + (start + rows[:, None]) * (H * K) + i_h * K + ck[None, :],
                      mask=m_rows[:, None] & (ck[None, :] < K), other=0.0)
        b_qt = tl.load(q + o_kt, mask=m_kt, other=0.0)  # Q^T [BK, C], W^T alike
        b_wt = tl.load(w + o_kt, mask=m_kt, other=0.0)
        b_ut = tl.trans(tl.load(u + (start + rows[:, None]) * (H * V) + i_h * V + cv[None, :],
                                mask=m_rows[:, None] & (cv[None, :] < V), other=0.0))
        # (Q K^T ⊙ M)^T: no S in it, so first; its wait completes the previous chunk's products in flight.
        # Unscaled (scale is applied to O^T), rounded as causal_output rounds Q K^T in the walk on S
        b_pt = causal_scores_t(mm(b_k, b_qt, PRECISION), 1.0, C, dt)
        # the previous chunk's O (whole: only a sequence's last chunk is partial); none before chunk 0
        o_vt = (start + rows[None, :]) * (H * V) + i_h * V + cv[:, None]
        tl.store(o + o_vt - C * H * V, (b_ot * scale).to(o.dtype.element_ty),
                 mask=(cv[:, None] < V) & (rows[None, :] < C * tl.minimum(i_t, 1)))
        b_sd = b_st.to(dt)
        b_vnt = (b_ut.to(tl.float32) - mm(b_sd, b_wt, PRECISION)).to(dt)
        b_pv = mm(b_vnt, b_pt, PRECISION)
        # left in flight: both results only carried
        b_st += mm(b_vnt, b_k, PRECISION)
        b_ot = b_pv + mm(b_sd, b_qt, PRECISION)

    last = bos + (num_chunks - 1) * C
    o_vt = (last + rows[None, :]) * (H * V) + i_h * V + cv[:, None]
    tl.store(o + o_vt, (b_ot * scale).to(o.dtype.element_ty),
             mask=(cv[:, None] < V) & (rows[None, :] < (eos - last) * tl.minimum(num_chunks, 1)))
    if STORE_HT:
        tl.store(ht + o_vk, b_st, mask=m_vk)


# Which orientation the fused walk runs: None chooses by transposed_walk_pays; True or False force the walk on
# S^T (16-bit only) or on S (the tests and benchmarks/diagnostics/transposed_walk.py run both)
TRANSPOSED_WALK: Optional[bool] = None


def transposed_walk_pays(K: int, BV: int, element_size: int) -> bool:
    """Whether the fused walk runs on S^T (transposed_walk) rather than S: 16-bit, K = 128, 128-wide
    V-blocks. On the H200 (transposed_walk.py, bf16, same W, U; the state bitwise equal, o within 2e-5):
    8 x 16 heads at K = V = 128 (BV = 128, 8 warps) 0.182 -> 0.147 ms; but 4 x 16 heads (BV = 64) 0.264 ->
    0.297 and K = V = 64 at 16 x 8 heads 0.082 -> 0.089, slower. Offline sm_90 (triton 3.6) at BV = 128:
    232 registers and no spills against 255 and 92 B, 110,592 B of shared memory against 163,840. Not
    measured at other head sizes. Below BV = 64 the S^T products fall back to mma.sync (their M is the
    V-block), and fp32 at K = 256 would need 233,472 B of shared memory."""
    return element_size == 2 and K == 128 and BV == 128


@functools.lru_cache(maxsize=None)
def walk_launch(K: int, V: int, num_states: int, element_size: int, fused: bool) -> Tuple[int, int]:
    """(V-block, warps) of the walk: state_block_v's V-block on 4 warps, with two exceptions.

    The plain walk at K = 256 in 16-bit: a [256, 64] state, not [256, 32]. One program per SM either way (by
    shared memory: 180,224 B), and 32-wide products leave the tensor cores mostly idle, so half as many
    programs of twice the width. On 4 warps, not 8: 255 registers and 124-192 B of spills (offline sm_90
    compile, triton 3.6) against 194 and none, yet on the H200 the state pass at 4 x 16 heads took 0.422 ms
    against 0.471 on 8 warps (0.750 at [256, 32]), with bitwise-equal outputs.

    The fused state+output walk holds Q's tiles besides W's and K's: at K = 128 (bf16) 131,072 B of shared
    memory at BV = 64 against 98,304 for the plain walk, so one program per SM, not two. At 8 x 16 heads
    the plain walk runs its 256 programs in one wave on 132 SMs and the fused one would take two; so a
    [128, 128] state (one program per head at V = 128, Q K^T not recomputed) on 8 warps, which hold it in as
    many registers a thread as 4 warps hold [128, 64]: 255 registers, 92 B of spills, 163,840 B; halved while
    there are fewer than 128 programs. fp32 tiles are twice as large: the fused walk's BV at most 32 at
    K = 128 and 16 at K = 256 (237,568 B at 32, over sm_90's 232,448)."""
    BK = head_block(K)
    if fused and BK == 128:
        BV, warps = state_block_v(K, V, num_states, max_tile=16384), 8
    elif not fused and BK >= 256 and element_size == 2:
        BV, warps = state_block_v(K, V, num_states, max_tile=16384), 4
    else:
        BV, warps = state_block_v(K, V, num_states), 8 if BK >= 256 else 4
    if fused and element_size == 4:
        BV = min(BV, 16 if BK >= 256 else 32)
    return BV, warps


@functools.lru_cache(maxsize=None)
def wy_on_chip(K: int, V: int, num_states: int, element_size: int) -> bool:
    """Whether the backward's walk computes W, U on chip (state_wy_fwd) rather than reading them from
    wy.recompute_w_u's launch: 16-bit inputs, K up to 64, or K = 128 with whole V-blocks, and V-blocks 64
    wide (or the whole of V). The variant runs on the plain walk's launch (walk_launch); offline sm_90
    compile, triton 3.6, bf16 (plain walk in brackets), registers / spills / shared memory / programs per SM:

        K = V = 64,  BV = 64, 4 warps:  240 / 0 / 65,536 / 2     (124 / 0 / 57,344 / 4)
        K = V = 128, BV = 64, 4 warps:  255 / 36 / 90,112 / 2    (166 / 0 / 98,304 / 2)
        K = V = 256, BV = 64, 4 warps:  255 / 940 / 139,264 / 1  (255 / 124 / 180,224 / 1); 8 warps 420 B
        K = V = 100, BV = 64, 4 warps:  255 / 386 / 98,304 / 2   (244 / 0 / 106,496 / 2)
        K = 128, V = 100:               255 / 196 / 98,304 / 2   (208 / 0 / 106,496 / 2)

    (K = 64 with V = 100 or 256: 252-255 registers, no spills.) So the old path where the variant spills
    hundreds of bytes: K = 256, and heads whose K or V-block columns are masked at K = 128 (the masks of a
    non-power-of-two head take registers). fp32 keeps the old path too: its ieee products are FMA loops
    that spill in every walk, and the variant about doubles that (K = 64: 18 KB -> 37 KB of spills; K = 128:
    46 -> 55 KB). Narrow V-blocks (few sequences x heads) keep it because every V-block program recomputes
    W: on the H200 the fused forward walk, which recomputes the cheaper Q K^T the same way, ran 1.50 ms
    against 0.92 at 1 x 16 heads (BV = 16; fused_output_pays)."""
    BV, _ = walk_launch(K, V, num_states, element_size, fused=False)
    wide = BV >= min(64, head_block(V))
    spill_free = head_block(K) <= 64 or (K == 128 and V % BV == 0)
    return element_size == 2 and wide and spill_free


def _state_pass(q, k, w, u, wy_inputs, scale, initial_state, output_final_state, info, chunk_size, h, v_new, o):
    """Launches the walk: the fused variant when o is given (then h, v_new are None), else the plain one;
    with wy_inputs = (v, beta, tinv), W and U computed on chip (W written to w, u None). Returns the final
    state [N, H, K, V] fp32, or None."""
    v, beta, tinv = (None, None, None) if wy_inputs is None else wy_inputs
    H, K, V = k.shape[2], k.shape[3], (u if v is None else v).shape[3]
    N = info.num_seqs
    final_state = k.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    fused = o is not None
    BV, warps = walk_launch(K, V, N * H, k.element_size(), fused)
    transposed = fused and k.element_size() == 2 and (
        transposed_walk_pays(K, BV, k.element_size()) if TRANSPOSED_WALK is None else TRANSPOSED_WALK)
    if N * H:
        launch(
            state_fwd_kernel, (N * H, cdiv(V, BV)),
            q, k, v, beta, tinv, w, u, initial_state, h, v_new, o, final_state, scale, info.cu_seqlens,
            info.chunks(chunk_size).chunk_offsets, H, K, V, chunk_size, head_block(K), BV,
            initial_state is not None, output_final_state, fused, wy_inputs is not None,
            k.dtype != torch.float32, dot_precision(k.dtype), transposed, num_warps=warps,
            num_stages=PIPELINE_STAGES,
        )
    return final_state


# Whether the fused walk runs as gluon_walk.py's warp-specialized kernel where it can (gluon_walk_applies): None
# chooses by the number of sequences x heads (gluon_walk_pays); True or False force it or the Triton walk (tests,
# benchmarks/diagnostics/gluon_walk.py)
GLUON_WALK: Optional[bool] = None
GLUON_WALK_MIN_PROGRAMS = 16  # sequences x heads: the fewest it was measured faster at (gluon_walk_pays)

# Whether the forward runs the Gluon walk in its residual form (gluon_walk_kernel's RESIDUAL: V' = Tb (V - K S) from
# wy.tinv_pair_fwd's Tb, so no W, U are made) where the Gluon walk runs on whole sequences (residual_walk_runs; the
# measurements are there; the sequence split's walks: seq_split.RESIDUAL_SPLIT, which needs this on too). False: the
# W, U form everywhere (tests, benchmarks/diagnostics/residual_walk.py).
RESIDUAL_WALK = True


@functools.lru_cache(maxsize=None)
def gluon_importable(module: str) -> bool:
    """Whether this triton has the Gluon Hopper API that the Gluon kernel module (gluon_walk, gluon_reverse) is
    written against (triton 3.6's)."""
    try:
        importlib.import_module(f"{__package__}.{module}")
    except (ImportError, AttributeError):
        return False
    return True


@functools.lru_cache(maxsize=None)
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def gluon_walk_applies(k: torch.Tensor, v: torch.Tensor, chunk_size: int) -> bool:
    """Where the Gluon walk can run: a Hopper GPU (sm_90: wgmma, TMA, setmaxnreg; not the interpreter), 16-bit,
    K = V = 128, C = 64, and a triton with Gluon's Hopper API."""
    return (k.is_cuda and not INTERPRET and k.dtype in (torch.bfloat16, torch.float16) and chunk_size == 64
            and k.shape[3] == 128 and v.shape[3] == 128 and _is_sm90(k.device.index) and gluon_importable("gluon_walk"))


def gluon_walk_pays(k: torch.Tensor, v: torch.Tensor, info: SeqInfo, chunk_size: int) -> bool:
    """Whether the fused walk runs as the Gluon kernel (one or two programs per sequence and head, gluon_walk.
    split_v; the chain, the output and the loads in separate warps). On the H200 (benchmarks/diagnostics/
    gluon_walk.py, bf16; o within 2e-5 of the Triton walk, the final state bitwise equal), Triton walk against
    the Gluon walk at split_v's width, ms: 8 x 16 heads 0.146 / 0.105, 4 x 16 0.264 / 0.107, 2 x 32
    0.511 / 0.205, 1 x 64 (T = 32768) 1.982 / 1.307 at BV = 128 (session 9; split since); 1 x 16 (T = 32768)
    1.513 / 0.721, where the forward runs its unfused Triton stages (fused_output_pays): whole forward 1.256
    against 1.059 ms with the Gluon walk (session 10). So from GLUON_WALK_MIN_PROGRAMS sequences x heads, the
    fewest measured; below, unmeasured, the Triton stages (the unfused ones, which split V finer)."""
    if not gluon_walk_applies(k, v, chunk_size):
        return False
    return info.num_seqs * k.shape[2] >= GLUON_WALK_MIN_PROGRAMS if GLUON_WALK is None else GLUON_WALK


def tma_ready(*xs: torch.Tensor) -> bool:
    """Whether TMA descriptors can take these tensors as the Gluon walk lays them out: contiguous, 16-byte aligned."""
    return all(x.is_contiguous() and x.data_ptr() % 16 == 0 for x in xs)


def gluon_walk_runs(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, info: SeqInfo,
                    chunk_size: int) -> bool:
    """Whether state_output_fwd (and state_final_fwd) run the Gluon kernel: where gluon_walk_pays, on tensors TMA
    takes (tma_ready)."""
    return gluon_walk_pays(k, u, info, chunk_size) and tma_ready(q, k, w, u)


def residual_walk_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: SeqInfo, chunk_size: int) -> bool:
    """Whether the forward's walk runs in the residual form (RESIDUAL_WALK): where the Gluon walk runs
    (gluon_walk_pays) on q, k, v as TMA takes them (tma_ready; Tb is made contiguous). The caller checks that no
    sequence split runs and no states are kept (both need W). On the H200 (benchmarks/diagnostics/
    residual_walk.py, bf16, session 18; fastest of three interleaved readings, W, U form / residual, ms), the WY
    stage storing T~: 8 x 16 heads, T = 2048, 0.165 / 0.122; 4 x 16, T = 4096, 0.164 / 0.124; 2 x 32, T = 8192,
    0.319 / 0.240; 20 sequences x 16 heads, 32,768 tokens, 0.325 / 0.242. The walk, one more product on its chain:
    0.109 / 0.113, 0.105 / 0.107, 0.201 / 0.211, 0.310 / 0.331 (the varlen batch's two long sequences set its
    pace there). The inference forward 0.259 / 0.220, 0.261 / 0.218, 0.525 / 0.432 (the varlen batch's readings
    spread over 0.65-0.83 either way); forward+backward 1.117 / 1.080, 1.212 / 1.165, 2.410 / 2.329, 2.754 /
    2.692, with bitwise the same gradients (the backward reads only T~)."""
    return RESIDUAL_WALK and gluon_walk_pays(k, v, info, chunk_size) and tma_ready(q, k, v)


def fused_output_pays(k: torch.Tensor, v: torch.Tensor, info: SeqInfo, chunk_size: int) -> bool:
    """Whether the forward runs the fused walk (state_output_fwd) rather than state_fwd + output_fwd. Measured
    on the H200 (stage_times, bf16, 2026-11-30), fused against plain, ms: at K = V = 128, 0.181 / 0.243 with
    8 x 16 heads (BV = 128), 0.263 / 0.275 with 4 x 16 and 0.513 / 0.537 with 2 x 32 (BV = 64), but
    1.496 / 0.922 with 1 x 16 (BV = 16: the walk is the critical path there, and every V-block program
    recomputes Q K^T on it); at K = V = 64 with 16 x 8 heads 0.084 / 0.124; at K = V = 256 with 4 x 16 heads
    1.302 / 1.055. So the fused walk runs where it was measured faster: 16-bit inputs, K up to 128 and a
    V-block at least 64 wide."""
    if gluon_walk_pays(k, v, info, chunk_size):
        return True
    K, V = k.shape[3], v.shape[3]
    BV, _ = walk_launch(K, V, info.num_seqs * k.shape[2], k.element_size(), fused=True)
    return k.element_size() == 2 and head_block(K) <= 128 and BV >= 64


def state_fwd(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, initial_state: Optional[torch.Tensor],
              output_final_state: bool, info: SeqInfo,
              chunk_size: int) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Returns (h [NT, H, K, V]: the state entering each chunk, in the input dtype; v_new [B, T, H, V] =
    U - W S, input dtype; final_state [N, H, K, V] fp32 or None). initial_state: [N, H, K, V] or None.
    A sequence of length 0 passes its initial state (or zeros) through."""
    H, K, V = k.shape[2], k.shape[3], u.shape[3]
    h = k.new_empty(info.chunks(chunk_size).num_chunks, H, K, V)
    v_new = torch.empty_like(u)
    final_state = _state_pass(None, k, w, u, None, None, initial_state, output_final_state, info, chunk_size, h,
                              v_new, None)
    return h, v_new, final_state


def state_wy_fwd(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, tinv: torch.Tensor,
                 initial_state: Optional[torch.Tensor], output_final_state: bool, info: SeqInfo,
                 chunk_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """wy.recompute_w_u and state_fwd in one launch: the walk computes each chunk's W = Tinv (beta*K) and
    U = Tinv (beta*V) on chip from the stored Tinv, with wy.py's products, so U never reaches HBM. Returns
    (w [B, T, H, K]: recompute_w_u's W, bit for bit, for the reverse state pass; h, v_new, final_state as
    state_fwd's)."""
    H, K, V = k.shape[2], k.shape[3], v.shape[3]
    w = torch.empty_like(k)
    h = k.new_empty(info.chunks(chunk_size).num_chunks, H, K, V)
    v_new = torch.empty_like(v)
    final_state = _state_pass(None, k, w, None, (v, beta, tinv), None, initial_state, output_final_state, info,
                              chunk_size, h, v_new, None)
    return w, h, v_new, final_state


def states_shapes(H: int, K: int, V: int, info: SeqInfo, chunk_size: int):
    """The shapes of states_buffers'."""
    NT = info.chunks(chunk_size).num_chunks
    return (NT, H, V, K), (NT, H, V, chunk_size)


def states_buffers(k: torch.Tensor, v: torch.Tensor, info: SeqInfo,
                   chunk_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The per-chunk states a training forward keeps for the backward (chunk_delta_rule's save_states), as the Gluon
    walk stores them from its hand-off (state_output_fwd's states) and output_bwd.dqkw reads them (states_t), in
    k's dtype: st [NT, H, V, K], st[c, h] = S_c^T, the state entering chunk c (rounded as the walk's operand); vt
    [NT, H, V, C], vt[c, h, :, i] = V' of the chunk's token i, zero past a sequence's end. NT and c: the batch's
    chunks in info.chunks' global order."""
    return tuple(k.new_empty(shape) for shape in states_shapes(k.shape[2], k.shape[3], v.shape[3], info, chunk_size))


def state_output_fwd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, scale: float,
                     initial_state: Optional[torch.Tensor], output_final_state: bool, info: SeqInfo,
                     chunk_size: int, states: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                     residual: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The state pass with the output fused in: (o [B, T, H, V] in the input dtype, final_state as
    state_fwd's). The same o as output.output_fwd on state_fwd's h and v_new, up to the order of fp32
    sums over K. As the Gluon kernel where gluon_walk_pays (TMA: q, k, w, u contiguous and 16-byte aligned,
    else the Triton walk). states (states_buffers; only where the Gluon walk runs): the walk also stores each
    chunk's S^T and V'^T there. residual (only where the Gluon walk runs): w is wy.tinv_pair_fwd's Tb and u is
    V, and the walk forms V' = Tb (V - K S) itself."""
    if gluon_walk_runs(q, k, w, u, info, chunk_size):
        from .gluon_walk import gluon_state_output_fwd
        return gluon_state_output_fwd(q, k, w, u, scale, initial_state, output_final_state, info, chunk_size,
                                      checked=True, states=states, residual=residual)
    if states is not None:
        raise ValueError("state_output_fwd: states are saved by the Gluon walk only (gluon_walk_runs is false here)")
    if residual:
        raise ValueError("state_output_fwd: the residual form (w = Tb, u = V) runs on the Gluon walk only "
                         "(gluon_walk_runs is false here)")
    o = torch.empty_like(u)
    final_state = _state_pass(q, k, w, u, None, scale, initial_state, output_final_state, info, chunk_size, None,
                              None, o)
    return o, final_state


def state_final_fwd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
                    initial_state: Optional[torch.Tensor], info: SeqInfo, chunk_size: int,
                    residual: bool = False) -> torch.Tensor:
    """state_output_fwd's final states [N, H, K, V] fp32, bit for bit, where no output is needed (the sequence
    split's pass 1). Where the Gluon kernel runs, its walk without the output (gluon_walk.gluon_state_final_fwd:
    no Q read, no output products, no O written); elsewhere state_output_fwd itself, its o dropped: the Triton
    walk has no variant that stores only the final state (the plain one writes h and V', more than o). residual:
    as state_output_fwd's (the Gluon walk's only)."""
    if gluon_walk_runs(q, k, w, u, info, chunk_size):
        from .gluon_walk import gluon_state_final_fwd
        return gluon_state_final_fwd(k, w, u, initial_state, info, chunk_size, checked=True, residual=residual)
    return state_output_fwd(q, k, w, u, 1.0, initial_state, True, info, chunk_size, residual=residual)[1]
