"""The gated delta rule with grouped value heads (DESIGN.md §11) and Kimi Delta Attention (KDA, per-channel
gates, §12): the float64 oracles of their kernels.

Per token, value head h (its query/key head h // (Hv / Hk)):
    S <- diag(exp(g_t)) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = scale S^T q_t,
with g_t one log decay per head (g [B, T, Hv], Gated DeltaNet: every row of S decays alike) or one per key channel
(g [B, T, Hv, K], KDA: row c of S decays by exp(g_t[c])). Three forms: the token recurrence (the definition), the
chunkwise WY form (autograd-differentiable; both gates), and the manual chunkwise backward that the kernels
implement (no autograd inside; the per-head gate). All compute in the inputs' dtype."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .chunk import from_chunks, to_chunks


# ---------------------------------------------------------------- shared

def _group_size(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    Hk, Hv = k.shape[2], v.shape[2]
    if q.shape[2] != Hk:
        raise ValueError(f"q has {q.shape[2]} heads, k has {Hk}: they must match")
    if Hk == 0 or Hv % Hk:
        raise ValueError(f"the value heads ({Hv}) must be a multiple of the key heads ({Hk})")
    return Hv // Hk


def _expand_heads(x: torch.Tensor, G: int) -> torch.Tensor:
    """[B, T, Hk, K] -> [B, T, Hk*G, K]: value head h reads key head h // G (an index, no copy of semantics)."""
    if G == 1:
        return x
    idx = torch.arange(x.shape[2] * G, device=x.device) // G
    return x.index_select(2, idx)


