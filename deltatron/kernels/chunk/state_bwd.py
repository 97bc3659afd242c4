"""Reverse state pass of the chunk backward (DESIGN.md §3): the gradient of the state runs backwards over
the chunks of each sequence, from dht (or zero) after the last chunk to dh0 before the first:

    dV'  = dV'_local + K dS_next                       (full gradient of the new values)
    dS   = scale Q^T dO + dS_next - W^T dV'            (the gradient of the state entering the chunk)

with dV'_local = scale (Q K^T ⊙ M)^T dO (M keeping j <= i). Serial over chunks, parallel over
(sequence * head, V-blocks): the V columns of the state gradient are independent, and each program keeps
its [K, BV] slice in fp32 registers for the whole sequence.

One kernel, two variants (FUSE_DV_LOCAL):
    fused (the backward's path): dV'_local is computed here from the Q, K and dO tiles the pass loads
        anyway. Q and K are whole in K, so A^T = K Q^T is one product; it depends on K only and is
        recomputed by every V-block program of a head (C^2 K flops per chunk and V-block), in exchange for
        a launch and dV'_local's write and read through HBM;
    unfused: dV'_local is read from output_bwd.dv_local's output (the stage contract the tests check).
Both round A^T to the input dtype alike (output_bwd.causal_scores_t); the fused one keeps the local dV'
in fp32, where the unfused one has it rounded to the input dtype by its store."""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..launch import launch
from ..utils import (INTERPRET, PIPELINE_STAGES, cdiv, dot_precision, head_block, load_rows, mm, num_sms,
                     state_block_v, state_offsets, store_rows)
from .output_bwd import causal_scores_t
from .state import _is_sm90, gluon_importable


