"""Helpers of the chunk tests (tests/kernels/chunk/**): packed inputs, float64 models of the per-chunk stages, and the
whole op's gradients against the float64 recurrence. Shapes are tiny for the interpreter."""
import pytest
import torch

import deltatron
from deltatron.kernels.utils import seq_info
from deltatron.reference import intra_chunk_wy, recurrent_delta_rule
from deltatron.reference.chunk import from_chunks, to_chunks

from ...helpers import BOUNDS, DEVICE, INTERPRET, chunk_spans, make_inputs, random_cu_seqlens, rel_rms

# the Triton kernels run on the GPU or, on the CPU, in Triton's interpreter
needs_triton = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# float64 references of fp32 stages agree to ~1e-6; the end-to-end bounds are BOUNDS
STAGE_BOUNDS = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
# one rounding to the dtype (its unit roundoff, about): two computations that round alike differ by this
ONE_ROUNDING_FWD = {torch.float32: 1e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3}

# two computations of one quantity whose fp32 sums run in another order, rounded to the dtype at the end: about
# one rounding of the dtype apart where a sum lands near a rounding boundary (fp32: the sums' order alone)
ONE_ROUNDING_BWD = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


# ---------------------------------------------------------------- forward stages

def packed(lengths, H, K, V, dtype, seed, initial_state=False, **kw):
    """Random packed inputs [1, TT, H, *], their SeqInfo, and float64 copies of the dtype-rounded tensors."""
    inp = make_inputs(1, sum(lengths), H, K, V, dtype, device=DEVICE, seed=seed, initial_state=initial_state,
                      N=len(lengths), **kw)
    ref = {n: x.detach().cpu().double() for n, x in inp.items()}
    return inp, packed_info(lengths), ref


def per_sequence_chunks(lengths, C, fn, *xs):
    """fn applied to each sequence's chunks (to_chunks of float64 [1, L, H, *] slices); its results, each
    [1, H, NC, C, *], are put back on token rows and concatenated: [1, TT, H, *]."""
    outs, bos = None, 0
    for L in lengths:
        if L:
            parts = fn(*(to_chunks(x[:, bos:bos + L], C) for x in xs))
            parts = [from_chunks(p, L) for p in parts]
            outs = [[p] for p in parts] if outs is None else [o + [p] for o, p in zip(outs, parts)]
        bos += L
    return [torch.cat(o, dim=1) for o in outs]


def chunk_rows(lengths, C):
    """(first token, end token, sequence) of every chunk, in global chunk order."""
    out, bos = [], 0
    for n, L in enumerate(lengths):
        out += [(t0, min(t0 + C, bos + L), n) for t0 in range(bos, bos + L, C)]
        bos += L
    return out



def state_reference(k, w, u, h0, lengths, C):
    """Float64 h [NT, H, K, V] (state entering each chunk), v_new [1, TT, H, V], final [N, H, K, V]."""
    H, K, V = k.shape[2], k.shape[3], u.shape[3]
    S = {n: (h0[n] if h0 is not None else torch.zeros(H, K, V, dtype=torch.float64)) for n in range(len(lengths))}
    hs, v_new = [], torch.zeros_like(u)
    for t0, t1, n in chunk_rows(lengths, C):
        hs.append(S[n])
        k_c, w_c, u_c = (x[0, t0:t1].transpose(0, 1) for x in (k, w, u))  # [H, t, *]
        vn = u_c - w_c @ S[n]
        v_new[0, t0:t1] = vn.transpose(0, 1)
        S[n] = S[n] + k_c.transpose(1, 2) @ vn
    h = torch.stack(hs) if hs else torch.zeros(0, H, K, V, dtype=torch.float64)
    return h, v_new, torch.stack([S[n] for n in range(len(lengths))])



