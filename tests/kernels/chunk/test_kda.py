"""Kimi Delta Attention's per-channel gate (DESIGN.md §12) in the chunk form's Triton kernels (USE_GK of portable/: wy,
walk, output, reverse, grads, wy_bwd, and gate.py's sums within sub-chunks), called as the form is: forward(..., g=g)
with g [B, T, Hv, K], and backward(..., g=g).

The inference forward's o and final state are checked against the float64 recurrence on the same inputs after rounding
to the test dtype (on a GPU its float64 chunkwise form, equal to it within 1e-10: tests/reference/test_kda.py), within the relative-RMS bounds of tests/helpers.py (fp32 and fp16); both walks (the output fused in
and apart) are forced. The training forward and backward (o, the final state, dq, dk, dv, dbeta, dg per channel, dh0)
are checked against torch.autograd through the float64 recurrence (tests/helpers.check_gated_form), bf16 as the gated
rule's tests take it. A second call gives the same bits. The plan keeps every stage on the portable kernels and refuses
a forced Hopper walk or reverse pass."""
import pytest
import torch

from deltatron.kernels import chunk
from deltatron.kernels.chunk import plan
from deltatron.reference.gated import chunk_gated_delta_rule_reference, recurrent_gated_delta_rule

from ...helpers import (BOUNDS, DEVICE, INTERPRET, check_gated_backward_deterministic, check_gated_form, gated_case,
                        half_strong_gate, rel_rms)

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")


def check(B, T, Hk, Hv, K, V, dtype, chunk_size, lengths=None, gates="soft", initial_state=True,
          output_final_state=True, seed=0, g=None):
    """chunk.forward's o and final state against the float64 recurrence; g: a gate [B, T, Hv, K] to use instead of
    make_gated_inputs' (fp32)."""
    inp, cu, info = gated_case(B, T, Hk, Hv, K, V, dtype, lengths, gates, initial_state, seed, True, g)
    scale = K ** -0.5
    dev = {n: x.to(DEVICE) for n, x in inp.items()}
    o, ht, saved, extras = chunk.forward(dev["q"], dev["k"], dev["v"], dev["beta"], scale, dev.get("initial_state"),
                                         output_final_state, info, needs_backward=False, chunk_size=chunk_size,
                                         g=dev["g"])
    assert saved == () and extras == ()
    # the float64 recurrence; on a GPU its chunkwise form there, as gated_oracle takes it (the token loop on the CPU
    # takes minutes at the GPU tests' lengths)
    ref = {n: x.to(DEVICE, torch.float64) for n, x in inp.items()}
    oracle = recurrent_gated_delta_rule if DEVICE == "cpu" else chunk_gated_delta_rule_reference
    o_ref, ht_ref = oracle(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], scale, ref.get("initial_state"), True,
                           cu_seqlens=None if cu is None else cu.to(DEVICE))
    assert o.dtype == dtype and o.shape == o_ref.shape
    errors = {"o": rel_rms(o, o_ref)}
    if output_final_state:
        errors["state"] = rel_rms(ht, ht_ref)
    else:
        assert ht is None
    assert all(e <= BOUNDS[dtype] for e in errors.values()), f"rel RMS above {BOUNDS[dtype]:.0e}: {errors}"


WALKS = [dict(fused_output=False), dict(fused_output=True)]


# B, T, Hk, Hv, K, V, C: T = 1, partial last chunks, every chunk size, grouped value heads (G = 2, 3) and Hk = Hv,
# head sizes not powers of two
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("B, T, Hk, Hv, K, V, C", [
    (2, 1, 1, 2, 16, 16, 64),
    (2, 100, 1, 3, 32, 32, 32),
    (1, 70, 2, 2, 24, 20, 16),
    (1, 129, 2, 4, 32, 16, 64),
])
def test_matches_float64_oracle(B, T, Hk, Hv, K, V, C, dtype, poison):
    check(B, T, Hk, Hv, K, V, dtype, C, seed=T + C)


