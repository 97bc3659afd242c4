"""The chunk forward (deltatron/kernels/chunk/forward.py) as a whole: chunk.forward against the float64 recurrence
(DESIGN.md §1) on the plan's walk and on each portable walk forced (plan.overrides), through the public API too, and
the forward executing what its plan says (the WY form, the split, kept states) with the GPU-only kernels recorded
instead of run. The stages: tests/kernels/chunk/portable/; realistic sizes: test_forward_gpu.py."""
import importlib
import types

import pytest
import torch

import deltatron
from deltatron.kernels import chunk
from deltatron.kernels.chunk import plan
from deltatron.kernels.utils import seq_info
from deltatron.reference import recurrent_delta_rule

from ...helpers import BOUNDS, DEVICE, make_inputs, rel_rms
from .helpers import needs_triton, packed

pytestmark = needs_triton

# the module: the package exports a function of the same name
chunk_forward = importlib.import_module("deltatron.kernels.chunk.forward")


def check_forward(dtype, C, lengths, K, V, has_h0, seed, H=1, scale=None, **kw):
    inp, info, ref = packed(lengths, H, K, V, dtype, seed=seed, initial_state=has_h0, **kw)
    scale = K ** -0.5 if scale is None else scale
    o, final, saved, extras = chunk.forward(inp["q"], inp["k"], inp["v"], inp["beta"], scale,
                                            inp.get("initial_state"), True, info, chunk_size=C)
    o_ref, final_ref = recurrent_delta_rule(ref["q"], ref["k"], ref["v"], ref["beta"], scale,
                                            ref.get("initial_state"), True, cu_seqlens=info.cu_seqlens_cpu)
    assert o.dtype == dtype and o.shape == inp["v"].shape
    assert final.dtype == torch.float32 and final.shape == (len(lengths), H, K, V)
    assert extras == () and len(saved) == 1 and saved[0].shape == (1, sum(lengths), H, C)
    assert rel_rms(o, o_ref) < BOUNDS[dtype]
    assert rel_rms(final, final_ref) < BOUNDS[dtype]
    o2, no_final, _, _ = chunk.forward(inp["q"], inp["k"], inp["v"], inp["beta"], scale,
                                       inp.get("initial_state"), False, info, chunk_size=C)
    assert no_final is None and torch.equal(o2, o)
    # inference: Tinv is neither written nor saved, the results are the same
    o3, final3, nothing, _ = chunk.forward(inp["q"], inp["k"], inp["v"], inp["beta"], scale,
                                           inp.get("initial_state"), True, info, needs_backward=False, chunk_size=C)
    assert nothing == () and torch.equal(o3, o) and torch.equal(final3, final)


@pytest.mark.parametrize("dtype, C, T, K, V, has_h0", [
    (torch.float32, 16, 130, 24, 40, True),
    (torch.float32, 32, 65, 32, 16, False),
    (torch.float32, 64, 64, 40, 24, True),
    (torch.float16, 16, 63, 32, 32, True),
    (torch.float16, 64, 130, 24, 32, False),
    (torch.float16, 32, 1, 16, 24, True),
    (torch.bfloat16, 64, 65, 32, 40, True),
    (torch.bfloat16, 32, 130, 24, 16, False),
    (torch.bfloat16, 16, 64, 40, 32, True),
])
def test_forward_single_sequence(poison, dtype, C, T, K, V, has_h0):
    check_forward(dtype, C, [T], K, V, has_h0, seed=T + C)


@pytest.mark.parametrize("dtype, C, has_h0", [
    (torch.float32, 16, True),
    (torch.float16, 32, False),
    (torch.bfloat16, 64, True),
])
def test_forward_varlen(poison, dtype, C, has_h0):
    check_forward(dtype, C, [0, 1, C + 1, C, C - 1, 3], 24, 40, has_h0, seed=C, scale=0.3)


def test_forward_growing_transition(poison):
    # unnormalized keys and beta up to 2: the transition is not a contraction; the same function all the same
    check_forward(torch.float32, 32, [50, 20], 32, 24, True, seed=9, H=2, normalized_keys=False, beta_max=2.0)


def test_public_api_uses_the_kernels(poison, monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    x = make_inputs(2, 40, 2, 24, 32, torch.bfloat16, device=DEVICE, seed=11, initial_state=True)
    o, final = deltatron.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], initial_state=x["initial_state"],
                                          output_final_state=True, chunk_size=32)
    ref = {n: t.cpu().double() for n, t in x.items()}
    o_ref, final_ref = recurrent_delta_rule(ref["q"], ref["k"], ref["v"], ref["beta"], 24 ** -0.5,
                                            ref["initial_state"], True)
    assert rel_rms(o, o_ref) < BOUNDS[torch.bfloat16]
    assert rel_rms(final, final_ref) < BOUNDS[torch.bfloat16]


@pytest.mark.parametrize("fused, dtype, C, lengths, has_h0", [
    (True, torch.float32, 16, [0, 1, 17, 40], True),  # fp32 takes the unfused walk by rule
    (False, torch.bfloat16, 32, [33, 64], False),  # 16-bit takes the fused walk by rule
    (True, torch.float16, 16, [50], True),
    (False, torch.float16, 16, [50], True),
])
def test_forward_either_portable_walk(poison, fused, dtype, C, lengths, has_h0):
    # overrides(fused_output=...) picks the portable walk with the output fused in, or the walk then the output
    # stage, whatever the rule says; either matches the float64 recurrence
    inp, info, _ = packed(lengths, 2, 24, 40, dtype, seed=len(lengths))
    with plan.overrides(fused_output=fused):
        call_plan = chunk.plan_call(inp["q"], inp["k"], inp["v"], info, True, C)
        check_forward(dtype, C, lengths, 24, 40, has_h0, seed=len(lengths) + 1, H=2)
    assert call_plan.walk == ("portable_fused" if fused else "portable")