def output_reference(q, k, h, v_new, scale, lengths, C, gam=None):
    """Float64 o [1, TT, H, V] = scale (Q S + (Q K^T ⊙ M) V') per chunk, S = h[chunk] [NT, H, K, V]; gam: the gated
    rule's γ [1, TT, H] (the chunk's cumulative log decay): scale (exp(γ) ⊙ Q S + (Q K^T ⊙ exp(γ_i - γ_j) ⊙ M) V').
    q, k may have fewer heads than v_new (value head h reads key head h // (H / HK))."""
    group = v_new.shape[2] // q.shape[2]
    o = torch.zeros_like(v_new)
    for i, (t0, t1, _) in enumerate(chunk_rows(lengths, C)):
        q_c, k_c = (x[0, t0:t1].repeat_interleave(group, dim=1).transpose(0, 1) for x in (q, k))
        vn_c = v_new[0, t0:t1].transpose(0, 1)
        qk = (q_c @ k_c.transpose(1, 2)).tril()
        qs = q_c @ h[i]
        if gam is not None:
            g_c = gam[0, t0:t1].transpose(0, 1)[..., None]  # [H, t, 1]
            qk = qk * torch.exp((g_c - g_c.transpose(1, 2)).clamp(max=0))  # (above the diagonal qk is 0)
            qs = qs * torch.exp(g_c)
        o[0, t0:t1] = (scale * (qs + qk @ vn_c)).transpose(0, 1)
    return o


def packed_info(lengths):
    """The kernels' SeqInfo of packed sequences of these lengths (B = 1) on DEVICE."""
    cu = random_cu_seqlens(lengths, DEVICE)
    return seq_info(1, sum(lengths), torch.device(DEVICE), cu, cu.cpu())


# ---------------------------------------------------------------- backward stages

def packed_growing(lengths, H, K, V, dtype, seed):
    """Random packed inputs [1, TT, H, *] (keys unnormalized, beta in (0, 2): the transition may grow) with
    their SeqInfo and a float64 copy of each tensor as it is after rounding to dtype."""
    inp = make_inputs(1, sum(lengths), H, K, V, dtype, device=DEVICE, normalized_keys=False, beta_max=2.0,
                      seed=seed)
    info = packed_info(lengths)
    ref = {n: x[0].detach().cpu().double() for n, x in inp.items()}
    return inp, info, ref


