"""The three PyTorch implementations agree in float64: outputs, final states and all five gradients."""
import pytest
import torch

from deltatron.reference import chunk_delta_rule_reference, parallel_delta_rule_reference, recurrent_delta_rule

from ..helpers import make_inputs, random_cu_seqlens, rel_rms

TOL = 1e-10


def _run(fn, inp, scale, cu_seqlens=None, **opts):
    o, s = fn(inp["q"], inp["k"], inp["v"], inp["beta"], scale, inp.get("initial_state"), True,
              cu_seqlens=cu_seqlens, **opts)[:2]
    # a loss touching o and the final state, with random weights so no gradient is trivially symmetric
    g = torch.Generator().manual_seed(123)
    loss = (o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() + (
        s * torch.randn(s.shape, generator=g, dtype=s.dtype)).sum()
    names = [n for n in ("q", "k", "v", "beta", "initial_state") if n in inp]
    grads = torch.autograd.grad(loss, [inp[n] for n in names])
    return {"o": o, "state": s, **{f"d{n}": gr for n, gr in zip(names, grads)}}


def _assert_close(got, ref, tol=TOL):
    for name in ref:
        err = rel_rms(got[name], ref[name])
        assert err <= tol, f"{name}: rel RMS {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("T", [1, 15, 64, 100, 257])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_forms_agree_float64(T, chunk_size, with_state):
    B, H, K, V = 2, 3, 24, 40  # odd head sizes, K != V, B*H >= 2
    inp = make_inputs(B, T, H, K, V, torch.float64, normalized_keys=False, beta_max=2.0,
                      initial_state=with_state, seed=T * 7 + chunk_size, requires_grad=True)
    scale = 0.37
    ref = _run(recurrent_delta_rule, inp, scale)
    _assert_close(_run(chunk_delta_rule_reference, inp, scale, chunk_size=chunk_size), ref)
    if chunk_size == 64:  # the parallel form has no chunk size
        _assert_close(_run(parallel_delta_rule_reference, inp, scale), ref)


@pytest.mark.parametrize("form", ["recurrent", "chunk", "parallel"])
def test_varlen_equals_per_sequence(form):
    C = 16
    lengths = [0, 1, C - 1, C, C + 1, 0, 37]
    H, K, V = 2, 8, 12
    fn = {"recurrent": recurrent_delta_rule, "chunk": chunk_delta_rule_reference,
          "parallel": parallel_delta_rule_reference}[form]
    opts = {"chunk_size": C} if form == "chunk" else {}
    packed = make_inputs(1, sum(lengths), H, K, V, torch.float64, initial_state=True, N=len(lengths), seed=5,
                         requires_grad=True)
    cu = random_cu_seqlens(lengths)
    got = _run(fn, packed, 0.5, cu_seqlens=cu, **opts)
    # each sequence alone, with the same per-sequence loss weights sliced out of the packed ones
    outs, states = [], []
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o, s = fn(packed["q"][:, bos:eos], packed["k"][:, bos:eos], packed["v"][:, bos:eos],
                  packed["beta"][:, bos:eos], 0.5, packed["initial_state"][n : n + 1], True, **opts)[:2]
        outs.append(o)
        states.append(s)
    o, s = torch.cat(outs, 1), torch.cat(states, 0)
    g = torch.Generator().manual_seed(123)
    loss = (o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() + (
        s * torch.randn(s.shape, generator=g, dtype=s.dtype)).sum()
    names = ["q", "k", "v", "beta", "initial_state"]
    grads = torch.autograd.grad(loss, [packed[n] for n in names])
    ref = {"o": o, "state": s, **{f"d{n}": gr for n, gr in zip(names, grads)}}
    _assert_close(got, ref, 1e-12)
    # empty sequences keep their initial state exactly
    for n, L in enumerate(lengths):
        if L == 0:
            assert torch.equal(got["state"][n], packed["initial_state"][n])


def test_parallel_attention_matrix():
    inp = make_inputs(2, 33, 2, 16, 8, torch.float64, seed=9)
    o, _, P = parallel_delta_rule_reference(inp["q"], inp["k"], inp["v"], inp["beta"], 0.25,
                                            output_attentions=True)
    assert P.shape == (2, 2, 33, 33)
    assert torch.equal(P, P.tril()), "the attention matrix must be causal"
    o_from_p = (P @ inp["v"].movedim(2, 1)).movedim(1, 2)
    assert rel_rms(o_from_p, o) <= TOL


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_gradcheck(form):
    fn = {"recurrent": recurrent_delta_rule, "chunk": chunk_delta_rule_reference}[form]
    opts = {"chunk_size": 16} if form == "chunk" else {}
    inp = make_inputs(1, 19, 2, 5, 3, torch.float64, normalized_keys=False, beta_max=1.5, initial_state=True,
                      seed=3, requires_grad=True)

    def f(q, k, v, beta, h0):
        return fn(q, k, v, beta, 0.7, h0, True, **opts)

    assert torch.autograd.gradcheck(f, tuple(inp[n] for n in ("q", "k", "v", "beta", "initial_state")))


def test_l2norm_inside_op_matches_normalized_inputs():
    inp = make_inputs(1, 20, 2, 8, 8, torch.float64, normalized_keys=False, seed=4)
    qn = inp["q"] / inp["q"].norm(dim=-1, keepdim=True)
    kn = inp["k"] / inp["k"].norm(dim=-1, keepdim=True)
    o1, _ = recurrent_delta_rule(inp["q"], inp["k"], inp["v"], inp["beta"], 0.3, use_qk_l2norm=True)
    o2, _ = recurrent_delta_rule(qn, kn, inp["v"], inp["beta"], 0.3)
    assert rel_rms(o1, o2) <= 1e-6  # eps = 1e-6 inside the square root
