"""deltatron/api.py's gated entry points (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule) on the PyTorch
backend against the float64 recurrence (deltatron.reference.recurrent_gated_delta_rule), with every option of fla's
signatures: grouped value heads, the gate and beta computed from raw projections, beta in (0, 2), V-first states,
in-op L2 norm, varlen with empty sequences, in-place final states; and the argument checks."""
import pytest
import torch
import torch.nn.functional as F

import deltatron
from deltatron.reference import recurrent_gated_delta_rule
from deltatron.reference.common import L2NORM_EPS

from .helpers import BOUNDS, DEVICE, INTERPRET, random_cu_seqlens, rel_rms

ENTRY_POINTS = {"chunk": deltatron.chunk_gated_delta_rule, "fused_recurrent": deltatron.fused_recurrent_gated_delta_rule}


def raw_inputs(B, T, Hk, Hv, K, V, N, seed=0, strong=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    a = torch.rand(B, T, Hv, generator=gen) * -20 if strong else r(B, T, Hv)
    return dict(q=r(B, T, Hk, K), k=r(B, T, Hk, K), v=r(B, T, Hv, V), a=a, b=r(B, T, Hv), A_log=r(Hv) * 0.5,
                dt_bias=r(Hv), h0=r(N, Hv, K, V))


def l2(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("form", ENTRY_POINTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [None, (0, 7, 33, 1)])
def test_gated_ops_match_the_recurrence_with_every_option(form, dtype, lengths, backend, monkeypatch):
    if backend == "triton" and DEVICE == "cpu" and not INTERPRET:
        pytest.skip("the Triton backend needs a GPU or TRITON_INTERPRET=1")
    monkeypatch.setenv("DELTATRON_BACKEND", backend)
    device = DEVICE if backend == "triton" else "cpu"
    B, T = (2, 41) if lengths is None else (1, sum(lengths))
    Hk, Hv, K, V = 2, 6, 16, 24
    N = B if lengths is None else len(lengths)
    x = raw_inputs(B, T, Hk, Hv, K, V, N)
    cu = None if lengths is None else random_cu_seqlens(lengths)
    h0_vfirst = x["h0"].transpose(-1, -2).contiguous()
    leaves = {n: t.to(device, dtype).requires_grad_() if n in ("q", "k", "v", "a", "b") else
              t.to(device, copy=True).requires_grad_() for n, t in dict(x, h0=h0_vfirst).items()}
    cu = None if cu is None else cu.to(device)
    extra = {"chunk_size": 16} if form == "chunk" else {}
    o, ht = ENTRY_POINTS[form](
        leaves["q"], leaves["k"], leaves["v"], leaves["a"], leaves["b"], initial_state=leaves["h0"],
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, use_gate_in_kernel=True,
        A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
        state_v_first=True, **extra)
    assert o.dtype == dtype and ht.dtype == torch.float32 and ht.shape == (N, Hv, V, K)
    gen = torch.Generator().manual_seed(7)  # a fixed draw: dA_log and ddt_bias sum dg over every token and can cancel
    do, dht = torch.randn(o.shape, generator=gen).to(device), torch.randn(ht.shape, generator=gen).to(device)
    torch.autograd.backward((o.float(), ht), (do, dht))

    ref = {n: t.detach().to(dtype).double().requires_grad_() if n in ("q", "k", "v", "a", "b")
           else t.detach().double().requires_grad_() for n, t in leaves.items()}
    g = -ref["A_log"].exp() * F.softplus(ref["a"] + ref["dt_bias"])
    o_ref, ht_ref = recurrent_gated_delta_rule(l2(ref["q"]), l2(ref["k"]), ref["v"], g, 2 * ref["b"].sigmoid(),
                                               K ** -0.5, ref["h0"].transpose(-1, -2), True, cu)
    torch.autograd.backward((o_ref, ht_ref.transpose(-1, -2)), (do.double(), dht.double()))
    errors = {"o": rel_rms(o, o_ref), "state": rel_rms(ht, ht_ref.transpose(-1, -2))}
    errors.update({f"d{n}": rel_rms(leaves[n].grad, ref[n].grad) for n in leaves})
    bad = {n: f"{e:.1e}" for n, e in errors.items() if not e <= BOUNDS[dtype]}
    assert not bad, bad


@pytest.mark.parametrize("form", ENTRY_POINTS)
def test_strong_gates_stay_finite_and_accurate(form):
    x = raw_inputs(1, 130, 2, 2, 16, 16, 1, seed=1, strong=True)  # g down to -20 a token
    q, k, v, g, b = x["q"], F.normalize(x["k"], dim=-1), x["v"], x["a"], x["b"].sigmoid()
    o, ht = ENTRY_POINTS[form](q, k, v, g, b, initial_state=x["h0"], output_final_state=True)
    o_ref, ht_ref = recurrent_gated_delta_rule(q.double(), k.double(), v.double(), g.double(), b.double(),
                                               16 ** -0.5, x["h0"].double(), True)
    assert rel_rms(o, o_ref) <= BOUNDS[torch.float32] and rel_rms(ht, ht_ref) <= BOUNDS[torch.float32]


def test_zero_gate_is_the_delta_rule():
    x = raw_inputs(2, 40, 3, 3, 16, 16, 2)
    q, k, v, b = x["q"], F.normalize(x["k"], dim=-1), x["v"], x["b"].sigmoid()
    o, ht = deltatron.chunk_gated_delta_rule(q, k, v, torch.zeros_like(b), b, initial_state=x["h0"],
                                             output_final_state=True)
    o0, ht0 = deltatron.chunk_delta_rule(q, k, v, b, initial_state=x["h0"], output_final_state=True)
    assert rel_rms(o, o0) < 1e-5 and rel_rms(ht, ht0) < 1e-5


def test_inplace_final_state_updates_the_callers_pool():
    x = raw_inputs(3, 1, 2, 4, 16, 16, 3)
    q, k, v, g, b = x["q"], x["k"], x["v"], -F.softplus(x["a"]), x["b"].sigmoid()
    pool = x["h0"].transpose(-1, -2).contiguous()  # V-first, as engines keep it
    expected = deltatron.fused_recurrent_gated_delta_rule(q, k, v, g, b, initial_state=pool.clone(),
                                                          output_final_state=True, state_v_first=True)[1]
    with torch.no_grad():
        o, ht = deltatron.fused_recurrent_gated_delta_rule(q, k, v, g, b, initial_state=pool,
                                                           inplace_final_state=True, state_v_first=True)
    assert ht is pool and torch.equal(pool, expected)


@pytest.mark.parametrize("change, match", [
    (dict(v=torch.randn(2, 9, 5, 8)), "Hv a multiple"),
    (dict(g=torch.randn(2, 9, 2)), r"g must have shape \[B, T, Hv\]"),
    (dict(beta=torch.rand(2, 9, 2)), r"beta must have shape \[B, T, Hv\]"),
    (dict(initial_state=torch.zeros(2, 2, 8, 8)), r"initial_state must have shape \[N, Hv, K, V\]"),
    (dict(use_gate_in_kernel=True), "needs A_log"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(3)), "dt_bias must be"),
    (dict(A_log=torch.zeros(4)), "only with use_gate_in_kernel"),
    (dict(allow_neg_eigval=1), "allow_neg_eigval must be a bool"),
    (dict(head_first=True), "head_first"),
])
def test_gated_argument_errors_name_the_argument(change, match):
    args = dict(q=torch.randn(2, 9, 2, 8), k=torch.randn(2, 9, 2, 8), v=torch.randn(2, 9, 4, 8),
                g=-torch.rand(2, 9, 4), beta=torch.rand(2, 9, 4))
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        deltatron.chunk_gated_delta_rule(**args)
