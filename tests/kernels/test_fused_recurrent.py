"""fused_recurrent_delta_rule on the Triton backend (deltatron/kernels/fused_recurrent.py), through the
public API.

o, the final state and all five gradients are checked against torch.autograd through the float64
recurrence (deltatron.reference.recurrent_delta_rule) run on the same inputs after rounding to the test
dtype; the in-place decode step is checked against whole-sequence calls and against that reference."""
import pytest
import torch

import deltatron.kernels.fused_recurrent as fused_recurrent
from deltatron import fused_recurrent_delta_rule
from deltatron.kernels.utils import seq_info
from deltatron.reference import recurrent_delta_rule

from ..helpers import BOUNDS, DEVICE, INTERPRET, assert_within_bounds, make_inputs, random_cu_seqlens, rel_rms

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")


def reference(q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    return recurrent_delta_rule(q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                                cu_seqlens)


def run(fn, inp, lengths, output_final_state, use_l2norm, seed):
    """o, final state and the gradients of a random linear loss on o (and on the final state)."""
    cu = None if lengths is None else random_cu_seqlens(lengths, inp["q"].device)
    o, s = fn(inp["q"], inp["k"], inp["v"], inp["beta"], scale=0.3, initial_state=inp.get("initial_state"),
              output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_l2norm, cu_seqlens=cu)
    g = torch.Generator().manual_seed(seed)
    loss = (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum()
    if output_final_state:
        loss = loss + (s.double() * torch.randn(s.shape, generator=g, dtype=torch.float64).to(s.device)).sum()
    else:
        assert s is None
    names = list(inp)
    grads = torch.autograd.grad(loss, [inp[n] for n in names])
    out = {"o": o, **{f"d{n}": x for n, x in zip(names, grads)}}
    if output_final_state:
        out["state"] = s
    return out


def check(B, T, H, K, V, dtype, lengths=None, initial_state=True, output_final_state=True, use_l2norm=False,
          seed=0, **input_kwargs):
    N = None if lengths is None else len(lengths)
    inp = make_inputs(B, T, H, K, V, dtype, device=DEVICE, initial_state=initial_state, N=N, seed=seed,
                      requires_grad=True, **input_kwargs)
    got = run(fused_recurrent_delta_rule, inp, lengths, output_final_state, use_l2norm, seed)
    rounded = {n: x.detach().cpu().double().requires_grad_() for n, x in inp.items()}
    want = run(reference, rounded, lengths, output_final_state, use_l2norm, seed)
    assert got["o"].dtype == dtype
    assert not output_final_state or got["state"].dtype == torch.float32
    assert got.keys() == want.keys()
    assert_within_bounds(got, want, dtype)


# K != V, head sizes not powers of two; several sequences or heads in each group of cases
CASES = [
    # T, B, H, K, V, initial_state, use_l2norm
    (1, 2, 1, 40, 24, True, False),
    (15, 2, 1, 24, 40, False, True),
    (64, 1, 1, 24, 16, True, True),
    (65, 1, 1, 16, 40, True, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T, B, H, K, V, initial_state, use_l2norm", CASES)
def test_matches_float64_reference(T, B, H, K, V, initial_state, use_l2norm, dtype):
    check(B, T, H, K, V, dtype, initial_state=initial_state, use_l2norm=use_l2norm, seed=T)


def test_without_final_state():
    # no gradient flows into the final state (dht is None)
    check(1, 20, 2, 24, 24, torch.float32, output_final_state=False, seed=1)


def test_keys_not_normalized_beta_up_to_2():
    # the transitions I - beta k k^T are no longer contractions: the same function must come out
    check(1, 64, 1, 24, 40, torch.float32, normalized_keys=False, beta_max=2.0, seed=2)


def test_growing_state_over_a_long_sequence():
    # keys not normalized, beta up to 2: the state grows about 5000-fold over these 1000 tokens. Rebuilding
    # it backwards by subtraction from the final state alone put dk at 1.7e-4 (over the fp32 bound); from
    # the checkpoint of each 64-token segment the error stays that of a short sequence
    check(1, 1000, 1, 16, 16, torch.float32, normalized_keys=False, beta_max=2.0, seed=0)


def test_segments_across_packed_sequences(poison):
    # checkpoints are per sequence: lengths on both sides of the 64-token segment, an empty one between
    lengths = [130, 0, 64, 65, 1]
    assert fused_recurrent.SEGMENT == 64
    check(1, sum(lengths), 1, 16, 24, torch.float32, lengths=lengths, seed=6)


def test_inference_saves_nothing():
    inp = make_inputs(2, 70, 1, 16, 16, torch.float32, device=DEVICE, initial_state=True, seed=7)
    info = seq_info(2, 70, torch.device(DEVICE), None, None)
    args = (inp["q"], inp["k"], inp["v"], inp["beta"], 0.25, inp["initial_state"])
    o, final, saved, _ = fused_recurrent.forward(*args, False, info, needs_backward=False)
    assert final is None and saved == ()
    o_train, final_train, saved_train, _ = fused_recurrent.forward(*args, True, info, needs_backward=True)
    assert torch.equal(o, o_train) and len(saved_train) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen(dtype, poison):
    lengths = [0, 1, 15, 0, 33, 2]
    check(1, sum(lengths), 1, 24, 40, dtype, lengths=lengths, use_l2norm=dtype == torch.bfloat16, seed=3)


def test_several_v_blocks(poison):
    # K = 130 takes a 256-row state tile, so V = 70 is split into 3 blocks forward and 5 backward (the
    # last one partial): the partial sums of dq, dk and dbeta over the V-blocks must add up
    assert fused_recurrent._launch_config(70, 256, 1, fused_recurrent.FWD_TILE, torch.device(DEVICE))[0] < 70
    check(1, 9, 1, 130, 70, torch.float32, seed=4)


def decode(inp, T, cu_seqlens=None):
    """Feeds the tokens one at a time through the in-place step; returns (o, state)."""
    state = inp["initial_state"].clone()
    outs = []
    for t in range(T):
        o, s = fused_recurrent_delta_rule(inp["q"][:, t:t + 1], inp["k"][:, t:t + 1], inp["v"][:, t:t + 1],
                                          inp["beta"][:, t:t + 1], initial_state=state, inplace_final_state=True)
        assert s is state  # the caller's own tensor, updated in place
        outs.append(o)
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_steps_match_one_call(dtype):
    B, T, H, K, V = 2, 7, 2, 24, 40
    inp = make_inputs(B, T, H, K, V, dtype, device=DEVICE, initial_state=True, seed=5)
    with torch.no_grad():
        o_steps, s_steps = decode(inp, T)
        o_once, s_once = fused_recurrent_delta_rule(**inp, output_final_state=True)
    # the same kernel from the same fp32 state: equal up to the rounding of fp32 sums
    torch.testing.assert_close(s_steps, s_once, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o_steps, o_once, **({} if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)))
    rounded = {n: x.double().cpu() for n, x in inp.items()}
    o_ref, s_ref = recurrent_delta_rule(**rounded, scale=K ** -0.5, output_final_state=True)
    assert rel_rms(o_steps, o_ref) <= BOUNDS[dtype]
    assert rel_rms(s_steps, s_ref) <= BOUNDS[torch.float32]


def test_inplace_varlen(poison):
    # a packed decode step: one token for most sequences, none for one (its state must stay as it was)
    lengths = [1, 0, 1, 2]
    inp = make_inputs(1, sum(lengths), 2, 24, 40, torch.float32, device=DEVICE, initial_state=True,
                      N=len(lengths), seed=6)
    cu = random_cu_seqlens(lengths, DEVICE)
    state = inp["initial_state"].clone()
    with torch.no_grad():
        o, s = fused_recurrent_delta_rule(inp["q"], inp["k"], inp["v"], inp["beta"], initial_state=state,
                                          cu_seqlens=cu, inplace_final_state=True)
    assert s.data_ptr() == state.data_ptr()
    rounded = {n: x.double().cpu() for n, x in inp.items()}
    o_ref, s_ref = recurrent_delta_rule(**rounded, scale=24 ** -0.5, output_final_state=True, cu_seqlens=cu.cpu())
    assert rel_rms(o, o_ref) <= BOUNDS[torch.float32]
    assert rel_rms(s, s_ref) <= BOUNDS[torch.float32]
    assert torch.equal(s[1], inp["initial_state"][1])
