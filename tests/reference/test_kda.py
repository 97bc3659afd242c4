"""Kimi Delta Attention's oracles (DESIGN.md §12): the gated references with a per-channel gate g [B, T, Hv, K]
agree in float64, the chunkwise form with the recurrence (outputs, final states, autograd gradients), including
strong gates whose cumulative log decay within a chunk passes -1000."""
import pytest
import torch

from deltatron.reference import (chunk_gated_delta_rule_backward_reference, chunk_gated_delta_rule_reference,
                                 recurrent_gated_delta_rule)

from ..helpers import random_cu_seqlens, rel_rms
from .test_gated import BWD_TOL, FWD_TOL, HEADS, NAMES, _assert_close, _autograd, _forward, _inputs


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hk{h[0]}-hv{h[1]}")
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("T", [1, 15, 100])  # one token, a partial chunk, a partial last chunk
def test_chunk_equals_recurrence(T, chunk_size, heads):
    Hk, Hv = heads
    inp = _inputs(2, T, Hk, Hv, 12, 10, seed=T * 5 + chunk_size + Hv, g_range=(-2.0, 0.0), per_channel=True)
    ref, _, _ = _autograd(recurrent_gated_delta_rule, inp, 0.37)
    got, _, _ = _autograd(chunk_gated_delta_rule_reference, inp, 0.37, chunk_size=chunk_size)
    assert got["dg"].shape == inp["g"].shape
    _assert_close(got, ref, BWD_TOL)


def test_varlen_with_empty_sequences():
    C = 16
    lengths = [0, 1, C - 1, C, C + 1, 0, 37]
    cu = random_cu_seqlens(lengths)
    inp = _inputs(1, sum(lengths), 2, 4, 8, 12, seed=5, g_range=(-3.0, 0.0), N=len(lengths), per_channel=True)
    ref, _, _ = _autograd(recurrent_gated_delta_rule, inp, 0.5, cu_seqlens=cu)
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o, s = recurrent_gated_delta_rule(*(inp[x][:, bos:eos] for x in NAMES[:5]), 0.5,
                                          inp["initial_state"][n : n + 1], True)
        if eos > bos:  # the recurrence on packed sequences is the recurrence on each sequence alone
            assert rel_rms(o, ref["o"][:, bos:eos]) <= FWD_TOL
        assert rel_rms(s, ref["state"][n : n + 1]) <= FWD_TOL
        if eos == bos:  # an empty sequence keeps its initial state exactly
            assert torch.equal(ref["state"][n], inp["initial_state"][n])
    got, _, _ = _autograd(chunk_gated_delta_rule_reference, inp, 0.5, cu_seqlens=cu, chunk_size=C)
    _assert_close(got, ref, BWD_TOL)


@pytest.mark.parametrize("g_range", [(-20.0, 0.0), (-20.0, -19.0)], ids=["uniform", "all-strong"])
def test_strong_gates(g_range):
    """g down to -20 per token and channel: a chunk's cumulative log decay reaches about -640 (uniform) and -1250
    (all strong) per channel, far past exp's underflow at -745 and overflow of its inverse; every factor the
    chunkwise form takes is exp of a non-positive difference, so outputs and gradients stay finite and equal the
    recurrence's."""
    C = 64
    inp = _inputs(1, 150, 2, 4, 16, 8, seed=17, g_range=g_range, per_channel=True)
    assert inp["g"].detach()[:, :C].sum(1).min() < (-1200 if g_range[1] < -1 else -500)
    ref, _, _ = _autograd(recurrent_gated_delta_rule, inp, 0.4)
    got, _, _ = _autograd(chunk_gated_delta_rule_reference, inp, 0.4, chunk_size=C)
    assert all(torch.isfinite(x).all() for x in got.values())
    _assert_close(got, ref, BWD_TOL)


def test_mixed_channel_strengths():
    """Some channels decay to nothing within a token while others keep their memory: the channels do not mix."""
    inp = _inputs(1, 80, 1, 2, 8, 6, seed=9, per_channel=True)
    with torch.no_grad():
        inp["g"][..., :4] = -20 + torch.rand_like(inp["g"][..., :4])  # strong on half the channels
        inp["g"][..., 4:] = -1e-3 * torch.rand_like(inp["g"][..., 4:])  # nearly none on the others
    ref, _, _ = _autograd(recurrent_gated_delta_rule, inp, 0.4)
    got, _, _ = _autograd(chunk_gated_delta_rule_reference, inp, 0.4, chunk_size=32)
    _assert_close(got, ref, BWD_TOL)


@pytest.mark.parametrize("form", [recurrent_gated_delta_rule, chunk_gated_delta_rule_reference])
def test_equal_channels_are_the_per_head_gate(form):
    """A per-channel gate equal across channels is the gated delta rule's per-head gate; its dg sums to that dg."""
    inp = _inputs(2, 40, 2, 4, 8, 6, seed=4)
    ref, _, _ = _autograd(form, inp, 0.3)
    wide = dict(inp, g=inp["g"].detach()[..., None].expand(-1, -1, -1, 8).clone().requires_grad_())
    got, _, _ = _autograd(form, wide, 0.3)
    got["dg"] = got["dg"].sum(-1)
    _assert_close(got, ref, 1e-12)


def test_recurrence_gradcheck():
    """The oracle's own gradients with a per-channel gate by finite differences."""
    inp = _inputs(1, 6, 1, 2, 3, 2, seed=3, g_range=(-2.0, 0.0), per_channel=True)
    fn = lambda q, k, v, g, b, h0: recurrent_gated_delta_rule(q, k, v, g, b, 0.7, h0, True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, tuple(inp[n] for n in NAMES))


def test_manual_backward_takes_the_per_head_gate_only():
    inp = _inputs(1, 4, 1, 1, 4, 4, seed=1, per_channel=True)
    args = [inp[n].detach() for n in NAMES]
    do = torch.randn(1, 4, 1, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, Hv\]"):
        chunk_gated_delta_rule_backward_reference(*args[:5], 0.5, args[5], do, None)
