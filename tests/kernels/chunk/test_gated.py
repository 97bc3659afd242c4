"""The gated delta rule and grouped value heads (DESIGN.md §11) in the chunk form's Triton kernels (USE_G and HK of
portable/: wy, walk, output, reverse, grads, wy_bwd, and gate.py's γ), called as the form is: forward(..., g=g),
backward(..., g=g).

o, the final state and dq, dk, dv, dbeta, dg, dh0 are checked against torch.autograd through the float64 recurrence
(tests/helpers.gated_oracle) on the same inputs after rounding to the test dtype, within the relative-RMS bounds of
tests/helpers.py; every plan path the gated rule takes (the fused and the unfused walk, the one- and two-launch
recompute) is forced once."""
import pytest
import torch

from deltatron.kernels import chunk
from deltatron.kernels.chunk import plan
from deltatron.kernels.utils import seq_info

from ...helpers import (DEVICE, INTERPRET, check_gated_backward_deterministic, check_gated_form, make_gated_inputs,
                        rel_rms)

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")


def check(*args, **kwargs):
    return check_gated_form(chunk, *args, **kwargs)


# B, T, Hk, Hv, K, V, C: partial last chunks, T = 1, grouped heads (G = 3, 2) and Hk = Hv non-powers of two, heads
# not powers of two
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("B, T, Hk, Hv, K, V, C", [
    (2, 100, 1, 3, 32, 32, 32),
    (1, 1, 2, 4, 16, 16, 64),
    (1, 70, 3, 3, 24, 40, 16),
    (1, 129, 2, 4, 64, 32, 64),
])
def test_matches_float64_oracle(B, T, Hk, Hv, K, V, C, dtype, poison):
    check(B, T, Hk, Hv, K, V, dtype, seed=T, chunk_size=C)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strong_gates(dtype):
    # g uniform in [-20, 0]: a chunk's cumulative decay reaches about -640; every factor is exp of a span's sum
    check(1, 130, 1, 2, 32, 32, dtype, gates="strong", seed=11, chunk_size=64)


def test_strongest_gates_with_final_state_gradient():
    # g in [-20, -19]: dg is ~exp(g) while the last row's share of the state update has the factor 1; summed as the
    # cumsum less that row's share, dg's last row was 10 % off (gate.gate_grad_kernel)
    g = -19 - torch.rand(1, 100, 2, generator=torch.Generator().manual_seed(7))
    check(1, 100, 1, 2, 32, 32, torch.float32, g=g, seed=16, chunk_size=64)


def test_without_initial_state_or_final_state_gradient():
    check(2, 45, 1, 2, 16, 24, torch.float32, initial_state=False, dht=False, seed=12, chunk_size=16)


def test_without_final_state():
    check(1, 40, 2, 4, 16, 16, torch.float32, output_final_state=False, seed=13, chunk_size=16)


def test_varlen_with_empty_sequences(poison):
    lengths = [0, 37, 1, 0, 70, 16]
    check(1, sum(lengths), 1, 2, 32, 32, torch.bfloat16, lengths=lengths, seed=14, chunk_size=32)


@pytest.mark.parametrize("forced", [dict(fused_output=False), dict(fused_output=True)], ids=str)
def test_every_walk(forced):
    with plan.overrides(**forced):
        check(1, 80, 1, 2, 32, 64, torch.float16, seed=15, chunk_size=32)


def test_the_h200s_v_blocks():
    # on the H200 the portable walk and reverse pass shrink their V-blocks to fill the SMs (16 wide here, where the
    # interpreter's plan keeps 32): its launches at a shape where its output was seen wrong (test_output's gated case)
    h200 = plan.plan_for_shape(1, 129, 4, 64, 32, torch.float16, gated=True, key_heads=2)
    cpu = plan.plan_for_shape(1, 129, 4, 64, 32, torch.float16, gpu="cpu", gated=True, key_heads=2)
    assert h200.walk_launch.block_v < cpu.walk_launch.block_v
    with plan.overrides(walk_block_v=h200.walk_launch.block_v, reverse_block_v=h200.reverse_launch.block_v):
        check(1, 129, 2, 4, 64, 32, torch.float16, seed=129, chunk_size=64)


def test_k_256_two_launch_recompute():
    # K = 256: the unfused walk, the two-launch recompute and several K-tiles in grads' share of dg
    p = plan.plan_for_shape(1, 40, 2, 256, 32, torch.bfloat16, gpu="cpu", gated=True, key_heads=1)
    assert p.walk == "portable" and p.recompute == "two_launch"
    check(1, 40, 1, 2, 256, 32, torch.bfloat16, seed=16, chunk_size=16)


def test_no_gate_is_the_delta_rule_with_grouped_heads():
    # g = None with grouped heads: the ungated rule on each value head with its key head's q, k, equal to the
    # rule on repeated key heads (dq, dk: the group's sum of the repeated heads' gradients)
    T, C = 50, 16
    inp = make_gated_inputs(1, T, 1, 2, 16, 24, torch.float32, seed=17)
    info = seq_info(1, T, torch.device(DEVICE), None, None)
    q, k, v, beta, h0 = (inp[n].to(DEVICE) for n in ("q", "k", "v", "beta", "initial_state"))
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    dht = torch.randn(h0.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def run(q, k, g=None):
        o, ht, saved, _ = chunk.forward(q, k, v, beta, 0.3, h0, True, info, chunk_size=C, g=g)
        return (o, ht, *chunk.backward(q, k, v, beta, 0.3, h0, saved, do, dht, info, chunk_size=C, g=g))

    grouped = run(q, k)
    assert len(grouped) == 7  # no dg without g
    repeated = run(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2))
    for name, a, b in zip(("o", "state", "dq", "dk", "dv", "dbeta", "dh0"), grouped, repeated):
        if name in ("dq", "dk"):
            b = b.view(*b.shape[:2], 1, 2, b.shape[-1]).sum(3)
        assert rel_rms(a, b) <= 1e-6, name
    zero_gate = run(q, k, torch.zeros(1, T, 2, device=DEVICE))
    for name, a, b in zip(("o", "state", "dq", "dk", "dv", "dbeta", "dh0"), zero_gate, grouped):
        assert rel_rms(a, b) <= 1e-6, name


def test_backward_is_deterministic():
    check_gated_backward_deterministic(chunk, 1, 64, 1, 2, 16, 16, torch.bfloat16, seed=18, chunk_size=16)
