"""The delta rule token by token (DESIGN.md §1): the definition every other form is checked against."""
from __future__ import annotations

from typing import Optional

import torch

from .common import finish, prepare_qk, run_per_sequence


def _recurrence(q, k, v, beta, S, scale):
    # q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; S: [B, H, K, V]
    outs = []
    for t in range(q.shape[1]):
        k_t, v_t, b_t = k[:, t], v[:, t], beta[:, t]
        v_new = b_t[..., None] * (v_t - torch.einsum("bhk,bhkv->bhv", k_t, S))  # error-correcting write
        S = S + k_t[..., None] * v_new[..., None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, S


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
):
    """o_i = scale * S_i^T q_i with S_i = S_{i-1} + k_i (beta_i (v_i - S_{i-1}^T k_i))^T.

    q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [N, H, K, V].
    Returns (o [B, T, H, V] in the input dtype, final state [N, H, K, V] or None)."""
    in_dtype = q.dtype
    q, k = prepare_qk(q, k, use_qk_l2norm)
    o, S = run_per_sequence(
        lambda q, k, v, b, s0: _recurrence(q, k, v, b, s0, scale), q, k, v, beta, initial_state, cu_seqlens
    )
    return finish(o, S, in_dtype, output_final_state)
