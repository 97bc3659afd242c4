"""Backward of chunk_delta_rule: recompute W, U (from the saved T~) and the chunk states, then the stages
of DESIGN.md §3 in order: the reverse state pass with the local dV' fused in (state_bwd with dv_local=None;
output_bwd.dv_local is the same quantity as a stage of its own), dQ/dK/dW, WY backward.

The recompute is one launch where state.wy_on_chip (16-bit, K up to 64 or K = 128, 64-wide V-blocks):
the walk computes W, U from T~ on chip and writes W alone (state.state_wy_fwd). Elsewhere (fp32, and the
heads where that walk spills) two: wy.recompute_w_u writes W and U, state.state_fwd reads them; the same W,
h and v_new bit for bit. On that two-launch path the reverse pass needs W only, not state_fwd's h and
v_new, so the two serial passes may run at once on two CUDA streams (OVERLAP_STATE_PASSES)."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..utils import INTERPRET
from . import output_bwd, state, state_bwd, wy, wy_bwd

# Whether the two-launch recompute runs state_fwd on a side stream beside the reverse state pass (CUDA only,
# never in the interpreter): False never; True wherever it applies (tests,
# benchmarks/diagnostics/overlap_state_passes.py); None (the default) where overlap_pays
OVERLAP_STATE_PASSES: Optional[bool] = None
OVERLAP_MAX_STATES = 32  # sequences x heads: at most this many (overlap_pays)
OVERLAP_MIN_TOKENS = 8192  # mean tokens a sequence: at least this many (overlap_pays)


def overlap_pays(num_seqs: int, heads: int, total_tokens: int) -> bool:
    """Where overlapping state_fwd with the reverse pass saves time: few sequences x heads, at most
    OVERLAP_MAX_STATES, on long sequences, OVERLAP_MIN_TOKENS on average. The reverse pass, the Gluon kernel's
    two programs a head (gluon_walk.split_v) of a whole SM each, leaves the other SMs idle: at 32 sequences x
    heads 68 of the 132, at 64 only 4 (where 16-bit K = V = 128 recomputes in one launch anyway). Shorter
    sequences make both passes short, and the whole call, about as busy on the host as on the GPU there, gains
    little from GPU time saved.
    Measured on the H200 (benchmarks/diagnostics/overlap_state_passes.py, bf16, K = V = 128, session 12; gradients
    bitwise equal to the one-stream backward), forward+backward through the API, one stream / two, three
    interleaved readings: 1 x 16 heads, T = 32768: 4.180-4.196 / 3.481-3.487 ms (predicted 3.5-3.7). At 2 x 32
    heads, T = 8192 the recompute is one launch and nothing changes (2.556-2.561 / 2.559-2.562). Not measured:
    between 17 and 32 sequences x heads, and the Triton reverse pass (fp32, other head sizes)."""
    return num_seqs * heads <= OVERLAP_MAX_STATES and total_tokens >= OVERLAP_MIN_TOKENS * num_seqs


def overlaps(k: torch.Tensor, info) -> bool:
    """Whether this backward's two-launch recompute overlaps state_fwd with the reverse pass."""
    if OVERLAP_STATE_PASSES is False or not k.is_cuda or INTERPRET:
        return False
    return OVERLAP_STATE_PASSES or overlap_pays(info.num_seqs, k.shape[2], info.total_tokens)


@functools.lru_cache(maxsize=None)
def side_stream(device_index: int) -> torch.cuda.Stream:
    """The side stream of a device: made once and reused (a stream is a driver object, not free to make)."""
    return torch.cuda.Stream(device=device_index)


def backward(q, k, v, beta, scale, initial_state, saved, do, dht, info, chunk_size=64):
    """Gradients (dq, dk, dv in the input dtype, dbeta fp32, dh0 fp32 or None without initial_state)
    of the chunkwise delta rule; saved = (Tinv,) from the forward. Deterministic: no atomics.

    Each intermediate is released right after the last stage that reads it (`del`), so the peak is the set
    alive at the widest stage (dqkw), not every tensor of the backward at once."""
    (tinv,) = saved

    def reverse_pass(w):
        return state_bwd.state_bwd(q, k, w, do, None, dht, scale, initial_state is not None, info, chunk_size)

    if state.wy_on_chip(k.shape[3], v.shape[3], info.num_seqs * k.shape[2], k.element_size()):
        w, h, v_new, _ = state.state_wy_fwd(k, v, beta, tinv, initial_state, False, info, chunk_size)
        dh, dv, dh0 = reverse_pass(w)
    elif overlaps(k, info):
        w, u = wy.recompute_w_u(k, v, beta, tinv, info, chunk_size)
        main, side = torch.cuda.current_stream(k.device), side_stream(k.device.index)
        side.wait_stream(main)  # an event after recompute_w_u: state_fwd waits for W, U, not for the reverse pass
        dh, dv, dh0 = reverse_pass(w)  # queued first, so that its programs take their SMs first
        with torch.cuda.stream(side):
            h, v_new, _ = state.state_fwd(k, w, u, initial_state, False, info, chunk_size)
        main.wait_stream(side)  # dqkw reads h and v_new
        # The caching allocator hands a released block to the next allocation on the stream it was made on. h
        # and v_new are the side stream's: recorded on main, their memory waits for main's work queued before
        # their release (dqkw). W and U are main's, read on the side: released below, after main joined the
        # side stream, so main's later work that reuses them runs after state_fwd
        h.record_stream(main)
        v_new.record_stream(main)
        del u
    else:
        w, u = wy.recompute_w_u(k, v, beta, tinv, info, chunk_size)
        h, v_new, _ = state.state_fwd(k, w, u, initial_state, False, info, chunk_size)
        del u
        dh, dv, dh0 = reverse_pass(w)
    del w
    dq, dk_direct, dw = output_bwd.dqkw(q, k, v_new, h, dh, do, dv, scale, info, chunk_size)
    del h, v_new, dh
    dk, dv, dbeta = wy_bwd.wy_bwd(k, v, beta, tinv, dw, dv, dk_direct, info, chunk_size)
    return dq, dk, dv, dbeta, dh0
