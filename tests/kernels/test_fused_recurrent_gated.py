"""The gated delta rule and grouped value heads (DESIGN.md §11) in the token-recurrent Triton kernels
(deltatron/kernels/fused_recurrent.py, USE_G), called as the form is: forward(..., g=g), backward(..., g=g).

o, the final state and dq, dk, dv, dbeta, dg, dh0 are checked against torch.autograd through the float64 oracle
(deltatron.reference.recurrent_gated_delta_rule) on the same inputs after rounding to the test dtype, with the
relative-RMS bounds of tests/helpers.py. The loss is <o, do> + <final state, dht> for random do, dht."""
import pytest
import torch

import deltatron.kernels.fused_recurrent as fused_recurrent
from deltatron.kernels.utils import seq_info

from deltatron.reference import recurrent_gated_delta_rule

from ..helpers import BOUNDS, DEVICE, INTERPRET, check_gated_form, make_gated_inputs, rel_rms

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")


def check(*args, **kwargs):
    return check_gated_form(fused_recurrent, *args, **kwargs)


# K, V not powers of two; GVA (Hk = 2, Hv = 6; Hk = 1, Hv = 2) and Hk = Hv; T = 1, partial segments and
# sub-blocks (T = 100: SEGMENT 64, SUBSEGMENT 8). Small head counts: the interpreter runs the gated backward's
# rebuild (about 8 state steps a token) at some 50 ms a token and head
CASES = [
    # B, T, Hk, Hv, K, V
    (2, 1, 2, 6, 24, 40),
    (1, 100, 1, 2, 24, 40),
    (2, 19, 3, 3, 40, 24),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("B, T, Hk, Hv, K, V", CASES)
def test_matches_float64_oracle(B, T, Hk, Hv, K, V, dtype):
    if T > 64 and dtype == torch.float16:
        pytest.skip("time: fp16's long case adds nothing to bf16's (a wider bound) and fp32's")
    assert fused_recurrent.SEGMENT == 64
    check(B, T, Hk, Hv, K, V, dtype, seed=T)


def test_strong_gates():
    # g uniform in [-20, 0]: decays to exp(-20) a token; stepping the state back would divide by them
    check(1, 70, 1, 2, 24, 16, torch.float32, gates="strong", seed=11)


def test_without_initial_state_or_final_state_gradient():
    check(2, 23, 1, 2, 16, 24, torch.float32, initial_state=False, dht=False, seed=12)


def test_without_final_state():
    check(1, 17, 2, 4, 16, 16, torch.float32, output_final_state=False, seed=13)


def test_varlen_with_empty_sequences(poison):
    # per-sequence checkpoints and sub-blocks: lengths across the segment and sub-block sizes, empty ones between
    lengths = [0, 66, 1, 0, 9]
    check(1, sum(lengths), 1, 2, 24, 40, torch.float32, lengths=lengths, seed=14)


def test_several_v_blocks(poison):
    # K = 130 splits V = 70 into several V-blocks: dq, dk, dbeta and dg partial sums over them must add up
    assert fused_recurrent._launch_config(70, 256, 2, fused_recurrent.BWD_TILE, torch.device(DEVICE))[0] < 70
    check(1, 9, 1, 2, 130, 70, torch.float32, seed=15)


def test_gate_in_16_bit():
    # g in bf16 is read as fp32
    inp = make_gated_inputs(1, 12, 1, 2, 16, 16, torch.float32, seed=16)
    info = seq_info(1, 12, torch.device(DEVICE), None, None)
    args = [inp[n].to(DEVICE) for n in ("q", "k", "v", "beta")]
    g16 = inp["g"].to(torch.bfloat16)
    o16, s16, _, _ = fused_recurrent.forward(*args, 0.25, inp["initial_state"].to(DEVICE), True, info,
                                             needs_backward=False, g=g16.to(DEVICE))
    o32, s32, _, _ = fused_recurrent.forward(*args, 0.25, inp["initial_state"].to(DEVICE), True, info,
                                             needs_backward=False, g=g16.float().to(DEVICE))
    assert torch.equal(o16, o32) and torch.equal(s16, s32)


def test_no_gate_is_the_delta_rule_exactly():
    # g=None runs the ungated kernels; with GVA it equals the ungated rule on expanded key heads, and g = 0
    # gives the same function through the gated path (a sequence of T tokens: across a segment's end ungated,
    # shorter gated, where the interpreter is slower)
    T = 70
    inp = make_gated_inputs(1, T, 1, 2, 16, 24, torch.float32, seed=17)
    info = seq_info(1, T, torch.device(DEVICE), None, None)
    q, k, v, beta, h0 = (inp[n].to(DEVICE) for n in ("q", "k", "v", "beta", "initial_state"))
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    dht = torch.randn(h0.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def run(q, k, g):
        o, ht, saved, _ = fused_recurrent.forward(q, k, v, beta, 0.3, h0, True, info, g=g)
        return (o, ht, *fused_recurrent.backward(q, k, v, beta, 0.3, h0, saved, do, dht, info, g=g))

    ungated = run(q, k, None)
    assert ungated[-1] is None  # no dg without g
    expanded = run(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), None)  # G = 2
    for name, a, b in zip(("o", "state", "dq", "dk", "dv", "dbeta", "dh0"), ungated, expanded):
        if name in ("dq", "dk"):  # the group's sum of the expanded heads' gradients (another order)
            assert rel_rms(a, b.view(*b.shape[:2], 1, 2, b.shape[-1]).sum(3)) <= 1e-6, name
        else:
            assert torch.equal(a, b), name
    T = 20
    info = seq_info(1, T, torch.device(DEVICE), None, None)
    q, k, v, beta, do = (x[:, :T].contiguous() for x in (q, k, v, beta, do))
    ungated = run(q, k, None)
    zero_gate = run(q, k, torch.zeros(1, T, 2, device=DEVICE))
    assert torch.equal(zero_gate[0], ungated[0]) and torch.equal(zero_gate[1], ungated[1])
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dh0"), zero_gate[2:7], ungated[2:7]):
        assert rel_rms(a, b) <= 1e-6, name


def test_decode_steps_match_one_call():
    # inference: the in-place step one token at a time, the state updated in place, equals one call
    B, T, Hk, Hv, K, V = 2, 5, 1, 3, 24, 40
    inp = {n: x.to(DEVICE) for n, x in make_gated_inputs(B, T, Hk, Hv, K, V, torch.float32, seed=18).items()}
    info1 = seq_info(B, 1, torch.device(DEVICE), None, None)
    state = inp["initial_state"].clone()
    outs = []
    for t in range(T):
        step = [inp[n][:, t:t + 1].contiguous() for n in ("q", "k", "v", "beta", "g")]
        o, s, saved, _ = fused_recurrent.forward(*step[:4], K ** -0.5, state, False, info1, needs_backward=False,
                                                 inplace_final_state=True, g=step[4])
        assert s is state and saved == ()
        outs.append(o)
    o_steps = torch.cat(outs, 1)
    info = seq_info(B, T, torch.device(DEVICE), None, None)
    o_once, s_once, _, _ = fused_recurrent.forward(*(inp[n] for n in ("q", "k", "v", "beta")), K ** -0.5,
                                                   inp["initial_state"], True, info, needs_backward=False,
                                                   g=inp["g"])
    torch.testing.assert_close(o_steps, o_once, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, s_once, rtol=1e-5, atol=1e-5)
    x = {n: t.double().cpu() for n, t in inp.items()}
    o_ref, s_ref = recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5,
                                              x["initial_state"], True)
    assert rel_rms(o_steps, o_ref) <= BOUNDS[torch.float32]
    assert rel_rms(state, s_ref) <= BOUNDS[torch.float32]