def hopper_plan(training=True, save_states=False, **forced):
    """A real plan of a 1 x 2 heads, K = V = 128 bf16 call on sm90 with the Hopper walk forced (2 heads are below
    its rule's 16 sequences x heads) and the other choices forced as given."""
    problem = plan.Problem(torch.bfloat16, 2, 128, 128, 1, 64, 64, training, save_states)
    with plan.overrides(hopper_walk=True, **forced):
        return plan.make_plan(problem, plan.named_capabilities("sm90"))


@pytest.mark.parametrize("needs_backward, save_states, forced, first, walk_slots, split, kept", [
    (True, False, {}, "pair", "residual", False, False),  # the residual form: Tb's pair and V in the walk's slots
    (False, False, {}, "pair", "residual", False, False),
    (False, True, {}, "pair", "residual", False, False),  # inference keeps nothing
    (True, True, {}, "wy", "w_u", False, True),  # kept states need W
    (True, False, dict(residual=False), "wy", "w_u", False, False),
    (True, False, dict(split_partitions=3), "pair", "residual", True, False),  # pass 1 in the residual form too
    (True, True, dict(split_partitions=3), "pair", "residual", True, False),  # split: nothing kept
    (True, False, dict(split_partitions=3, residual=False), "wy", "w_u", True, False),
])
def test_forward_executes_its_plan(monkeypatch, needs_backward, save_states, forced, first, walk_slots, split, kept):
    # chunk.forward runs the WY form, the split's pass 1 and the walk (with the states buffers where the plan keeps
    # states) that its plan names; the plans are make_plan's for sm90, the GPU-only kernels recorded, not run
    from deltatron.kernels.chunk.hopper import walk as hopper_walk
    D = 128
    x = make_inputs(1, 64, 2, D, D, torch.bfloat16, initial_state=True, seed=0)
    info = seq_info(1, 64, torch.device("cpu"), None, None)
    final = torch.zeros(1, 2, D, D)
    calls = []
    monkeypatch.setattr(chunk_forward, "tinv_pair_fwd", lambda *a, **kw: calls.append(("pair", kw)) or ("tinv", "tb"))
    monkeypatch.setattr(chunk_forward, "wy_fwd", lambda *a, **kw: calls.append(("wy", kw)) or ("tinv", "w", "u"))
    monkeypatch.setattr(hopper_walk, "gluon_state_output_fwd",
                        lambda *a, **kw: calls.append(("walk", a[2:4], kw["states"], kw["residual"])) or ("o", final))
    fake_split = types.SimpleNamespace(parts=info, last_part=torch.zeros(1, dtype=torch.long))
    monkeypatch.setattr(chunk_forward, "split_plan_for", lambda *a: calls.append(("split", a[1:3])) or fake_split)
    monkeypatch.setattr(chunk_forward, "partition_states",
                        lambda *a: calls.append(("pass 1", a[2:4], a[6:])) or x["initial_state"])
    call_plan = hopper_plan(needs_backward, save_states, **forced)
    assert call_plan.walk == "hopper" and call_plan.keep_states == kept and call_plan.split == split
    o, _, saved, extras = chunk.forward(x["q"], x["k"], x["v"], x["beta"], 0.1, x["initial_state"], True, info,
                                        needs_backward=needs_backward, save_states=save_states, plan=call_plan)
    assert o == "o" and extras == ()
    if kept:
        NT, H = 1, 2
        assert saved[:2] == ("tinv", "w") and len(saved) == 4
        assert [tuple(s.shape) for s in saved[2:]] == [(NT, H, D, D), (NT, H, D, 64)]
    else:
        assert saved == (("tinv",) if needs_backward else ())
    residual = walk_slots == "residual"
    assert call_plan.residual == residual
    slots = ("tb", x["v"]) if residual else ("w", "u")
    expected = [("pair", dict(store_tinv=needs_backward, cfg=call_plan.wy_launch, gam=None)) if first == "pair" else
                ("wy", dict(store_tinv=needs_backward, cfg=call_plan.wy_launch, gam=None, gk=None, decays=None, q=None,
                            scores=None, scale=0.1))]
    if split:
        expected += [("split", (3, plan.SPLIT_MIN_TOKENS)), ("pass 1", slots, (residual, ))]
    expected.append(("walk", slots, tuple(saved[2:]) if kept else None, residual))
    assert calls == expected


def test_plan_call_reads_the_tensors(poison):
    # plan_call's problem: the tensors' dtype, heads, K, V, the batch's sequences and tokens, TMA alignment; made
    # under the calling context's overrides
    from ...helpers import misaligned
    x = make_inputs(2, 40, 3, 24, 16, torch.float16, device=DEVICE)
    info = seq_info(2, 40, torch.device(DEVICE), None, None)
    p = chunk.plan_call(x["q"], x["k"], x["v"], info, False, 32, True)
    assert p.problem == plan.Problem(torch.float16, 3, 24, 16, 2, 80, 32, False, True, True)
    assert p.caps == plan.device_capabilities(torch.device(DEVICE))
    unaligned = chunk.plan_call(x["q"], misaligned(x["k"]), x["v"], info, True, 32)
    assert unaligned.problem.tma_aligned is False
    with plan.overrides(fused_output=False):
        assert chunk.plan_call(x["q"], x["k"], x["v"], info, False, 32, True).walk == "portable"
