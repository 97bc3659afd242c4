"""The chunk backward: executes the call's plan (plan.py), which the forward ran (docs/DESIGN.md §4-§7).

    recompute: W, U and the per-chunk states from the saved T~, in one launch (portable.walk computing W, U on
               chip) or two (portable.wy, then portable.walk, on a side stream beside the reverse pass where the
               plan overlaps them); nothing where the forward kept its states
    reverse:   the state gradient backwards over the chunks, with the local dV' fused in (hopper.reverse or
               portable.reverse; where the plan says so, as for KDA, the local dV' from portable.grads.dv_local
               before the pass)
    grads:     dQ, the direct dK and dW (portable.grads), then the WY backward: dK, dV, dbeta (portable.wy_bwd)
The gated rule (g given) sums g into γ again and every stage takes it; portable.gate sums dg from the stages'
shares. KDA's per-channel g ([.., TT, H, K]) is summed within sub-chunks again for the stages, and dg comes per channel.
With grouped value heads grads.dqkw (dQ) and wy_bwd (dK) sum each key head's group, one launch a group member.
Where the plan segments the backward, the reverse pass and the gradient stage run segment by segment
(schedule/segments.py). Each intermediate is released right after the last stage that reads it, so the peak is the
set alive at the widest stage.
Deterministic: no atomics."""
from __future__ import annotations

import torch

from ..utils import side_stream
from .plan import ChunkPlan
from .portable.gate import channel_decay_buffers, channel_gate_grad, gate_grad, stage_gates
from .portable.grads import dqkw, dv_local
from .portable.reverse import state_bwd
from .portable.walk import state_fwd, state_wy_fwd
from .portable.wy import recompute_w_u
from .portable.wy_bwd import wy_bwd
from .schedule import segments as seg


def reverse_pass(plan: ChunkPlan, q, k, w, do, dht, scale, need_dh0, info, gam=None, decays=None, scores=None):
    """The plan's reverse state pass: (dh per chunk, the full dV', dh0 or None); gam: the gated rule's γ; decays:
    KDA's gate.ChannelDecays, with the decayed q (the portable pass only: the plan says so); scores: KDA's scale P as
    the forward's WY stage stored it, for the local dV'."""
    C = plan.problem.chunk_size
    if plan.reverse == "hopper":
        from .hopper.reverse import gluon_state_bwd
        if do.data_ptr() % 16:  # TMA needs 16-byte aligned rows (q, k, w are the call's own or fresh)
            do = do.clone()
        return gluon_state_bwd(q, k, w, do, dht, scale, need_dh0, info, C, block_v=plan.reverse_launch.block_v,
                               checked=True, gam=gam)
    gk = None if decays is None else decays.sums
    local = dv_local(q, k, do, scale, info, C, gk=gk, scores=scores) if plan.local_dv_apart else None
    return state_bwd(q, k, w, do, local, dht, scale, need_dh0, info, C, cfg=plan.reverse_launch, gam=gam, gk=decays)