def _reduce_heads(dx: torch.Tensor, G: int) -> torch.Tensor:
    """[B, T, Hk*G, K] -> [B, T, Hk, K]: the gradient of a shared q/k head sums over its G value heads."""
    if G == 1:
        return dx
    B, T, Hv, K = dx.shape
    return dx.reshape(B, T, Hv // G, G, K).sum(3)


def _per_sequence(fn: Callable, seqs: Sequence[torch.Tensor], s0: torch.Tensor,
                  cu_seqlens: Optional[torch.Tensor]):
    """fn(*[b, t, H, ...] tensors, s0 [b, H, K, V]) -> tuple of per-token results [b, t, ...] and per-sequence
    results [b, ...] (told apart by per_token flags fn returns as its last item). Runs fn on the whole batch,
    or with cu_seqlens (B == 1) on each packed sequence alone; concatenates per-token results along T and
    per-sequence results along N."""
    if cu_seqlens is None:
        *res, _ = fn(*seqs, s0)
        return res
    bounds = cu_seqlens.tolist()
    parts = []
    flags = None
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        *res, flags = fn(*(x[:, bos:eos] for x in seqs), s0[n : n + 1])
        parts.append(res)
    if not parts:  # no sequences at all
        *res, flags = fn(*(x[:, :0] for x in seqs), s0[:0])
        return res
    return [None if parts[0][i] is None else torch.cat([p[i] for p in parts], dim=1 if flags[i] else 0)
            for i in range(len(parts[0]))]


def _initial_state(initial_state, v, K, cu_seqlens):
    B, _, Hv, V = v.shape
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    if initial_state is None:
        return v.new_zeros(N, Hv, K, V)
    if tuple(initial_state.shape) != (N, Hv, K, V):
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected {(N, Hv, K, V)}")
    return initial_state.to(v.dtype)


def _check_varlen(q, cu_seqlens):
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError("with cu_seqlens the batch size must be 1 (sequences packed along T)")


# ---------------------------------------------------------------- the recurrence

def _per_channel(g: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether g [B, T, H, K] is KDA's per-channel gate (else g [B, T, H], one decay per head)."""
    return g.dim() == v.dim()


def _on_rows(factor: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """A decay factor ([..., H] per head, [..., H, K] per channel) shaped to scale the rows of [..., H, K, *]."""
    return factor[..., None] if per_channel else factor[..., None, None]


def _recurrence(q, k, v, g, beta, S, scale):
    # q, k: [B, T, H, K] (already expanded to the value heads); v: [B, T, H, V]; beta: [B, T, H]; g: [B, T, H] or
    # [B, T, H, K]; S: [B, H, K, V]
    per_channel = _per_channel(g, v)
    outs = []
    for t in range(q.shape[1]):
        S = _on_rows(torch.exp(g[:, t]), per_channel) * S  # decay
        k_t = k[:, t]
        v_new = beta[:, t][..., None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S))
        S = S + k_t[..., None] * v_new[..., None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, S, (True, False)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
):
    """The gated delta rule token by token, in the inputs' dtype.

    q, k: [B, T, Hk, K]; v: [B, T, Hv, V]; g (log decays, <= 0): [B, T, Hv], or [B, T, Hv, K] per key channel (KDA);
    beta: [B, T, Hv]; initial_state [N, Hv, K, V] (N = B, or the number of sequences with cu_seqlens, B == 1). Hv
    must be a multiple of Hk. Returns (o [B, T, Hv, V], final state [N, Hv, K, V] or None)."""
    return _run_sequences(lambda q, k, v, g, b, s: _recurrence(q, k, v, g, b, s, scale), q, k, v, g, beta,
                          initial_state, output_final_state, cu_seqlens)


def _run_sequences(walk: Callable, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens):
    """walk(q, k, v, g, beta, S0) -> (o, S) over each sequence, q and k repeated to the value heads (GVA)."""
    G = _group_size(q, k, v)
    _check_varlen(q, cu_seqlens)
    s0 = _initial_state(initial_state, v, k.shape[-1], cu_seqlens)
    q, k = _expand_heads(q, G), _expand_heads(k, G)
    o, S = _per_sequence(walk, (q, k, v, g, beta), s0, cu_seqlens)
    return o, (S if output_final_state else None)


# ---------------------------------------------------------------- the chunkwise form

def _masked_exp_diff(gam: torch.Tensor, per_channel: bool = False) -> torch.Tensor:
    """E_ij = exp(gam_i - gam_j) for j < i, 1 on the diagonal, 0 above it: gam [..., C] gives E [..., C, C]; per
    channel (KDA), gam [..., C, K] gives E [..., C, C, K], one such matrix per key channel. The mask is applied to
    the exponent (-inf) before exp, so the positive differences above the diagonal are never exponentiated; the
    diagonal is the constant 1 (no dependence on gamma: its +/- gradient terms, equal and opposite, are never
    formed)."""
    C = gam.shape[-2] if per_channel else gam.shape[-1]
    strict = torch.ones(C, C, dtype=torch.bool, device=gam.device).tril(-1)
    eye = torch.eye(C, dtype=gam.dtype, device=gam.device)
    if per_channel:
        diff = gam[..., :, None, :] - gam[..., None, :, :]
        strict, eye = strict[..., None], eye[..., None]
    else:
        diff = gam[..., :, None] - gam[..., None, :]
    return torch.exp(torch.where(strict, diff, torch.full_like(diff, float("-inf")))) + eye


def _decay_to_end(g_c: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """gamma_C - gamma_i = sum_{l > i} g_l within the chunk (the token dimension dim), as an exclusive suffix sum
    of g (not a difference of cumulative sums: then its gradient is an exclusive prefix sum, with no cancelling
    terms)."""
    suffix = g_c.flip(dim).cumsum(dim).flip(dim)
    C = g_c.shape[dim]
    return torch.cat([suffix.narrow(dim, 1, C - 1), torch.zeros_like(suffix.narrow(dim, 0, 1))], dim)


def _on_keys(factor: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """A decay factor per token ([..., C]) or per token and key channel ([..., C, K]) shaped to scale [..., C, K]."""
    return factor if per_channel else factor[..., None]


def _decayed_products(a: torch.Tensor, b: torch.Tensor, E: torch.Tensor) -> torch.Tensor:
    """P_ij = sum_c a_ic b_jc E_ij(c) for a, b [..., C, K]: (a b^T) ⊙ E with a per-head gate (E [..., C, C]); per
    channel (E [..., C, C, K]) the decay sits inside the sum over channels and cannot be factored out of it."""
    if E.dim() == a.dim():
        return (a @ b.transpose(-1, -2)) * E
    return torch.einsum("...ic,...jc,...ijc->...ij", a, b, E)


def gated_intra_chunk(k_c, v_c, g_c, b_c):
    """Per chunk ([..., C, *]; g_c [..., C], or [..., C, K] per channel): gamma = cumsum(g) along the chunk,
    E = exp(gamma_i - gamma_j) (j <= i; per channel with a per-channel gate), A = tril(diag(beta) (K K^T ⊙ E), -1)
    (per channel: A_ij = beta_i sum_c k_ic k_jc E_ij(c)), Tinv = (I + A)^{-1}, W = Tinv diag(beta) (exp(gamma) ⊙ K),
    U = Tinv diag(beta) V. Every exponent is <= 0. Returns (gamma, E, A, Tinv, W, U)."""
    C = k_c.shape[-2]
    per_channel = _per_channel(g_c, k_c)
    gam = g_c.cumsum(-2 if per_channel else -1)
    E = _masked_exp_diff(gam, per_channel)
    A = torch.tril(b_c[..., None] * _decayed_products(k_c, k_c, E), diagonal=-1)
    eye = torch.eye(C, dtype=k_c.dtype, device=k_c.device)
    Tinv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    W = Tinv @ (b_c[..., None] * _on_keys(torch.exp(gam), per_channel) * k_c)
    U = Tinv @ (b_c[..., None] * v_c)
    return gam, E, A, Tinv, W, U


def _chunkwise(q, k, v, g, beta, S, scale, chunk_size):
    T = q.shape[1]
    per_channel = _per_channel(g, v)
    tdim = -2 if per_channel else -1  # g's token dimension in a chunk
    q_c, k_c, v_c, g_c, b_c = (to_chunks(x, chunk_size) for x in (q, k, v, g, beta))  # padding: g = beta = 0
    gam, E, _, _, W, U = gated_intra_chunk(k_c, v_c, g_c, b_c)
    qk = _decayed_products(q_c, k_c, E)  # E is already 0 above the diagonal
    qe = _on_keys(torch.exp(gam), per_channel) * q_c  # q_i ⊙ exp(gamma_i), exp(gamma_i) <= 1
    # k_i ⊙ exp(gamma_C - gamma_i) <= 1 (gamma_C: the last row's, padding adds 0)
    kd = _on_keys(torch.exp(_decay_to_end(g_c, tdim)), per_channel) * k_c
    last = torch.exp(gam.select(tdim, -1))  # exp(gamma_C) [b, H, NC] (per channel [b, H, NC, K])
    outs = []
    for c in range(q_c.shape[2]):
        v_new = U[:, :, c] - W[:, :, c] @ S
        outs.append(scale * (qe[:, :, c] @ S + qk[:, :, c] @ v_new))
        S = _on_rows(last[:, :, c], per_channel) * S + kd[:, :, c].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2) if outs else v_c
    return from_chunks(o, T), S, (True, False)


def chunk_gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
):
    """The chunkwise WY form of the gated delta rule (DESIGN.md §11) and of KDA (g [B, T, Hv, K], §12); same
    arguments and results as recurrent_gated_delta_rule, plus chunk_size. Chunks never cross sequences;
    differentiable by autograd. Every decay factor is exp of a non-positive difference of cumulative sums of g
    within one chunk (per channel for KDA), so strong gates (a chunk's cumulative log decay of -1000 and below)
    stay finite and accurate."""
    return _run_sequences(lambda q, k, v, g, b, s: _chunkwise(q, k, v, g, b, s, scale, chunk_size), q, k, v, g,
                          beta, initial_state, output_final_state, cu_seqlens)


# ---------------------------------------------------------------- the manual chunkwise backward

def _rev_cumsum(x: torch.Tensor) -> torch.Tensor:
    """y_j = sum_{i >= j} x_i over the last dimension."""
    return x.flip(-1).cumsum(-1).flip(-1)


def _chunkwise_backward(q, k, v, g, beta, S0, do, dht, scale, chunk_size):
    """One sequence batch [b, t, H, *] (q, k expanded to the value heads), S0 / dht [b, H, K, V].
    Stage by stage as a kernel pipeline would run it; every exponent is <= 0."""
    T = q.shape[1]
    q = q * scale  # scale is folded into q (q gets scale * dq̂ at the end)
    q_c, k_c, v_c, g_c, b_c, do_c = (to_chunks(x, chunk_size) for x in (q, k, v, g, beta, do))
    NC = q_c.shape[2]

    # stage 1 (parallel over chunks): gamma, decays, A, Tinv, W, U
    gam, E, A, Tinv, W, U = gated_intra_chunk(k_c, v_c, g_c, b_c)
    e = torch.exp(gam)                          # exp(gamma_i)
    e_last = torch.exp(gam[..., -1])            # exp(gamma_C) (padding rows add g = 0)
    b_last = torch.exp(_decay_to_end(g_c))      # exp(gamma_C - gamma_i), an exclusive suffix sum of g
    kb = b_c[..., None] * k_c                   # beta K
    kbe = (b_c * e)[..., None] * k_c            # diag(beta exp(gamma)) K: W = Tinv kbe
    vb = b_c[..., None] * v_c                   # beta V: U = Tinv vb
    P = (q_c @ k_c.transpose(-1, -2)) * E       # (Q Kᵀ ⊙ E ⊙ M), q scaled

    # stage 2 (serial, forward): the state entering each chunk, and V'
    h = []
    vn = []
    S = S0
    for c in range(NC):
        h.append(S)
        vn_c = U[:, :, c] - W[:, :, c] @ S
        vn.append(vn_c)
        S = e_last[:, :, c, None, None] * S + (b_last[:, :, c, :, None] * k_c[:, :, c]).transpose(-1, -2) @ vn_c
    h = torch.stack(h, 2) if NC else k_c.new_zeros(*k_c.shape[:3], k.shape[-1], v.shape[-1])
    vn = torch.stack(vn, 2) if NC else v_c

    # stage 3 (serial, reverse): dS_next (the gradient of the state leaving each chunk), dV', dh0
    dS = dht
    dh = [None] * NC
    dvn = [None] * NC
    for c in reversed(range(NC)):
        dh[c] = dS
        dvn_c = P[:, :, c].transpose(-1, -2) @ do_c[:, :, c] + (b_last[:, :, c, :, None] * k_c[:, :, c]) @ dS
        dvn[c] = dvn_c
        dS = ((e[:, :, c, :, None] * q_c[:, :, c]).transpose(-1, -2) @ do_c[:, :, c]
              + e_last[:, :, c, None, None] * dS - W[:, :, c].transpose(-1, -2) @ dvn_c)
    dh0 = dS
    dh = torch.stack(dh, 2) if NC else h
    dvn = torch.stack(dvn, 2) if NC else vn

    # stage 4 (parallel over chunks): direct gradients of the output and the state update
    dP = (do_c @ vn.transpose(-1, -2)) * E               # dO V'ᵀ ⊙ E ⊙ M
    dOS = do_c @ h.transpose(-1, -2)                     # dO Sᵀ   [C, K]
    dq = e[..., None] * dOS + dP @ k_c                   # dQ̂ = diag(e) dO Sᵀ + (dO V'ᵀ ⊙ E ⊙ M) K
    dSv = vn @ dh.transpose(-1, -2)                      # V' dS_nextᵀ  [C, K]: row i = dS_next v'_i
    dk = dP.transpose(-1, -2) @ q_c + b_last[..., None] * dSv
    dW = -dvn @ h.transpose(-1, -2)
    dU = dvn
    # dgamma_i (the local part: factors exp(gamma_i - gamma_j) whose span (j, i] lies inside the chunk, with
    # gamma_0 = 0): Q S through exp(gamma_i); P through E_ij, j < i (+ at i, - at j; E_ii = 1 carries none)
    dPP = torch.tril(dP * (q_c @ k_c.transpose(-1, -2)), -1)  # dP ⊙ P, strictly lower
    dgam = e * (dOS * q_c).sum(-1) + dPP.sum(-1) - dPP.sum(-2)
    # the state path: exp(gamma_C - gamma_i) spans (i, C], exp(gamma_C) spans the whole chunk
    db_path = b_last * (dSv * k_c).sum(-1)               # b_i k_iᵀ dS_next v'_i
    db_before = torch.cat([torch.zeros_like(db_path[..., :1]), db_path.cumsum(-1)[..., :-1]], -1)  # sum_{i<j}
    dg_state = (e_last * (h * dh).sum((-1, -2)))[..., None] + db_before

    # stage 5 (parallel over chunks): through the WY representation, W = Tinv kbe, U = Tinv vb
    dTinv = dW @ kbe.transpose(-1, -2) + dU @ vb.transpose(-1, -2)
    dkbe = Tinv.transpose(-1, -2) @ dW
    dvb = Tinv.transpose(-1, -2) @ dU
    dA = torch.tril(-Tinv.transpose(-1, -2) @ dTinv @ Tinv.transpose(-1, -2), diagonal=-1)
    dAE = dA * E                                        # A_ij = beta_i E_ij k_iᵀ k_j, i > j
    kk = k_c @ k_c.transpose(-1, -2)
    dk = dk + (b_c * e)[..., None] * dkbe + b_c[..., None] * (dAE @ k_c) + dAE.transpose(-1, -2) @ kb
    dv = b_c[..., None] * dvb
    dbeta = (dvb * v_c).sum(-1) + e * (dkbe * k_c).sum(-1) + (dAE * kk).sum(-1)
    dAA = dA * A
    dgam = dgam + (dkbe * kbe).sum(-1) + dAA.sum(-1) - dAA.sum(-2)

    # stage 6: g_j enters every gamma_i with i >= j of its chunk (reverse cumulative sum of dgamma), and the
    # state path's factors: exp(gamma_C) for every j, exp(gamma_C - gamma_i) for every i < j
    dg = _rev_cumsum(dgam) + dg_state

    dq = from_chunks(dq, T) * scale
    return (dq, from_chunks(dk, T), from_chunks(dv, T), from_chunks(dg[..., None], T)[..., 0],
            from_chunks(dbeta[..., None], T)[..., 0], dh0, (True,) * 5 + (False,))


def chunk_gated_delta_rule_backward_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: Optional[torch.Tensor],
    do: torch.Tensor,
    dht: Optional[torch.Tensor],
    chunk_size: int = 64,
    cu_seqlens: Optional[torch.Tensor] = None,
):
    """The manual chunkwise backward of the gated delta rule (DESIGN.md §11), no autograd inside.

    do: [B, T, Hv, V], the gradient of o; dht: [N, Hv, K, V], the gradient of the final state, or None (0).
    Returns (dq, dk [B, T, Hk, K] summed over each group's value heads, dv, dg, dbeta, dh0 [N, Hv, K, V],
    or None when initial_state is None). The per-head gate g [B, T, Hv] only: KDA's per-channel gate is
    differentiated by autograd through chunk_gated_delta_rule_reference."""
    if g.dim() != 3:
        raise ValueError(f"chunk_gated_delta_rule_backward_reference: g must have shape [B, T, Hv] (a per-head gate), "
                         f"got {list(g.shape)}")
    G = _group_size(q, k, v)
    _check_varlen(q, cu_seqlens)
    K = k.shape[-1]
    s0 = _initial_state(initial_state, v, K, cu_seqlens)
    dht = torch.zeros_like(s0) if dht is None else dht.to(v.dtype)
    qe, ke = _expand_heads(q, G), _expand_heads(k, G)
    with torch.no_grad():
        def fn(q, k, v, g, b, do, st):
            s0, dht = st[:, 0], st[:, 1]
            return _chunkwise_backward(q, k, v, g, b, s0, do, dht, scale, chunk_size)
        st = torch.stack([s0, dht], 1)  # one per-sequence tensor: initial state and dht, sliced together
        dq, dk, dv, dg, dbeta, dh0 = _per_sequence(fn, (qe, ke, v, g, beta, do), st, cu_seqlens)
    return (_reduce_heads(dq, G), _reduce_heads(dk, G), dv, dg, dbeta,
            dh0 if initial_state is not None else None)
