"""Kimi Delta Attention's per-channel gate (DESIGN.md §12) in the token-recurrent Triton kernels
(deltatron/kernels/fused_recurrent.py, USE_G with USE_GK), called as the form is: forward(..., g=g) and
backward(..., g=g) with g [B, T, Hv, K].

o, the final state and dq, dk, dv, dbeta, dg (per channel), dh0 are checked against torch.autograd through the
float64 recurrence on the same inputs after rounding to the test dtype (tests/helpers.check_gated_form)."""
import pytest
import torch

import deltatron.kernels.fused_recurrent as fused_recurrent

from ..helpers import DEVICE, INTERPRET, check_gated_form

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")


def check(*args, **kwargs):
    return check_gated_form(fused_recurrent, *args, per_channel=True, **kwargs)


# K, V not powers of two; grouped value heads and Hk = Hv; T = 1 and partial segments and sub-blocks (T = 70, in
# fp32 only: the interpreter's time)
SHORT = [
    # B, T, Hk, Hv, K, V
    (2, 1, 2, 6, 24, 40),
    (2, 19, 3, 3, 40, 24),
]
CASES = [(shape, dtype) for shape in SHORT for dtype in (torch.float32, torch.float16, torch.bfloat16)]
CASES.append(((1, 70, 1, 2, 24, 16), torch.float32))


@pytest.mark.parametrize("shape, dtype", CASES, ids=lambda x: str(x))
def test_matches_float64_oracle(shape, dtype):
    check(*shape, dtype, seed=shape[1] + 40)


def test_strong_gates():
    # g uniform in [-20, 0] per channel; the backward rebuilds states forward, never dividing by exp(g)
    check(1, 70, 1, 2, 24, 16, torch.float32, gates="strong", seed=21)


def test_without_initial_state_or_final_state_gradient():
    check(2, 23, 1, 2, 16, 24, torch.float32, initial_state=False, dht=False, seed=22)


def test_varlen_with_empty_sequences(poison):
    lengths = [0, 66, 1, 0, 9]
    check(1, sum(lengths), 1, 2, 24, 40, torch.float32, lengths=lengths, seed=24)


def test_several_v_blocks(poison):
    # K = 130 splits V = 70 into several V-blocks: dg's per-channel partial sums over them must add up
    assert fused_recurrent._launch_config(70, 256, 2, fused_recurrent.BWD_TILE, torch.device(DEVICE))[0] < 70
    check(1, 9, 1, 2, 130, 70, torch.float32, seed=25)


def test_head_size_256():
    check(1, 3, 1, 1, 256, 256, torch.float32, seed=26)


def test_backward_is_deterministic():
    # no atomics: every gradient (dg's V-block partial sums included) is bitwise equal from run to run
    runs = [check(1, 12, 1, 2, 130, 40, torch.float32, seed=27) for _ in range(2)]
    assert all(torch.equal(runs[0][name], runs[1][name]) for name in runs[0])