def backward(q, k, v, beta, scale, initial_state, saved, do, dht, info, chunk_size=64, save_states=False,
             plan: ChunkPlan = None, g=None, output_chunk_states=False):
    """(dq, dk, dv, dbeta in the input dtypes, dh0 fp32 or None, and dg fp32 where g is given) by deltatron.autograd's
    contract; saved = (T~,), KDA's (T~, scale P) where the forward kept its WY stage's scores, or, where the
    plan kept states, (T~, W, S^T, V'^T); plan: the call's, as its forward ran it."""
    if plan is None:  # called on its own (tests): the plan the forward would have made
        from .forward import plan_call
        plan = plan_call(q, k, v, info, True, chunk_size, save_states, g, output_chunk_states)
    tinv, *kept = saved
    has_h0 = initial_state is not None
    if plan.keep_states:
        w, st, vt = kept  # (autograd holds these until the backward returns)
        dh, dv, dh0 = reverse_pass(plan, q, k, w, do, dht, scale, has_h0, info)
        dq, dk_direct, dw, _ = dqkw(q, k, vt, st, dh, do, dv, scale, info, chunk_size, states_t=True,
                                    cfg=plan.dqkw_launch)
        del dh
        dk, dv, dbeta, _ = wy_bwd(k, v, beta, tinv, dw, dv, dk_direct, info, chunk_size, cfg=plan.wy_bwd_launch)
        return dq, dk, dv, dbeta, dh0
    if plan.segments > 1:
        segment_plan = seg.segment_plan(info, plan.segments, chunk_size)
        if segment_plan is not None:
            return segmented_backward(plan, q, k, v, beta, scale, initial_state, tinv, do, dht, info, segment_plan)

    cfg = plan.recompute_launch
    gam, gk = stage_gates(g, info, chunk_size)
    # KDA: the decays of the serial passes, written by the recompute's WY stage beside W, for the recompute walk and
    # the reverse pass
    decays = None if gk is None else channel_decay_buffers(k, gk, info, chunk_size, with_q=True)
    # KDA's scale P from the forward's WY stage, in the input dtype: dv_local's operand where dO has that dtype
    scores = kept[0] if kept and kept[0].dtype == do.dtype else None
    if plan.recompute == "on_chip":
        w, h, v_new, _ = state_wy_fwd(k, v, beta, tinv, initial_state, False, info, chunk_size, cfg=cfg, gam=gam)
        dh, dv, dh0 = reverse_pass(plan, q, k, w, do, dht, scale, has_h0, info, gam)
    elif plan.overlap:
        w, u = recompute_w_u(k, v, beta, tinv, info, chunk_size, cfg=plan.recompute_wy_launch, gam=gam, gk=gk,
                             decays=decays, q=None if decays is None else q)
        main, side = torch.cuda.current_stream(k.device), side_stream(k.device.index)
        side.wait_stream(main)  # an event after recompute_w_u: the walk waits for W, U, not for the reverse pass
        # the reverse pass queued first, so that its programs take their SMs first
        dh, dv, dh0 = reverse_pass(plan, q, k, w, do, dht, scale, has_h0, info, gam, decays, scores)
        with torch.cuda.stream(side):
            h, v_new, _ = state_fwd(k, w, u, initial_state, False, info, chunk_size, cfg=cfg, gam=gam, gk=decays)
        main.wait_stream(side)  # grads reads h and v_new
        # The caching allocator hands a released block to the next allocation on the stream it was made on: h and
        # v_new are the side stream's, recorded on main so that their memory waits for main's work queued before
        # their release. W and U are main's, read on the side: released below, after main joined the side stream
        h.record_stream(main)
        v_new.record_stream(main)
        del u
    else:
        w, u = recompute_w_u(k, v, beta, tinv, info, chunk_size, cfg=plan.recompute_wy_launch, gam=gam, gk=gk,
                             decays=decays, q=None if decays is None else q)
        h, v_new, _ = state_fwd(k, w, u, initial_state, False, info, chunk_size, cfg=cfg, gam=gam, gk=decays)
        del u
        dh, dv, dh0 = reverse_pass(plan, q, k, w, do, dht, scale, has_h0, info, gam, decays, scores)
    del w, decays, scores, kept
    dq, dk_direct, dw, dg_shares = dqkw(q, k, v_new, h, dh, do, dv, scale, info, chunk_size, gam=gam, gk=gk,
                                        cfg=plan.dqkw_launch)
    del h, v_new, dh
    dk, dv, dbeta, dgam = wy_bwd(k, v, beta, tinv, dw, dv, dk_direct, info, chunk_size, cfg=plan.wy_bwd_launch,
                                 gam=gam, gk=gk)
    per_channel = gk is not None
    del dw, dk_direct, gam, gk  # before dg's sums (KDA's gk: the gate's planes, 3 fp32 numbers a channel and token)
    dg = (None if g is None else channel_gate_grad(dgam, dg_shares, info, chunk_size) if per_channel else
          gate_grad(dgam, dg_shares, info, chunk_size))
    return (dq, dk, dv, dbeta, dh0) + (() if g is None else (dg,))


