"""Backward of chunk_delta_rule: recompute W, U (from the saved T~) and the chunk states, then the stages
of DESIGN.md §3 in order: the reverse state pass with the local dV' fused in (state_bwd with dv_local=None;
output_bwd.dv_local is the same quantity as a stage of its own), dQ/dK/dW, WY backward.

The recompute is one launch where state.wy_on_chip (16-bit, K up to 64 or K = 128, 64-wide V-blocks):
the walk computes W, U from T~ on chip and writes W alone (state.state_wy_fwd). Elsewhere (fp32, and the
heads where that walk spills) two: wy.recompute_w_u writes W and U, state.state_fwd reads them; the same W,
h and v_new bit for bit. On that two-launch path the reverse pass needs W only, not state_fwd's h and
v_new, so the two serial passes may run at once on two CUDA streams (OVERLAP_STATE_PASSES).

SEGMENTED_BACKWARD runs the reverse pass and the grad stage segment by segment, a later segment's grad stage on
the side stream beside an earlier segment's reverse pass (segmented_bwd.py). REVERSE_SPLIT runs the reverse pass
on partitions of the long sequences, from the gradients leaving them that two more walks and a small combine give
(reverse_split.py); where it does, the backward is not segmented."""
from __future__ import annotations

from typing import Optional

import torch

from ..utils import side_stream, two_streams
from . import output_bwd, reverse_split, segmented_bwd, state, state_bwd, wy, wy_bwd

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
    if OVERLAP_STATE_PASSES is False or not two_streams(k):
        return False
    return OVERLAP_STATE_PASSES or overlap_pays(info.num_seqs, k.shape[2], info.total_tokens)


# Whether the backward runs segment by segment (segmented_bwd.py): False never; True always, in FORCED_SEGMENTS
# segments (tests, benchmarks/diagnostics/seg_bwd.py); None by segmented_bwd.segmented_pays where two streams exist
# (measured on the H200: segmented_bwd.py). On CUDA tensors (not in
# the interpreter) it runs state_fwd and the later segments' grad stages on the side stream whatever
# OVERLAP_STATE_PASSES says; elsewhere the same order on one stream.
SEGMENTED_BACKWARD: Optional[bool] = None
FORCED_SEGMENTS = 2


def num_segments(k: torch.Tensor, info) -> int:
    """Segments this backward runs in (1: unsegmented)."""
    if SEGMENTED_BACKWARD is False:
        return 1
    if SEGMENTED_BACKWARD:
        return FORCED_SEGMENTS
    if not two_streams(k):  # the rule's gain is the second stream's; on one stream segments only add launches
        return 1
    return segmented_bwd.segmented_pays(info.num_seqs, k.shape[2], info.total_tokens)


# Whether the reverse pass is split along long sequences (reverse_split.py): False never (the default: measured on
# the H200 in session 17, it halves the reverse pass at b1-t32768-h16 but the whole backward loses 0.10 ms against
# the segmented one, and at 64 heads it doubles the pass: benchmarks/NOTES.md); True on every sequence of
# seq_split.SPLIT_MIN_TOKENS tokens or more, in the partitions of a forced forward split (seq_split.forced_partitions),
# the backward then unsegmented (tests, benchmarks/diagnostics/reverse_split.py); None is kept for a rule once
# measured, and until then means False
REVERSE_SPLIT: Optional[bool] = False


