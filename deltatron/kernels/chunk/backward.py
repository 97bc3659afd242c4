"""Backward of chunk_delta_rule: recompute W, U (from the saved T~) and the chunk states, then the stages
of DESIGN.md §3 in order: the reverse state pass with the local dV' fused in (state_bwd with dv_local=None;
output_bwd.dv_local is the same quantity as a stage of its own), dQ/dK/dW, WY backward.

The recompute is one launch where state.wy_on_chip (16-bit, K up to 64 or K = 128, 64-wide V-blocks):
the walk computes W, U from T~ on chip and writes W alone (state.state_wy_fwd). Elsewhere (fp32, and the
heads where that walk spills) two: wy.recompute_w_u writes W and U, state.state_fwd reads them; the same W,
h and v_new bit for bit."""
from __future__ import annotations

from . import output_bwd, state, state_bwd, wy, wy_bwd


def backward(q, k, v, beta, scale, initial_state, saved, do, dht, info, chunk_size=64):
    """Gradients (dq, dk, dv in the input dtype, dbeta fp32, dh0 fp32 or None without initial_state)
    of the chunkwise delta rule; saved = (Tinv,) from the forward. Deterministic: no atomics.

    Each intermediate is released right after the last stage that reads it (`del`), so the peak is the set
    alive at the widest stage (dqkw), not every tensor of the backward at once."""
    (tinv,) = saved
    if state.wy_on_chip(k.shape[3], v.shape[3], info.num_seqs * k.shape[2], k.element_size()):
        w, h, v_new, _ = state.state_wy_fwd(k, v, beta, tinv, initial_state, False, info, chunk_size)
    else:
        w, u = wy.recompute_w_u(k, v, beta, tinv, info, chunk_size)
        h, v_new, _ = state.state_fwd(k, w, u, initial_state, False, info, chunk_size)
        del u
    dh, dv, dh0 = state_bwd.state_bwd(q, k, w, do, None, dht, scale, initial_state is not None, info, chunk_size)
    del w
    dq, dk_direct, dw = output_bwd.dqkw(q, k, v_new, h, dh, do, dv, scale, info, chunk_size)
    del h, v_new, dh
    dk, dv, dbeta = wy_bwd.wy_bwd(k, v, beta, tinv, dw, dv, dk_direct, info, chunk_size)
    return dq, dk, dv, dbeta, dh0
