"""deltatron/api.py's gated entry points (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, and KDA's
chunk_kda, fused_recurrent_kda with the per-channel gate) on both backends against the float64 recurrence
(deltatron.reference.recurrent_gated_delta_rule), with every option of fla's signatures: grouped value heads, the
gate and beta computed from raw projections, beta in (0, 2), V-first states, in-op L2 norm, varlen with empty
sequences, in-place final states; and the argument checks."""
import pytest
import torch
import torch.nn.functional as F

import deltatron
from deltatron.kernels.chunk import plan as chunk_plan
from deltatron.reference import recurrent_gated_delta_rule
from deltatron.reference.common import L2NORM_EPS

from .helpers import BOUNDS, DEVICE, INTERPRET, random_cu_seqlens, rel_rms

ENTRY_POINTS = {"chunk": deltatron.chunk_gated_delta_rule,
                "fused_recurrent": deltatron.fused_recurrent_gated_delta_rule}
KDA_ENTRY_POINTS = {"chunk": deltatron.chunk_kda, "fused_recurrent": deltatron.fused_recurrent_kda}
RULES = {"gated": ENTRY_POINTS, "kda": KDA_ENTRY_POINTS}


def raw_inputs(B, T, Hk, Hv, K, V, N, seed=0, strong=False, per_channel=False):
    """Raw projections: a (the gate's, [B, T, Hv], or [B, T, Hv, K] per_channel), b (beta's logits), A_log and
    dt_bias (Kimi Linear's shapes per_channel: [1, 1, Hv, 1] and [Hv * K]), h0."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    a_shape = (B, T, Hv, K) if per_channel else (B, T, Hv)
    a = torch.rand(*a_shape, generator=gen) * -20 if strong else r(*a_shape)
    return dict(q=r(B, T, Hk, K), k=r(B, T, Hk, K), v=r(B, T, Hv, V), a=a, b=r(B, T, Hv),
                A_log=r(1, 1, Hv, 1) * 0.5 if per_channel else r(Hv) * 0.5, dt_bias=r(Hv * K if per_channel else Hv),
                h0=r(N, Hv, K, V))


def made_gate(a, A_log, dt_bias):
    """-exp(A_log) softplus(a + dt_bias), per head, or per channel (a [B, T, Hv, K]) in Kimi Linear's shapes."""
    if a.dim() == 4:
        Hv, K = a.shape[2:]
        return -A_log.reshape(Hv, 1).exp() * F.softplus(a + dt_bias.reshape(Hv, K))
    return -A_log.exp() * F.softplus(a + dt_bias)