def keeps_forward_states(q, k, v, info, chunk_size) -> bool:
    """Where a training forward asked to (chunk_delta_rule's save_states) keeps W and its walk's per-chunk states
    (S^T, V'^T: state.states_buffers) for the backward, which then skips its recompute walk: where the forward's
    walk is the Gluon one on the whole sequences (gluon_walk_pays, on q and k as TMA takes them: W and U are made
    by the forward; the caller checks that no sequence split runs) and the backward would be neither segmented nor
    split (those recompute on their own terms). Decided before the WY stage: where it is false, the forward runs as
    without save_states (the residual form included). The cost is
    memory from the forward to the backward: W, S^T and V'^T are 1 KiB a token and head at K = V = 128 (C = 64),
    beside the T~ saved either way (256 B). Measured on the H200 (benchmarks/diagnostics/save_states.py, bf16,
    session 17; gradients bitwise equal), forward+backward ms, recomputing / keeping: 8 x 16 heads, T = 2048,
    1.115 / 0.992; 4 x 16, T = 4096, 1.210 / 0.978; 2 x 32, T = 8192, 2.407 / 1.921; 20 sequences x 16 heads,
    32,768 tokens, 2.751 / 2.224. The training forward alone takes 0.06-0.12 ms longer (it writes S^T, V'^T)."""
    return (not REVERSE_SPLIT and state.gluon_walk_pays(k, v, info, chunk_size) and state.tma_ready(q, k)
            and num_segments(k, info) == 1)


def backward(q, k, v, beta, scale, initial_state, saved, do, dht, info, chunk_size=64, save_states=False):
    """Gradients (dq, dk, dv, dbeta in the input dtypes, dh0 fp32 or None without initial_state)
    of the chunkwise delta rule; saved = (Tinv,) from the forward, or (Tinv, W, S^T, V'^T) where it kept its
    states (keeps_forward_states): then no recompute walk runs (save_states, the forward's option, is not read
    here: saved says what was kept). Deterministic: no atomics.

    Each intermediate is released right after the last stage that reads it (`del`), so the peak is the set
    alive at the widest stage (dqkw), not every tensor of the backward at once."""
    tinv, *kept = saved
    if kept:
        return backward_on_forward_states(q, k, v, beta, scale, initial_state, tinv, kept, do, dht, info, chunk_size)
    split = reverse_split.plan_for(k, info, chunk_size) if REVERSE_SPLIT else None
    S = num_segments(k, info) if split is None else 1
    plan = segmented_bwd.segment_plan(info, S, chunk_size) if S > 1 else None
    if plan is not None:
        return segmented_backward(q, k, v, beta, scale, initial_state, tinv, do, dht, info, plan, chunk_size)

    def reverse_pass(w):
        if split is not None:
            return reverse_split.split_state_bwd(q, k, w, do, dht, scale, initial_state is not None, split,
                                                 chunk_size)
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


def backward_on_forward_states(q, k, v, beta, scale, initial_state, tinv, kept, do, dht, info, chunk_size):
    """backward's contract from the forward's W, S^T and V'^T (kept): the reverse pass, then dQ/dK/dW on the
    transposed states and the WY backward, unsegmented and unsplit (keeps_forward_states)."""
    w, st, vt = kept  # (autograd holds these until the backward returns: nothing to release early here)
    dh, dv, dh0 = state_bwd.state_bwd(q, k, w, do, None, dht, scale, initial_state is not None, info, chunk_size)
    dq, dk_direct, dw = output_bwd.dqkw(q, k, vt, st, dh, do, dv, scale, info, chunk_size, states_t=True)
    del dh
    dk, dv, dbeta = wy_bwd.wy_bwd(k, v, beta, tinv, dw, dv, dk_direct, info, chunk_size)
    return dq, dk, dv, dbeta, dh0