@pytest.mark.parametrize("forced", WALKS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_every_walk(forced, dtype):
    with plan.overrides(**forced):
        check(1, 90, 1, 2, 32, 32, dtype, 32, seed=31)


@pytest.mark.parametrize("forced", WALKS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_strong_gates(forced, dtype):
    # g uniform in [-20, 0] per channel: a chunk's cumulative sums reach about -640
    with plan.overrides(**forced):
        check(1, 130, 1, 2, 32, 32, dtype, 64, gates="strong", seed=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_strongest_gates(dtype):
    # g in [-20, -19]: a chunk's sums pass -1200, every factor past a few tokens underflows to 0
    g = -19 - torch.rand(1, 100, 2, 32, generator=torch.Generator().manual_seed(5))
    check(1, 100, 1, 2, 32, 32, dtype, 64, g=g, seed=33)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_half_the_channels_strong(dtype):
    # channels alternate between strong (uniform in [-20, 0]) and nearly none (-1e-3): the factors near 1 late in a
    # chunk are where differences of the chunk's cumulative sums (about -640) would lose fp32 accuracy
    g = half_strong_gate(1, 128, 2, 32, seed=6)
    check(1, 128, 1, 2, 32, 32, dtype, 64, g=g, seed=34)


def test_without_initial_or_final_state():
    check(2, 45, 1, 2, 16, 24, torch.float32, 16, initial_state=False, output_final_state=False, seed=35)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_varlen_with_empty_sequences(dtype, poison):
    lengths = [0, 37, 1, 0, 70, 16]
    check(1, sum(lengths), 1, 2, 32, 32, dtype, 32, lengths=lengths, gates="strong", seed=36)


def test_plan_keeps_kda_on_portable_stages():
    # a shape where the Hopper walk and reverse pass would run ungated or with the per-head gate: KDA's calls keep
    # the portable walk, reverse pass and the two-launch recompute (no γ stage), and refuse those forced
    common = dict(B=1, T=4096, H=16, K=128, V=128, dtype=torch.bfloat16)
    assert plan.plan_for_shape(**common, gated=True).reverse == "hopper"
    for training in (False, True):
        kda = plan.plan_for_shape(**common, per_channel=True, training=training)
        assert kda.walk == "portable" and "per-head gate only" in kda.reason("walk")  # P in the output stage
        assert kda.reverse == ("portable" if training else "none")
        assert kda.recompute == ("two_launch" if training else "none")
        fwd, bwd = plan.kernels(kda)
        assert not any("hopper" in stage or "γ" in stage for stage in fwd + bwd)
        assert bwd[-1:] == (("portable.gate (dg per key channel)",) if training else ())
        # P apart from the pass, read from the forward's WY stage (which forms it for the output stage)
        assert ("portable.grads (local dV' from the forward's scores P)" in bwd) == training == kda.local_dv_apart
        assert ("portable.output (the WY stage's scores P, kept for the backward's local dV')" in fwd) == training
        assert ("portable.output (the WY stage's scores P)" in fwd) == (not training)
    for forced in (dict(hopper_walk=True), dict(hopper_reverse=True)):
        with plan.overrides(**forced), pytest.raises(ValueError, match="Hopper"):
            plan.plan_for_shape(**common, per_channel=True)


def check_training(*args, **kwargs):
    return check_gated_form(chunk, *args, per_channel=True, **kwargs)


# B, T, Hk, Hv, K, V, C as test_matches_float64_oracle's, with bf16 (the gated rule's convention: these paths take it
# in the interpreter)
@pytest.mark.parametrize("B, T, Hk, Hv, K, V, C, dtype", [
    (2, 100, 1, 3, 32, 32, 32, torch.float32),
    (2, 1, 1, 2, 16, 16, 64, torch.float32),
    (1, 70, 2, 2, 24, 20, 16, torch.float32),
    (1, 129, 2, 4, 32, 16, 64, torch.float32),
    (2, 100, 1, 3, 32, 32, 32, torch.float16),
    (1, 129, 2, 4, 32, 16, 64, torch.bfloat16),
], ids=str)
def test_backward_matches_float64_oracle(B, T, Hk, Hv, K, V, C, dtype, poison):
    check_training(B, T, Hk, Hv, K, V, dtype, seed=T + C, chunk_size=C)


@pytest.mark.parametrize("local_dv_apart", [True, False])
@pytest.mark.parametrize("forced", WALKS, ids=str)
def test_backward_every_walk(forced, local_dv_apart):
    # both walks, and the reverse pass with the local dV' apart (the rule) or computed in it (forced)
    with plan.overrides(**forced, local_dv_apart=local_dv_apart):
        check_training(1, 90, 1, 2, 32, 32, torch.float16, seed=41, chunk_size=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_backward_strong_gates(dtype):
    check_training(1, 130, 1, 2, 32, 32, dtype, gates="strong", seed=42, chunk_size=64)


def test_backward_strongest_gates():
    # g in [-20, -19]: the true dg is tiny; only sums within sub-chunks keep it to fp32 accuracy
    g = -19 - torch.rand(1, 100, 2, 32, generator=torch.Generator().manual_seed(7))
    check_training(1, 100, 1, 2, 32, 32, torch.float32, g=g, seed=43, chunk_size=64)


def test_backward_half_the_channels_strong():
    g = half_strong_gate(1, 128, 2, 32, seed=8)
    check_training(1, 128, 1, 2, 32, 32, torch.float32, g=g, seed=44, chunk_size=64)


def test_backward_without_initial_state_or_final_state_gradient():
    check_training(2, 45, 1, 2, 16, 24, torch.float32, initial_state=False, dht=False, seed=45, chunk_size=16)


def test_backward_without_final_state():
    check_training(1, 40, 2, 4, 16, 16, torch.float32, output_final_state=False, seed=46, chunk_size=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_backward_varlen_with_empty_sequences(dtype, poison):
    lengths = [0, 37, 1, 0, 70, 16]
    check_training(1, sum(lengths), 1, 2, 32, 32, dtype, lengths=lengths, gates="strong", seed=47, chunk_size=32)


def test_backward_is_deterministic():
    check_gated_backward_deterministic(chunk, 1, 70, 1, 2, 32, 32, torch.float16, seed=46, per_channel=True,
                                       chunk_size=32)