def l2(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("form", ENTRY_POINTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [None, (0, 7, 33, 1)])
@pytest.mark.parametrize("rule", RULES)
def test_gated_ops_match_the_recurrence_with_every_option(rule, form, dtype, lengths, backend, monkeypatch):
    if backend == "triton" and DEVICE == "cpu" and not INTERPRET:
        pytest.skip("the Triton backend needs a GPU or TRITON_INTERPRET=1")
    monkeypatch.setenv("DELTATRON_BACKEND", backend)
    device = DEVICE if backend == "triton" else "cpu"
    B, T = (2, 41) if lengths is None else (1, sum(lengths))
    Hk, Hv, K, V = 2, 6, 16, 24
    N = B if lengths is None else len(lengths)
    x = raw_inputs(B, T, Hk, Hv, K, V, N, per_channel=rule == "kda")
    cu = None if lengths is None else random_cu_seqlens(lengths)
    h0_vfirst = x["h0"].transpose(-1, -2).contiguous()
    leaves = {n: t.to(device, dtype).requires_grad_() if n in ("q", "k", "v", "a", "b") else
              t.to(device, copy=True).requires_grad_() for n, t in dict(x, h0=h0_vfirst).items()}
    cu = None if cu is None else cu.to(device)
    extra = {"chunk_size": 16} if form == "chunk" else {}
    o, ht = RULES[rule][form](
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
    g = made_gate(ref["a"], ref["A_log"], ref["dt_bias"])
    o_ref, ht_ref = recurrent_gated_delta_rule(l2(ref["q"]), l2(ref["k"]), ref["v"], g, 2 * ref["b"].sigmoid(),
                                               K ** -0.5, ref["h0"].transpose(-1, -2), True, cu)
    torch.autograd.backward((o_ref, ht_ref.transpose(-1, -2)), (do.double(), dht.double()))
    errors = {"o": rel_rms(o, o_ref), "state": rel_rms(ht, ht_ref.transpose(-1, -2))}
    errors.update({f"d{n}": rel_rms(leaves[n].grad, ref[n].grad) for n in leaves})
    bad = {n: f"{e:.1e}" for n, e in errors.items() if not e <= BOUNDS[dtype]}
    assert not bad, bad


@pytest.mark.parametrize("form", ENTRY_POINTS)
@pytest.mark.parametrize("rule", RULES)
def test_strong_gates_stay_finite_and_accurate(rule, form):
    # g down to -20 a token (per channel for KDA): a chunk's cumulative log decay reaches about -640
    x = raw_inputs(1, 130, 2, 2, 16, 16, 1, seed=1, strong=True, per_channel=rule == "kda")
    q, k, v, g, b = x["q"], F.normalize(x["k"], dim=-1), x["v"], x["a"], x["b"].sigmoid()
    o, ht = RULES[rule][form](q, k, v, g, b, initial_state=x["h0"], output_final_state=True)
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


def test_kda_with_equal_channels_is_the_gated_rule():
    x = raw_inputs(2, 40, 1, 3, 16, 8, 2)
    q, k, v, g, b = x["q"], F.normalize(x["k"], dim=-1), x["v"], -F.softplus(x["a"]), x["b"].sigmoid()
    for form in ENTRY_POINTS:
        o, ht = ENTRY_POINTS[form](q, k, v, g, b, initial_state=x["h0"], output_final_state=True)
        o_kda, ht_kda = KDA_ENTRY_POINTS[form](q, k, v, g[..., None].expand(-1, -1, -1, 16), b, initial_state=x["h0"],
                                               output_final_state=True)
        assert rel_rms(o_kda, o) < 1e-5 and rel_rms(ht_kda, ht) < 1e-5


def test_kda_gate_is_kimi_linears():
    """use_gate_in_kernel makes the gate of transformers' KimiLinearForgetGate from its projection, dt_bias and A_log
    in their own shapes ([Hv * K] and [1, 1, Hv, 1])."""
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForgetGate

    Hv, K = 3, 8
    torch.manual_seed(0)
    gate = KimiLinearForgetGate(KimiLinearConfig(hidden_size=16, linear_attn_config={"head_dim": K, "num_heads": Hv}))
    with torch.no_grad():
        gate.A_log.uniform_(0.0, 2.0)
        gate.dt_bias.normal_()
    hidden = torch.randn(1, 5, 16) * 4  # softplus's inputs on both sides of its threshold
    with torch.no_grad():
        want = gate(hidden)
        raw = gate.f_b_proj(gate.f_a_proj(hidden)).view(1, 5, Hv, K)
    x = raw_inputs(1, 5, 1, Hv, K, 4, 1)
    for entry in KDA_ENTRY_POINTS.values():
        o, _ = entry(x["q"], x["k"], x["v"], raw, x["b"].sigmoid(), use_gate_in_kernel=True, A_log=gate.A_log.data,
                     dt_bias=gate.dt_bias.data)
        o_ref, _ = entry(x["q"], x["k"], x["v"], want, x["b"].sigmoid())
        assert rel_rms(o, o_ref) < 1e-6


@pytest.mark.parametrize("change, match", [
    (dict(g=-torch.rand(2, 9, 4)), r"g must have shape \[B, T, Hv, K\] = \[2, 9, 4, 8\]"),
    (dict(g=-torch.rand(2, 9, 4, 4)), r"g must have shape \[B, T, Hv, K\]"),
    (dict(use_gate_in_kernel=True), r"needs A_log \[4\] or \[1, 1, 4, 1\]"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(4, 1), dt_bias=torch.zeros(32)), "A_log must be"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(4)),
     r"dt_bias must be a floating-point \[32\] or \[4, 8\]"),
    (dict(dt_bias=torch.zeros(32)), "only with use_gate_in_kernel"),
    (dict(head_first=True), "head_first"),
])
@pytest.mark.parametrize("form", KDA_ENTRY_POINTS)
def test_kda_argument_errors_name_the_argument(form, change, match):
    args = dict(q=torch.randn(2, 9, 2, 8), k=torch.randn(2, 9, 2, 8), v=torch.randn(2, 9, 4, 8),
                g=-torch.rand(2, 9, 4, 8), beta=torch.rand(2, 9, 4))
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        KDA_ENTRY_POINTS[form](**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_chunk_kda_runs_chunkwise_where_the_device_holds_the_heads(dtype, monkeypatch):
    """On the Triton backend chunk_kda runs the chunk form's kernels, inference and training calls alike, every option
    of fla's signature on, with the gradients of the float64 recurrence; at K = V = 256, the largest heads, too, and
    the token-serial fused_recurrent kernels there on a GPU whose shared memory does not hold the chunk kernels."""
    if DEVICE == "cpu" and not INTERPRET:
        pytest.skip("the Triton backend needs a GPU or TRITON_INTERPRET=1")
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    ran = []
    triton_form = deltatron.backends.triton_form
    monkeypatch.setattr(deltatron.backends, "triton_form", lambda name: ran.append(name) or triton_form(name))
    lengths = (0, 7, 40, 1)
    Hk, Hv, K, V = 2, 4, 16, 24
    x = raw_inputs(1, sum(lengths), Hk, Hv, K, V, len(lengths), seed=3, per_channel=True)
    x = {n: t.to(DEVICE, dtype) if n in ("q", "k", "v", "a", "b") else t.to(DEVICE) for n, t in x.items()}
    h0 = x["h0"].transpose(-1, -2).contiguous()
    cu = random_cu_seqlens(lengths).to(DEVICE)

    def call(q):
        return deltatron.chunk_kda(q, x["k"], x["v"], x["a"], x["b"], initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, cu_seqlens=cu, chunk_size=16, use_gate_in_kernel=True,
                                   A_log=x["A_log"], dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=True,
                                   allow_neg_eigval=True, state_v_first=True)

    with torch.no_grad():
        o, ht = call(x["q"])
    assert ran == ["chunk"]
    ref = {n: t.cpu().double() for n, t in x.items()}
    o_ref, ht_ref = recurrent_gated_delta_rule(
        l2(ref["q"]), l2(ref["k"]), ref["v"], made_gate(ref["a"], ref["A_log"], ref["dt_bias"]),
        2 * ref["b"].sigmoid(), K ** -0.5, ref["h0"], True, random_cu_seqlens(lengths))
    assert rel_rms(o, o_ref) <= BOUNDS[dtype] and rel_rms(ht, ht_ref.transpose(-1, -2)) <= BOUNDS[dtype]

    q = x["q"].clone().requires_grad_()
    o_train, ht_train = call(q)
    assert ran == ["chunk", "chunk"] and o_train.requires_grad
    assert rel_rms(o_train, o_ref) <= BOUNDS[dtype] and rel_rms(ht_train, ht_ref.transpose(-1, -2)) <= BOUNDS[dtype]
    do = torch.randn(o_train.shape, generator=torch.Generator().manual_seed(4)).to(o_train)
    (dq,) = torch.autograd.grad(o_train, q, do)
    q_ref = ref["q"].clone().requires_grad_()
    o_ref, _ = recurrent_gated_delta_rule(
        l2(q_ref), l2(ref["k"]), ref["v"], made_gate(ref["a"], ref["A_log"], ref["dt_bias"]),
        2 * ref["b"].sigmoid(), K ** -0.5, ref["h0"], True, random_cu_seqlens(lengths))
    (dq_ref,) = torch.autograd.grad(o_ref, q_ref, do.cpu().double())
    assert rel_rms(dq, dq_ref) <= BOUNDS[dtype]

    x = {n: t.to(DEVICE, dtype) if n in ("q", "k", "v", "a", "b") else t.to(DEVICE)
         for n, t in raw_inputs(1, 9, 1, 1, 256, 256, 1, seed=5, per_channel=True).items()}
    args = (l2(x["q"]), l2(x["k"]), x["v"], x["a"].float().sigmoid().log(), x["b"].float().sigmoid())
    with torch.no_grad():
        o, _ = deltatron.chunk_kda(*args)
    assert ran[2:] == ["chunk"]
    ref = {n: t.cpu().double() for n, t in x.items()}
    o_ref, _ = recurrent_gated_delta_rule(l2(ref["q"]), l2(ref["k"]), ref["v"], args[3].cpu().double(),
                                          ref["b"].sigmoid(), 256 ** -0.5)
    assert rel_rms(o, o_ref) <= BOUNDS[dtype]
    monkeypatch.setattr(chunk_plan, "device_capabilities", lambda device: chunk_plan.named_capabilities("sm80"))
    with torch.no_grad():
        o, _ = deltatron.chunk_kda(*args)
    assert ran[3:] == ["fused_recurrent"] and rel_rms(o, o_ref) <= BOUNDS[dtype]
    with pytest.raises(ValueError, match="output_chunk_states needs the chunk kernels' walk.* has 166,912"):
        deltatron.chunk_kda(*args, output_chunk_states=True)