def segmented_backward(plan, q, k, v, beta, scale, initial_state, tinv, do, dht, info, segment_plan):
    """backward's contract with the reverse pass and the gradient stage run over the segments: on CUDA, the
    recompute walk and the gradient stage of segment s + 1 on the side stream beside the reverse pass of segment s.

    Memory: U is released once the walk is queued, W once the last reverse pass is, and each segment's dh and dV'
    once its gradient stage is, so at most two segments' dh and dV' are alive.

    Stream safety: a tensor of the current stream that the side stream reads (U and W where the walk runs there,
    the dh and dV' of segments 1..S-1) is released through release(): recorded on the side stream, its memory goes
    back to the current stream's allocations only after the side stream's work queued before the release. The
    inputs and the gradients, which the segments write into, stay referenced until the current stream has joined
    the side stream at the end. What the side stream allocates and the current stream reads (h, v_new) is
    recorded on the current stream."""
    chunk_size = plan.problem.chunk_size
    shapes = q.shape, k.shape, v.shape, beta.shape
    q, k, v, beta, tinv, do = (seg.packed(x) for x in (q, k, v, beta, tinv, do))
    streams = plan.caps.two_streams
    main = torch.cuda.current_stream(k.device) if streams else None
    side = side_stream(k.device.index) if streams else None

    def release(*tensors):  # read on the side stream; the caller drops its references right after
        if streams:
            for x in tensors:
                x.record_stream(side)

    has_h0 = initial_state is not None
    fwd_done, u = None, None
    if plan.recompute == "on_chip":
        w, h, v_new, _ = state_wy_fwd(k, v, beta, tinv, initial_state, False, info, chunk_size,
                                      cfg=plan.recompute_launch)
    else:
        w, u = recompute_w_u(k, v, beta, tinv, info, chunk_size, cfg=plan.recompute_wy_launch)
    revs = [None] * len(segment_plan)  # (dh, dV', dh0) of each segment; (None, None, dh0) once its grads are queued
    # the gradients, allocated here on the current stream: each segment's gradient stage writes its tokens' views
    grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta)

    def reverse(q_, k_, w_, do_, dht_, need_dh0, info_):
        return reverse_pass(plan, q_, k_, w_, do_, dht_, scale, need_dh0, info_)

    def rev(s, next_dh0):
        return seg.reverse_segment(segment_plan[s], reverse, q, k, w, do, dht, next_dh0, has_h0)

    def grad(s):  # segment 0's on the current stream, the others' on the side stream (under streams)
        dh, dv, dh0 = revs[s]
        seg.grad_segment(segment_plan[s], q, k, v, beta, tinv, v_new, h, do, dh, dv, scale, chunk_size, grads)
        if s > 0:
            release(dh, dv)
        revs[s] = None, None, dh0

    last = len(segment_plan) - 1
    if u is not None and streams:
        side.wait_stream(main)  # the walk waits for W, U
        revs[last] = rev(last, None)  # queued first, so that its programs take their SMs first
        with torch.cuda.stream(side):
            h, v_new, _ = state_fwd(k, w, u, initial_state, False, info, chunk_size, cfg=plan.recompute_launch)
            fwd_done = side.record_event()
        h.record_stream(main)
        v_new.record_stream(main)
    elif u is not None:
        h, v_new, _ = state_fwd(k, w, u, initial_state, False, info, chunk_size, cfg=plan.recompute_launch)
        revs[last] = rev(last, None)
    else:
        revs[last] = rev(last, None)
    if u is not None:  # the walk is its only reader
        if fwd_done is not None:  # on the side stream
            release(u)
        del u
    for s in range(last - 1, -1, -1):
        rev_done = main.record_event() if streams else None  # after the reverse pass of segment s + 1
        revs[s] = rev(s, revs[s + 1][2])
        if s == 0:  # the last reader of W queued: this reverse pass, and the walk (if any) before it
            if fwd_done is not None:  # the walk read it on the side stream
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
    dh0 = seg.dh0_of(segment_plan, [r[2] for r in revs]) if has_h0 else None
    return dq, dk, dv, dbeta, dh0
