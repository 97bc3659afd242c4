"""Backward of chunk_delta_rule: recompute W, U (from the saved T~) and the chunk states, then the stages
of DESIGN.md §3 in order: the reverse state pass with the local dV' fused in (state_bwd with dv_local=None;
output_bwd.dv_local is the same quantity as a stage of its own), dQ/dK/dW, WY backward.

The recompute is one launch where state.wy_on_chip (16-bit, K up to 64 or K = 128, 64-wide V-blocks):
the walk computes W, U from T~ on chip and writes W alone (state.state_wy_fwd). Elsewhere (fp32, and the
heads where that walk spills) two: wy.recompute_w_u writes W and U, state.state_fwd reads them; the same W,
h and v_new bit for bit.

Where GLUON_GRAD is on and gluon_grad_applies, dqkw + wy_bwd run as one warp-specialized Gluon kernel
(gluon_grad.py) that recomputes V' on chip: it reads neither v_new nor dW nor the direct dK."""
from __future__ import annotations

from typing import Optional

import torch

from ..utils import INTERPRET
from . import output_bwd, state, state_bwd, wy, wy_bwd
from .state import _is_sm90, gluon_importable

# Whether the grad stage (dqkw + wy_bwd) runs as gluon_grad.py's kernel where gluon_grad_applies: off until the GPU
# has measured it (tests and benchmarks/diagnostics/gluon_grad.py turn it on); None runs it wherever it applies
GLUON_GRAD: Optional[bool] = False


def gluon_grad_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, chunk_size: int) -> bool:
    """Where the Gluon grad kernel can run: a Hopper GPU (sm_90, not the interpreter), q, k, v, do of one 16-bit
    dtype, K = V = 128, C = 64, contiguous and 16-byte aligned (TMA), and a triton with Gluon's Hopper API."""
    return (k.is_cuda and not INTERPRET and k.dtype in (torch.bfloat16, torch.float16)
            and all(x.dtype == k.dtype and x.shape[-1] == 128 and x.is_contiguous() and x.data_ptr() % 16 == 0
                    for x in (q, k, v, do))
            and chunk_size == 64 and _is_sm90(k.device.index) and gluon_importable("gluon_grad"))


def gluon_grad_kernel():
    """gluon_grad.gluon_grad, imported only where it runs (Gluon does not run in the interpreter)."""
    from .gluon_grad import gluon_grad
    return gluon_grad


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
    if GLUON_GRAD is not False and gluon_grad_applies(q, k, v, do, chunk_size):
        del v_new
        dq, dk, dv, dbeta = gluon_grad_kernel()(q, k, v, beta, tinv, h, dh, dv, do, scale, info, chunk_size)
        return dq, dk, dv, dbeta, dh0
    dq, dk_direct, dw = output_bwd.dqkw(q, k, v_new, h, dh, do, dv, scale, info, chunk_size)
    del h, v_new, dh
    dk, dv, dbeta = wy_bwd.wy_bwd(k, v, beta, tinv, dw, dv, dk_direct, info, chunk_size)
    return dq, dk, dv, dbeta, dh0
