"""The chunkwise WY form (DESIGN.md §2), vectorized over batch, heads and chunks.

Only the state pass is a loop (over chunks); the intra-chunk work is batched matrix algebra. The last
chunk may be partial: it is padded with k = v = q = 0 and beta = 0, which leaves the state untouched
(A, W, U and V' vanish on padded rows) and is sliced off the output."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .common import finish, prepare_qk, run_per_sequence


def to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, NC, C, ...], zero-padding T up to a multiple of chunk_size."""
    T = x.shape[1]
    pad = (-T) % chunk_size
    if pad:
        widths = [0, 0] * (x.dim() - 2) + [0, pad]
        x = F.pad(x, widths)
    x = x.movedim(2, 1)  # [B, H, T', ...]
    return x.reshape(x.shape[0], x.shape[1], -1, chunk_size, *x.shape[3:])


def from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """[B, H, NC, C, ...] -> [B, T, H, ...] (drops the padding)."""
    x = x.reshape(x.shape[0], x.shape[1], -1, *x.shape[4:])[:, :, :T]
    return x.movedim(1, 2)


def intra_chunk_wy(k_c: torch.Tensor, v_c: torch.Tensor, beta_c: torch.Tensor):
    """Per chunk: A = tril(diag(beta) K K^T, -1), T~ = (I + A)^{-1}, W = T~ (beta*K), U = T~ (beta*V).

    k_c: [..., C, K]; v_c: [..., C, V]; beta_c: [..., C]. Returns (A, T~, W, U)."""
    C = k_c.shape[-2]
    A = torch.tril(beta_c[..., None] * (k_c @ k_c.transpose(-1, -2)), diagonal=-1)
    eye = torch.eye(C, dtype=k_c.dtype, device=k_c.device)
    T_inv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    W = T_inv @ (beta_c[..., None] * k_c)
    U = T_inv @ (beta_c[..., None] * v_c)
    return A, T_inv, W, U


def _chunkwise(q, k, v, beta, S, scale, chunk_size):
    T = q.shape[1]
    q_c, k_c, v_c, b_c = (to_chunks(x, chunk_size) for x in (q, k, v, beta))
    _, _, W, U = intra_chunk_wy(k_c, v_c, b_c)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    qk = (q_c @ k_c.transpose(-1, -2)).masked_fill(~causal, 0)  # [B, H, NC, C, C], j <= i
    outs = []
    for c in range(q_c.shape[2]):
        v_new = U[:, :, c] - W[:, :, c] @ S  # V' = U - W S
        outs.append(scale * (q_c[:, :, c] @ S + qk[:, :, c] @ v_new))
        S = S + k_c[:, :, c].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2) if outs else v_c
    return from_chunks(o, T), S


def chunk_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
):
    """Chunkwise delta rule; same arguments and results as recurrent_delta_rule, plus chunk_size."""
    in_dtype = q.dtype
    q, k = prepare_qk(q, k, use_qk_l2norm)
    o, S = run_per_sequence(
        lambda q, k, v, b, s0: _chunkwise(q, k, v, b, s0, scale, chunk_size),
        q, k, v, beta, initial_state, cu_seqlens,
    )
    return finish(o, S, in_dtype, output_final_state)