@triton.jit
def state_bwd_kernel(q, k, w, dout, dv_local, dht, dh, dv, dh0, cu_seqlens, chunk_offsets, scale,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                     STORE_OUTPUTS: tl.constexpr, FUSE_DV_LOCAL: tl.constexpr, PRECISION: tl.constexpr):
    """FUSE_DV_LOCAL: dV'_local computed here from q, k, dout (dv_local unused); else read from dv_local.
    STORE_OUTPUTS: dh and dv written; else not (dh, dv unused: the reverse split's pass 1, dh0 alone)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    first_chunk = tl.load(chunk_offsets + i_n)
    dt = dout.dtype.element_ty
    s_offs, s_mask = state_offsets(i_nh, 0, i_v * BV, K, V, BK, BV)
    b_dsn = tl.zeros([BK, BV], dtype=tl.float32)  # gradient of the state leaving the current chunk
    if USE_DHT:
        b_dsn += tl.load(dht + s_offs, mask=s_mask, other=0.0).to(tl.float32)
    num_chunks = tl.cdiv(eos - bos, C)
    for i in range(num_chunks):
        i_c = num_chunks - 1 - i
        start = bos + i_c * C
        n = eos - start  # tokens left in the sequence: rows from n on are masked
        c_offs, c_mask = state_offsets((first_chunk + i_c) * H + i_h, 0, i_v * BV, K, V, BK, BV)
        if STORE_OUTPUTS:
            tl.store(dh + c_offs, b_dsn.to(dh.dtype.element_ty), mask=c_mask)
        b_k = load_rows(k, start, n, i_h, 0, H, K, C, BK)
        b_q = load_rows(q, start, n, i_h, 0, H, K, C, BK)
        b_do = load_rows(dout, start, n, i_h, i_v * BV, H, V, C, BV)
        b_dv = mm(b_k, b_dsn.to(dt), PRECISION)
        if FUSE_DV_LOCAL:
            # Q and K are whole in K here, so A^T = K Q^T is one product; the local part stays in fp32
            b_at = causal_scores_t(mm(b_k, tl.trans(b_q), PRECISION), scale, C, dt)
            b_dv += mm(b_at, b_do, PRECISION)
        else:
            b_dv += load_rows(dv_local, start, n, i_h, i_v * BV, H, V, C, BV).to(tl.float32)
        if STORE_OUTPUTS:
            store_rows(dv, b_dv, start, n, i_h, i_v * BV, H, V, C, BV)
        b_w = load_rows(w, start, n, i_h, 0, H, K, C, BK).to(dt)
        b_dsn += scale * mm(tl.trans(b_q), b_do, PRECISION) - mm(tl.trans(b_w), b_dv.to(dt), PRECISION)
    if STORE_DH0:
        tl.store(dh0 + s_offs, b_dsn, mask=s_mask)


@functools.lru_cache(maxsize=None)
def reverse_launch(K: int, V: int, num_states: int, element_size: int, fused: bool,
                   sms: int) -> Tuple[int, int]:
    """(V-block, warps) of the reverse pass: state_block_v's V-block, on 4 warps (8 at K = 256), except:

    fp32 at K = 256: [C, 256] tiles, pipelined, leave no shared memory for BV = 32 (offline sm_90 compile,
    triton 3.6: 237,568 B, 232,448 allowed; benchmarks/diagnostics/offline_compile.py); 16 fits.

    The fused pass (FUSE_DV_LOCAL) at K = 128, and in fp32, on 8 warps: it holds A^T [C, C] (fp32, and
    rounded to the input dtype) beside the [K, BV] state gradient. Offline sm_90, triton 3.6, BV = 64 (the
    unfused pass on 4 warps in brackets): bf16 and fp16, K = 128: 4 warps 255 registers and 4 B of spills,
    8 warps 220 and none (255, 24 B), with 147,456 B of shared memory (139,264): one program per SM either
    way. K = 100: 8 warps 255 and 24 B (255, 260 B). fp32 (ieee dots: KBs of spills in every variant): 8
    warps about halve the fused pass's spills, K = 64 34 -> 12 KB, K = 128 62 -> 26 KB (22 KB, 44 KB).
    16-bit K <= 64 stays on 4 warps (K = 64: 178 registers, no spills, 81,920 B: two programs an SM), K = 256
    on 8 (255 registers, no spills, 229,376 B as unfused). On the H200 (stage_times, bf16, K = 128): 0.231 ms
    at 8 x 16 heads against 0.080 + 0.239 for dv_local and the unfused pass.

    The 16-bit fused pass at K = 128 takes the V-block up to 128 (state_block_v's 16384 tile: 255
    registers, 56 B of spills, 196,608 B; offline sm_90, triton 3.6) while its programs then fit one wave
    (sequences * heads at most the SMs; the interpreter, one program at a time, always), as the forward's
    fused walk does (state.walk_launch). At BV = 64 the pass holds one program per SM, so 8 x 16 heads ran
    256 programs in two waves on the H200's 132 SMs; at 128 they run in one, A^T = K Q^T computed once per
    head: 0.234 -> 0.183 ms, bitwise-equal outputs. Not beyond one wave: the 20-sequence varlen batch (320
    programs at 128) took 0.558 against 0.478 ms, the longest sequence's walk being the critical path.
    Not at K = 100 (280 B of spills, unmeasured)."""
    BK = head_block(K)
    wide = fused and K == 128 and element_size == 2 and (INTERPRET or num_states <= sms)
    BV = state_block_v(K, V, num_states, max_tile=16384 if wide else 8192)
    if element_size == 4 and BK >= 256:
        BV = min(BV, 16)
    warps = 8 if BK >= 256 or (fused and (BK == 128 or element_size == 4)) else 4
    return BV, warps


# Whether the fused pass runs as gluon_reverse.py's warp-specialized kernel where it can (gluon_reverse_applies):
# None chooses by the number of sequences x heads and their length (gluon_reverse_pays); True or False force it or
# the Triton pass (tests, benchmarks/diagnostics/gluon_reverse.py)
GLUON_REVERSE: Optional[bool] = None
GLUON_REVERSE_MIN_PROGRAMS = 16  # sequences x heads: the fewest it was measured faster at (gluon_reverse_pays)
GLUON_REVERSE_MIN_TOKENS = 2048  # mean tokens a sequence: the shortest the whole backward was measured faster at


def gluon_reverse_applies(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, do: torch.Tensor,
                          dv_local: Optional[torch.Tensor], chunk_size: int) -> bool:
    """Where the Gluon reverse pass can run: the fused pass (dv_local None) on a Hopper GPU (sm_90, not the
    interpreter), q, k, w, do of one 16-bit dtype, K = V = 128, C = 64, contiguous and 16-byte aligned (TMA),
    and a triton with Gluon's Hopper API."""
    return (dv_local is None and k.is_cuda and not INTERPRET and k.dtype in (torch.bfloat16, torch.float16)
            and all(x.dtype == k.dtype and x.shape[-1] == 128 and x.is_contiguous() and x.data_ptr() % 16 == 0
                    for x in (q, k, w, do))
            and chunk_size == 64 and _is_sm90(k.device.index) and gluon_importable("gluon_reverse"))