def segmented_backward(q, k, v, beta, scale, initial_state, tinv, do, dht, info, plan, chunk_size):
    """backward's contract, the reverse pass and the grad stage run over plan's segments (segmented_bwd.py): on
    CUDA, state_fwd and the grad stage of segment s + 1 on the side stream beside the reverse pass of segment s.

    Memory: U is released once state_fwd is queued, W once the last reverse pass is, and each segment's dh and dV'
    once its grad stage is, so that at most two segments' dh and dV' are alive (the segment whose grad stage runs
    and the one whose reverse pass runs beside it), not every segment's until the end.

    Stream safety: a tensor of the current stream that the side stream reads (U and W where state_fwd runs there,
    the dh and dV' of segments 1..S-1) is released through release(): recorded on the side stream, its memory goes
    back to the current stream's allocations only after the side stream's work queued before the release. The
    inputs and the gradients, which the segments write into, stay referenced until the current stream has joined
    the side stream at the end. What the side stream allocates and the current stream reads (h, v_new) is
    recorded on the current stream."""
    shapes = q.shape, k.shape, v.shape, beta.shape
    q, k, v, beta, tinv, do = (segmented_bwd.packed(x) for x in (q, k, v, beta, tinv, do))
    streams = two_streams(k)
    main = torch.cuda.current_stream(k.device) if streams else None
    side = side_stream(k.device.index) if streams else None

    def release(*tensors):  # read on the side stream; the caller drops its references right after
        if streams:
            for x in tensors:
                x.record_stream(side)

    has_h0 = initial_state is not None
    fwd_done, u = None, None
    if state.wy_on_chip(k.shape[3], v.shape[3], info.num_seqs * k.shape[2], k.element_size()):
        w, h, v_new, _ = state.state_wy_fwd(k, v, beta, tinv, initial_state, False, info, chunk_size)
    else:
        w, u = wy.recompute_w_u(k, v, beta, tinv, info, chunk_size)
    # every segment runs the reverse-pass kernel the whole batch would
    gluon = state_bwd.gluon_reverse_pays(q, k, w, do, None, info, chunk_size)
    revs = [None] * len(plan)  # (dh, dV', dh0) of each segment; (None, None, dh0) once its grad stage is queued
    # the gradients, allocated here on the current stream: each segment's grad stage writes its tokens' views
    grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta)

    def rev(s, next_dh0):
        return segmented_bwd.reverse_segment(plan[s], q, k, w, do, dht, next_dh0, scale, has_h0, gluon, chunk_size)

    def grad(s):  # segment 0's on the current stream, the others' on the side stream (under streams)
        dh, dv, dh0 = revs[s]
        segmented_bwd.grad_segment(plan[s], q, k, v, beta, tinv, v_new, h, do, dh, dv, scale, chunk_size, grads)
        if s > 0:
            release(dh, dv)
        revs[s] = None, None, dh0

    last = len(plan) - 1
    if u is not None and streams:
        side.wait_stream(main)  # state_fwd waits for W, U
        revs[last] = rev(last, None)  # queued first, so that its programs take their SMs first
        with torch.cuda.stream(side):
            h, v_new, _ = state.state_fwd(k, w, u, initial_state, False, info, chunk_size)
            fwd_done = side.record_event()
        h.record_stream(main)
        v_new.record_stream(main)
    elif u is not None:
        h, v_new, _ = state.state_fwd(k, w, u, initial_state, False, info, chunk_size)
        revs[last] = rev(last, None)
    else:
        revs[last] = rev(last, None)
    if u is not None:  # state_fwd is its only reader
        if fwd_done is not None:  # on the side stream
            release(u)
        del u
    for s in range(last - 1, -1, -1):
        rev_done = main.record_event() if streams else None  # after the reverse pass of segment s + 1
        revs[s] = rev(s, revs[s + 1][2])
        if s == 0:  # the last reader of W queued: this reverse pass, and state_fwd (if any) before it
            if fwd_done is not None:  # state_fwd read it on the side stream
                release(w)
            w = None
        if streams:
            side.wait_event(rev_done)
            with torch.cuda.stream(side):
                grad(s + 1)
        else:
            grad(s + 1)
    if fwd_done is not None:
        main.wait_event(fwd_done)  # grad(0) reads h and v_new
    grad(0)
    if streams:
        main.wait_stream(side)
    dq, dk, dv, dbeta = (g.view(shape) for g, shape in zip(grads, shapes))
    dh0 = segmented_bwd.dh0_of(plan, [r[2] for r in revs]) if has_h0 else None
    return dq, dk, dv, dbeta, dh0
