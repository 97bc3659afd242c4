"""Helpers shared by the PyTorch implementations: compute dtype, L2 norm, splitting packed sequences."""
from __future__ import annotations

from typing import Callable, Optional

import torch

# eps inside the square root of the L2 norm (same convention in the Triton kernels).
L2NORM_EPS = 1e-6


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (oracle runs); every other input dtype computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension, in x's dtype (differentiable)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def run_per_sequence(
    fn: Callable,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
):
    """Runs fn(q, k, v, beta, s0) -> (o, S) on the whole batch, or, with cu_seqlens (B == 1), on each
    packed sequence alone; returns (o [B, T, H, V], final states [N, H, K, V]).

    fn sees [b, t, H, *] tensors in the compute dtype and an initial state [b, H, K, V] (never None)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt = compute_dtype(q.dtype)
    q, k, v, beta = (x.to(dt) for x in (q, k, v, beta))
    if cu_seqlens is None:
        s0 = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
        return fn(q, k, v, beta, s0)
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        s0 = q.new_zeros(1, H, K, V) if initial_state is None else initial_state[n : n + 1].to(dt)
        o, s = fn(q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], beta[:, bos:eos], s0)
        outs.append(o)
        states.append(s)
    o = torch.cat(outs, dim=1) if outs else q.new_zeros(1, 0, H, V)
    return o, torch.cat(states, dim=0) if states else q.new_zeros(0, H, K, V)


def finish(o: torch.Tensor, state: torch.Tensor, in_dtype: torch.dtype, output_final_state: bool):
    """Output in the input dtype; final state in fp32 (float64 for float64 inputs), or None."""
    final = state.to(compute_dtype(in_dtype)) if output_final_state else None
    return o.to(in_dtype), final


def prepare_qk(q: torch.Tensor, k: torch.Tensor, use_qk_l2norm: bool):
    if not use_qk_l2norm:
        return q, k
    dt = compute_dtype(q.dtype)
    return l2norm(q.to(dt)), l2norm(k.to(dt))