def gluon_reverse_pays(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, do: torch.Tensor,
                       dv_local: Optional[torch.Tensor], info, chunk_size: int) -> bool:
    """Whether state_bwd runs the Gluon reverse pass: where it applies and GLUON_REVERSE allows; with None, from
    GLUON_REVERSE_MIN_PROGRAMS sequences x heads up to one program a head per SM, on sequences of
    GLUON_REVERSE_MIN_TOKENS tokens or more on average. gluon_state_bwd splits V over two programs a head
    (block_v 64, gluon_walk.split_v) while that still fits one wave.

    Measured on the H200 (benchmarks/diagnostics/gluon_reverse.py, bf16, session 11; dh, dv, dh0 within 1.5e-3 to
    3.4e-3 of the Triton pass, reruns bitwise, block_v 64 bitwise equal to 128), Triton pass / Gluon block_v 128 /
    Gluon block_v 64, ms:
        8 x 16 heads, T = 2048:   0.201 / 0.163 / 0.173  (128 sequences x heads: split_v gives 128)
        4 x 16 heads, T = 4096:   0.230 / 0.291 / 0.167
        2 x 32 heads, T = 8192:   0.449 / 0.567 / 0.320-0.337
        1 x 64 heads, T = 32768:  1.757 / 2.233 / 1.295-1.316
        1 x 16 heads, T = 32768:  1.304 / 2.378 / 1.214
    Past one wave (varlen20 x 16 heads: 320) session 10 measured the Triton pass faster (0.471 / 0.521); below
    16 sequences x heads nothing was measured.

    The pass alone is not the whole story: its launch costs the host about 0.14 ms against the Triton pass's
    0.05 (4 x 16 heads, session 11), and the whole forward+backward through the API, which at these sizes
    keeps the host about as busy as the GPU (0.8-1.2 ms of host time a call), was slower with it where the
    backward is short. Forward+backward, do_bench, three interleaved readings each, Triton pass / Gluon, ms:
        8 x 16 heads, T = 2048:   1.214-1.219 / 1.235-1.407
        4 x 16 heads, T = 4096:   1.368-1.381 / 1.541-1.589
        2 x 32 heads, T = 8192:   2.717-2.723 / 2.555-2.563
        1 x 64 heads, T = 32768:  10.84-10.88 / 10.22-10.26
        1 x 16 heads, T = 32768:  4.303-4.306 / 4.171-4.179
    Since session 12 the Gluon pass launches through launch() with its descriptors cached per shape, and session
    16 measured the whole call again (bf16, the rule then at 8,192 tokens against GLUON_REVERSE = True, three
    interleaved readings each, ms; an uncommitted script making the calls that benchmarks/diagnostics/
    gluon_reverse.py's report now ends with, switch_probe.fwd_bwd_agree_and_time):
        8 x 16 heads, T = 2048:   1.201 / 1.181
        4 x 16 heads, T = 4096:   1.353 / 1.273-1.274
    Hence the length threshold at 2,048 tokens, the shortest measured; shorter sequences are not measured."""
    if GLUON_REVERSE is False:
        return False
    if GLUON_REVERSE is None:  # the rule first: it is cheaper than gluon_reverse_applies' checks of four tensors
        num_states = info.num_seqs * k.shape[2]
        if not (GLUON_REVERSE_MIN_PROGRAMS <= num_states <= num_sms(k.device)
                and info.total_tokens >= GLUON_REVERSE_MIN_TOKENS * info.num_seqs):
            return False
    return gluon_reverse_applies(q, k, w, do, dv_local, chunk_size)


def state_bwd(q, k, w, do, dv_local: Optional[torch.Tensor], dht: Optional[torch.Tensor], scale: float,
              need_dh0: bool, info, chunk_size: int, gluon: Optional[bool] = None, store_outputs: bool = True):
    """Returns (dh [NT, H, K, V]: gradient of the state leaving each chunk, in q's dtype (its consumer,
    dqkw, rounds it to that dtype before its products anyway), dv [1, TT, H, V] in do's dtype: the full
    dV', dh0 [N, H, K, V] fp32 or None). dv_local: the local dV' from output_bwd.dv_local, or None to
    compute it in this pass (fused: the backward's path; as the Gluon kernel where gluon_reverse_pays, or where
    gluon says so: the segmented backward decides once for the whole batch and passes it to every segment).
    Without store_outputs dh and dv are neither allocated nor written (None, None, dh0): the reverse split's pass 1
    (reverse_split.py), the same dh0 bit for bit."""
    if gluon is None:
        gluon = gluon_reverse_pays(q, k, w, do, dv_local, info, chunk_size)
    if gluon:
        from .gluon_reverse import gluon_state_bwd
        return gluon_state_bwd(q, k, w, do, dht, scale, need_dh0, info, chunk_size, checked=True,
                               store_outputs=store_outputs)
    H, K, V = q.shape[-2], q.shape[-1], do.shape[-1]
    N = info.num_seqs
    chunks = info.chunks(chunk_size)
    dh = q.new_empty(chunks.num_chunks, H, K, V) if store_outputs else None
    dv = torch.empty_like(do) if store_outputs else None
    dh0 = q.new_empty(N, H, K, V, dtype=torch.float32) if need_dh0 else None
    BV, warps = reverse_launch(K, V, N * H, q.element_size(), dv_local is None, num_sms(q.device))
    if N:
        launch(
            state_bwd_kernel, (cdiv(V, BV), N * H),
            q, k, w, do, dv_local, dht, dh, dv, dh0, info.cu_seqlens, chunks.chunk_offsets, scale,
            H, K, V, chunk_size, head_block(K), BV, dht is not None, need_dh0, store_outputs, dv_local is None,
            dot_precision(q.dtype),
            num_warps=warps, num_stages=PIPELINE_STAGES,
        )
    return dh, dv, dh0
