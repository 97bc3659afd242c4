"""The gated delta rule's oracles (DESIGN.md §11) agree in float64: the chunkwise form with the recurrence
(outputs, final states, autograd gradients), the manual chunkwise backward with autograd of the recurrence."""
import pytest
import torch

from deltatron.reference import (
    chunk_gated_delta_rule_backward_reference,
    chunk_gated_delta_rule_reference,
    recurrent_delta_rule,
    recurrent_gated_delta_rule,
)

from ..helpers import random_cu_seqlens, rel_rms

FWD_TOL = 1e-12
BWD_TOL = 1e-10
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _inputs(B, T, Hk, Hv, K, V, seed, g_range=(-1.0, 0.0), N=None, initial_state=True, per_channel=False):
    """Fresh random float64 inputs: unit-norm keys, beta in (0, 2), g uniform in g_range ([B, T, Hv], or
    [B, T, Hv, K] per_channel: KDA's gate), h0 [N or B, Hv, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    d = torch.float64
    k = torch.randn(B, T, Hk, K, generator=gen, dtype=d)
    lo, hi = g_range
    inp = dict(
        q=torch.randn(B, T, Hk, K, generator=gen, dtype=d),
        k=k / k.norm(dim=-1, keepdim=True),
        v=torch.randn(B, T, Hv, V, generator=gen, dtype=d),
        g=lo + (hi - lo) * torch.rand(B, T, Hv, *((K,) if per_channel else ()), generator=gen, dtype=d),
        beta=2.0 * torch.rand(B, T, Hv, generator=gen, dtype=d),
    )
    if initial_state:
        inp["initial_state"] = torch.randn(N if N is not None else B, Hv, K, V, generator=gen, dtype=d)
    return {n: x.requires_grad_() for n, x in inp.items()}


def _cotangents(o, s, seed=123):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(o.shape, generator=gen, dtype=o.dtype), torch.randn(s.shape, generator=gen, dtype=s.dtype)


def _forward(fn, inp, scale, cu_seqlens=None, **opts):
    return fn(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale, inp.get("initial_state"), True,
              cu_seqlens=cu_seqlens, **opts)


def _autograd(fn, inp, scale, with_dht=True, cu_seqlens=None, **opts):
    """o, final state and the autograd gradients of <o, do> (+ <S, dht>) of fn; also do and dht."""
    o, s = _forward(fn, inp, scale, cu_seqlens, **opts)
    do, dht = _cotangents(o, s)
    loss = (o * do).sum() + ((s * dht).sum() if with_dht else 0)
    names = [n for n in NAMES if n in inp]
    grads = torch.autograd.grad(loss, [inp[n] for n in names])
    return {"o": o, "state": s, **{f"d{n}": gr for n, gr in zip(names, grads)}}, do, (dht if with_dht else None)


def _manual(inp, scale, do, dht, chunk_size, cu_seqlens=None):
    grads = chunk_gated_delta_rule_backward_reference(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale, inp.get("initial_state"), do, dht,
        chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    out = {f"d{n}": gr for n, gr in zip(NAMES, grads)}
    if "initial_state" not in inp:
        assert out.pop("dinitial_state") is None
    return out


def _assert_close(got, ref, tol):
    for name in ref:
        err = rel_rms(got[name], ref[name])
        assert err <= tol, f"{name}: rel RMS {err:.2e} > {tol:.0e}"


HEADS = [(2, 6), (3, 3)]  # (Hk, Hv): GVA with groups of 3, and one value head per key head


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hk{h[0]}-hv{h[1]}")
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("T", [1, 15, 64, 100])  # one token, a partial chunk, whole chunks, a partial last chunk
def test_chunk_equals_recurrence(T, chunk_size, heads):
    Hk, Hv = heads
    inp = _inputs(2, T, Hk, Hv, 12, 10, seed=T * 7 + chunk_size + Hv, g_range=(-2.0, 0.0))
    ref, _, _ = _autograd(recurrent_gated_delta_rule, inp, 0.37)
    o, s = _forward(chunk_gated_delta_rule_reference, inp, 0.37, chunk_size=chunk_size)
    _assert_close({"o": o, "state": s}, {"o": ref["o"], "state": ref["state"]}, FWD_TOL)
    if T == 100:  # the chunkwise form is differentiable by autograd, and its gradients are the recurrence's
        got, _, _ = _autograd(chunk_gated_delta_rule_reference, inp, 0.37, chunk_size=chunk_size)
        _assert_close(got, ref, BWD_TOL)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hk{h[0]}-hv{h[1]}")
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("T", [1, 15, 100])
@pytest.mark.parametrize("with_dht", [True, False], ids=["dht", "no-dht"])
def test_manual_backward_equals_autograd(T, chunk_size, heads, with_dht):
    Hk, Hv = heads
    inp = _inputs(2, T, Hk, Hv, 12, 10, seed=T * 11 + chunk_size + Hv, g_range=(-2.0, 0.0))
    ref, do, dht = _autograd(recurrent_gated_delta_rule, inp, 0.37, with_dht=with_dht)
    got = _manual(inp, 0.37, do, dht, chunk_size)
    _assert_close(got, {n: ref[n] for n in got}, BWD_TOL)


def test_manual_backward_without_initial_state():
    inp = _inputs(2, 40, 2, 4, 8, 6, seed=21, initial_state=False)
    ref, do, dht = _autograd(recurrent_gated_delta_rule, inp, 0.5)
    got = _manual(inp, 0.5, do, dht, 16)  # asserts dh0 is None
    _assert_close(got, {n: ref[n] for n in got}, BWD_TOL)


def test_varlen_with_empty_sequences():
    C = 16
    lengths = [0, 1, C - 1, C, C + 1, 0, 37]
    cu = random_cu_seqlens(lengths)
    inp = _inputs(1, sum(lengths), 2, 4, 8, 12, seed=5, g_range=(-3.0, 0.0), N=len(lengths))
    ref, do, dht = _autograd(recurrent_gated_delta_rule, inp, 0.5, cu_seqlens=cu)
    # the recurrence on packed sequences is the recurrence on each sequence alone
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o, s = recurrent_gated_delta_rule(*(inp[x][:, bos:eos] for x in NAMES[:5]), 0.5,
                                          inp["initial_state"][n : n + 1], True)
        assert rel_rms(torch.cat([o, ref["o"][:, bos:eos]]), torch.cat([ref["o"][:, bos:eos]] * 2)) <= FWD_TOL \
            if eos > bos else o.shape[1] == 0
        assert rel_rms(s, ref["state"][n : n + 1]) <= FWD_TOL
        if eos == bos:  # an empty sequence keeps its initial state exactly
            assert torch.equal(ref["state"][n], inp["initial_state"][n])
    got, _, _ = _autograd(chunk_gated_delta_rule_reference, inp, 0.5, cu_seqlens=cu, chunk_size=C)
    _assert_close(got, ref, BWD_TOL)
    manual = _manual(inp, 0.5, do, dht, C, cu_seqlens=cu)
    _assert_close(manual, {n: ref[n] for n in manual}, BWD_TOL)


@pytest.mark.parametrize("g_range", [(-20.0, 0.0), (-20.0, -19.0)], ids=["uniform", "all-strong"])
def test_strong_gates(g_range):
    """g down to -20 per token: a chunk's gamma reaches about -640 (uniform) and -1250 (all strong; exp underflows
    to 0 below -745); every exponent the forms take is <= 0, so outputs and gradients are finite and accurate.
    With all gates strong dg is ~1e-7 of the other gradients: it stays accurate relative to itself only because
    no gradient term of a factor that is identically 1 (E_ii, exp(gamma_C - gamma_C)) is ever formed (§11)."""
    C = 64
    inp = _inputs(1, 150, 2, 4, 16, 8, seed=17, g_range=g_range)
    assert inp["g"].detach()[:, :C].sum(1).min() < (-1200 if g_range[1] < -1 else -500)  # one chunk's gamma_C
    ref, do, dht = _autograd(recurrent_gated_delta_rule, inp, 0.4)
    got, _, _ = _autograd(chunk_gated_delta_rule_reference, inp, 0.4, chunk_size=C)
    manual = _manual(inp, 0.4, do, dht, C)
    for res in (got, manual):
        assert all(torch.isfinite(x).all() for x in res.values())
    _assert_close(got, ref, BWD_TOL)
    _assert_close(manual, {n: ref[n] for n in manual}, BWD_TOL)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hk{h[0]}-hv{h[1]}")
def test_no_gate_is_the_delta_rule(heads):
    """g = 0 gives the ungated delta rule (recurrent_delta_rule, q and k repeated over each group's value heads)."""
    Hk, Hv = heads
    inp = _inputs(2, 70, Hk, Hv, 12, 10, seed=8)
    with torch.no_grad():
        inp["g"].zero_()
    G = Hv // Hk
    q, k = (inp[n].detach().repeat_interleave(G, dim=2) for n in ("q", "k"))
    args = (inp["v"].detach(), inp["beta"].detach(), 0.3, inp["initial_state"].detach(), True)
    o_ref, s_ref = recurrent_delta_rule(q, k, *args)
    for fn, opts in ((recurrent_gated_delta_rule, {}), (chunk_gated_delta_rule_reference, {"chunk_size": 32})):
        o, s = _forward(fn, {n: x.detach() for n, x in inp.items()}, 0.3, **opts)
        _assert_close({"o": o, "state": s}, {"o": o_ref, "state": s_ref}, 1e-13)


def test_recurrence_gradcheck():
    """The oracle's own gradients (autograd of the recurrence, the reference of every backward) by finite differences."""
    inp = _inputs(1, 7, 1, 2, 3, 2, seed=3, g_range=(-2.0, 0.0))
    assert torch.autograd.gradcheck(
        lambda q, k, v, g, b, h0: recurrent_gated_delta_rule(q, k, v, g, b, 0.7, h0, True), tuple(inp[n] for n in NAMES))


def test_heads_not_a_multiple():
    inp = _inputs(1, 4, 2, 5, 4, 4, seed=1, initial_state=False)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], 0.5)
    with pytest.raises(ValueError):
        recurrent_gated_delta_rule(*args)
    with pytest.raises(ValueError):
        chunk_gated_delta_rule_reference(*args)
    with pytest.raises(ValueError):
        chunk_gated_delta_rule_backward_reference(*args, None, torch.randn(1, 4, 5, 4, dtype=torch.float64), None)
