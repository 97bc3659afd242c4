"""The fully parallel O(T^2) form: the whole sequence as one chunk.

With L = I + tril(diag(beta) K K^T, -1) over all T tokens and T~ = L^{-1}:
    V' = T~ (beta*V) - T~ (beta*K) S0,   o = scale (Q S0 + (Q K^T ⊙ M) V'),   S = S0 + K^T V'.
With S0 = 0 this is o = P V for the delta-rule attention matrix P = scale (Q K^T ⊙ M) T~ diag(beta)."""
from __future__ import annotations

from typing import Optional

import torch

from .chunk import intra_chunk_wy
from .common import compute_dtype, finish, prepare_qk, run_per_sequence


def _parallel(q, k, v, beta, S, scale, attn_out: Optional[list]):
    # [B, T, H, *] -> [B, H, T, *]
    q, k, v, beta = (x.movedim(2, 1) for x in (q, k, v, beta))
    _, T_inv, W, U = intra_chunk_wy(k, v, beta)
    v_new = U - W @ S
    qk = torch.tril(q @ k.transpose(-1, -2))
    o = scale * (q @ S + qk @ v_new)
    if attn_out is not None:
        attn_out.append(scale * (qk @ T_inv) * beta[..., None, :])
    return o.movedim(1, 2), S + k.transpose(-1, -2) @ v_new


def parallel_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    output_attentions: bool = False,
):
    """Same arguments and results as recurrent_delta_rule; with output_attentions also returns the
    attention matrix [B, H, T, T] (block-diagonal over packed sequences, in the compute dtype)."""
    in_dtype = q.dtype
    q, k = prepare_qk(q, k, use_qk_l2norm)
    blocks = [] if output_attentions else None
    o, S = run_per_sequence(
        lambda q, k, v, b, s0: _parallel(q, k, v, b, s0, scale, blocks),
        q, k, v, beta, initial_state, cu_seqlens,
    )
    o, final = finish(o, S, in_dtype, output_final_state)
    if not output_attentions:
        return o, final
    B, T, H = q.shape[:3]
    if cu_seqlens is None:
        attn = blocks[0]
    else:
        attn = q.new_zeros(B, H, T, T, dtype=compute_dtype(in_dtype))
        for (bos, eos), blk in zip(zip(cu_seqlens.tolist()[:-1], cu_seqlens.tolist()[1:]), blocks):
            attn[:, :, bos:eos, bos:eos] = blk
    return o, final, attn