def group_sums(x, key_heads):
    """[.., H, D] summed over each key head's group of value heads, in head order (as the kernels add them)."""
    groups = x.unflatten(-2, (key_heads, x.shape[-2] // key_heads))
    total = groups[..., 0, :]
    for j in range(1, groups.shape[-2]):
        total = total + groups[..., j, :]
    return total


def heads_first(x, t0, t1):
    return x[t0:t1].transpose(0, 1)  # [t, H, D] -> [H, t, D]


def wy_model(k, v, beta, lengths, C):
    """Float64 W, U [TT, H, *] and T~ [TT, H, C] of every chunk (intra_chunk_wy). T~ is NaN off its
    support (above the diagonal, past the chunk's end): a kernel must not read it there."""
    TT, H = beta.shape
    ws, us, tinv = [], [], k.new_full((TT, H, C), float("nan"))
    for t0, t1 in chunk_spans(lengths, C):
        _, t, w, u = intra_chunk_wy(heads_first(k, t0, t1), heads_first(v, t0, t1), beta[t0:t1].T)
        lower = torch.ones(t1 - t0, t1 - t0, dtype=torch.bool).tril()
        tinv[t0:t1, :, : t1 - t0] = t.transpose(0, 1).where(lower[:, None], float("nan"))
        ws.append(w.transpose(0, 1))
        us.append(u.transpose(0, 1))
    cat = lambda xs, D: torch.cat(xs) if xs else k.new_zeros(0, H, D)
    return cat(ws, k.shape[-1]), cat(us, v.shape[-1]), tinv


def state_model(q, k, w, u, s0, scale, lengths, C):
    """Float64 state pass and output of DESIGN.md §2 given W and U, chunk by chunk. Returns o [TT, H, V],
    final states [N, H, K, V], the state entering and the state leaving every chunk, V' [TT, H, V]."""
    outs, finals, entering, leaving, v_new = [], [], [], [], []
    bos = 0
    for n, L in enumerate(lengths):
        S = s0[n]
        for t0, t1 in chunk_spans([L], C):
            qc, kc, wc, uc = (heads_first(x, bos + t0, bos + t1) for x in (q, k, w, u))
            vn = uc - wc @ S
            outs.append((scale * (qc @ S + (qc @ kc.transpose(1, 2)).tril() @ vn)).transpose(0, 1))
            v_new.append(vn.transpose(0, 1))
            entering.append(S)
            S = S + kc.transpose(1, 2) @ vn
            leaving.append(S)
        finals.append(S)
        bos += L
    cat = lambda xs: torch.cat(xs) if xs else u.new_zeros(0, *u.shape[1:])
    return cat(outs), torch.stack(finals), entering, leaving, cat(v_new)


def to_dev(x, dtype):
    return x.to(device=DEVICE, dtype=dtype)[None].contiguous()



# ---------------------------------------------------------------- the whole op

def gradients(fn, inp, scale, do, dht, cu_seqlens=None, **opts):
    """(dq, dk, dv, dbeta, dh0 or None) of sum(o * do) + sum(final_state * dht) (dht may be None)."""
    o, final = fn(inp["q"], inp["k"], inp["v"], inp["beta"], scale, inp.get("initial_state"), dht is not None,
                  cu_seqlens=cu_seqlens, **opts)[:2]
    loss = (o.double() * do.double()).sum() + (0 if dht is None else (final.double() * dht.double()).sum())
    names = [n for n in ("q", "k", "v", "beta", "initial_state") if n in inp]
    grads = dict(zip(names, torch.autograd.grad(loss, [inp[n] for n in names])))
    return [grads.get(n) for n in ("q", "k", "v", "beta", "initial_state")]


def check_against_recurrence(monkeypatch, B, lengths_or_T, H, K, V, dtype, C, with_state, with_dht,
                             growing=False, l2norm=False, seed=0, **opts):
    """Triton chunk backward (chunk_delta_rule with opts) vs the float64 recurrence; lengths_or_T: T (fixed
    length) or a list of sequence lengths (packed, B = 1); growing: unnormalized keys and beta in (0, 2), so the
    transition is not a contraction. Returns the Triton gradients and dht."""
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    varlen = isinstance(lengths_or_T, list)
    T = sum(lengths_or_T) if varlen else lengths_or_T
    N = len(lengths_or_T) if varlen else B
    inp = make_inputs(B, T, H, K, V, dtype, device=DEVICE, normalized_keys=not growing,
                      beta_max=2.0 if growing else 1.0, initial_state=with_state, N=N, seed=seed, requires_grad=True)
    ref_inp = {n: x.detach().cpu().double().requires_grad_() for n, x in inp.items()}
    cu = random_cu_seqlens(lengths_or_T, DEVICE) if varlen else None
    g = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(B, T, H, V, generator=g).to(dtype)
    dht = torch.randn(N, H, K, V, generator=g) if with_dht else None
    scale = K ** -0.5
    want = gradients(recurrent_delta_rule, ref_inp, scale, do, dht, None if cu is None else cu.cpu(),
                     use_qk_l2norm=l2norm)
    got = gradients(deltatron.chunk_delta_rule, inp, scale, do.to(DEVICE), None if dht is None else dht.to(DEVICE),
                    cu, use_qk_l2norm_in_kernel=l2norm, chunk_size=C, **opts)
    for name, x, ref in zip(("dq", "dk", "dv", "dbeta", "dh0"), got, want):
        if ref is None:
            assert x is None, name
            continue
        assert x.dtype == (torch.float32 if name == "dh0" else dtype), name
        err = rel_rms(x, ref)
        assert err <= BOUNDS[dtype], f"{name}: rel RMS {err:.2e} > {BOUNDS[dtype]:.0e}"
    return got, dht



def hopper_fits(k, v, chunk_size: int = 64) -> bool:
    """Whether the plan can run the Hopper kernels (hopper/walk.py, hopper/reverse.py) on these tensors: sm_90 with
    Gluon (plan.device_capabilities), 16-bit, K = V = 128, chunk 64 (the rest of plan.make_plan's hopper_fits)."""
    from deltatron.kernels.chunk import plan
    return (plan.device_capabilities(k.device).hopper and k.dtype in (torch.bfloat16, torch.float16)
            and k.shape[-1] == v.shape[-1] == 128 and chunk_size == 64)
