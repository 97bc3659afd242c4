"""The chunk forward's sequence split (deltatron/kernels/chunk/schedule/seq_split.py): the split plan of the passes,
and the forward and its gradients with the split forced (plan.overrides(split_partitions=P, split_min_tokens=n),
P = 2..4, here on the portable walks) against the float64 recurrence. The rule (plan.split_partitions) is in
tests/kernels/chunk/test_plan.py. Tiny shapes for the interpreter; test_seq_split_gpu.py runs realistic ones."""
import contextlib
import importlib

import pytest
import torch

import deltatron
from deltatron.kernels import chunk
from deltatron.kernels.chunk import plan as chunk_plan
from deltatron.kernels.chunk.schedule import seq_split
from deltatron.kernels.utils import seq_info
from deltatron.reference import recurrent_delta_rule

from ....helpers import BOUNDS, DEVICE, make_inputs, random_cu_seqlens, rel_rms
from ..helpers import needs_triton

pytestmark = needs_triton

chunk_forward = importlib.import_module("deltatron.kernels.chunk.forward")  # the package exports a function


@pytest.fixture
def split(monkeypatch):
    """force(P, min_tokens) forces the split (plan.overrides until the test ends); returns the list to which each
    forward that splits appends its split plan (split_plan_for's result: None where no sequence is long enough). The
    unsplit forward (overrides(split_partitions=1)) does not ask for one."""
    plans = []
    plan_for = chunk_forward.split_plan_for
    monkeypatch.setattr(chunk_forward, "split_plan_for", lambda *a: plans.append(plan_for(*a)) or plans[-1])
    with contextlib.ExitStack() as stack:
        def force(P, min_tokens):
            stack.enter_context(chunk_plan.overrides(split_partitions=P, split_min_tokens=min_tokens))
            return plans

        yield force


# ---------------------------------------------------------------- the plan

def rows(x, r):
    return list(range(len(x)))[r] if isinstance(r, slice) else r.tolist()


def test_split_plan():
    # C = 16, P = 4, sequences of 0, 1, 150, 40, 129 tokens, split from 64 tokens: 150 (10 chunks: 3 3 2 2) and
    # 129 (9 chunks, the last partial: 3 2 2 2); 40 too short, and so are 0 and 1
    cu = (0, 0, 1, 151, 191, 320)
    plan = seq_split.split_plan(cu, 4, 64, 16, torch.device("cpu"))
    assert plan.parts.cu_seqlens_cpu.tolist() == [0, 0, 1, 49, 97, 129, 151, 191, 239, 271, 303, 320]
    assert plan.parts.cu_seqlens.tolist() == plan.parts.cu_seqlens_cpu.tolist()
    assert plan.seq_of_part.tolist() == [0, 1, 2, 2, 2, 2, 3, 4, 4, 4, 4]
    assert plan.last_part.tolist() == [0, 1, 5, 6, 10]
    assert rows(range(5), plan.split_seqs) == [2, 4]
    # the walk on U: partitions 0..2 of each split sequence, and fillers of at most 48 tokens (the longest
    # partition) over the gap [129, 191)
    u = plan.walk_u.cu_seqlens_cpu.tolist()
    assert u == [1, 49, 97, 129, 177, 191, 239, 271, 303] and plan.walk_u.total_tokens == 320
    assert [rows(u[1:], r) for r in plan.rows_u] == [[0, 5], [1, 6], [2, 7]]
    # the walk on W: partitions 1 and 2, fillers over [129, 239)
    w = plan.walk_w.cu_seqlens_cpu.tolist()
    assert w == [49, 97, 129, 177, 225, 239, 271, 303]
    assert plan.rows_w[0] is None and [rows(w[1:], r) for r in plan.rows_w[1:]] == [[0, 5], [1, 6]]
    assert [rows(range(11), r) for r in plan.rows_parts] == [[2, 7], [3, 8], [4, 9], [5, 10]]
    # P = 2: no walk on W; nothing long enough: no plan
    assert seq_split.split_plan(cu, 2, 64, 16, torch.device("cpu")).walk_w is None
    assert seq_split.split_plan(cu, 4, 151, 16, torch.device("cpu")) is None
    assert seq_split.split_plan((0, 40), 4, 16, 16, torch.device("cpu")) is None  # 3 chunks: not 4 partitions


# ---------------------------------------------------------------- the forward against the recurrence

@pytest.mark.parametrize("dtype, C, lengths, K, V, has_h0, P", [
    (torch.float32, 16, [130], 32, 16, True, 3),  # the last chunk partial
    (torch.float32, 32, [0, 1, 129, 31, 96, 0], 24, 40, False, 2),
    (torch.float16, 16, [100, 1, 0, 87], 32, 24, True, 4),
    (torch.float16, 32, [200], 16, 32, False, 3),
    (torch.bfloat16, 16, [65, 80], 24, 16, True, 4),
])
def test_forward_split(poison, split, dtype, C, lengths, K, V, has_h0, P):
    plans = split(P, 2 * C)
    H, scale = 2, K ** -0.5
    inp = make_inputs(1, sum(lengths), H, K, V, dtype, device=DEVICE, seed=sum(lengths) + P,
                      initial_state=has_h0, N=len(lengths))
    cu = random_cu_seqlens(lengths, DEVICE)
    info = seq_info(1, sum(lengths), torch.device(DEVICE), cu, cu.cpu())
    args = (inp["q"], inp["k"], inp["v"], inp["beta"], scale, inp.get("initial_state"))
    o, final, saved, _ = chunk.forward(*args, True, info, chunk_size=C)
    plan = plans[-1]
    assert plan is not None and plan.parts.num_seqs > len(lengths)  # it split
    ref = {n: x.cpu().double() for n, x in inp.items()}
    o_ref, final_ref = recurrent_delta_rule(ref["q"], ref["k"], ref["v"], ref["beta"], scale,
                                            ref.get("initial_state"), True, cu_seqlens=cu.cpu())
    assert o.dtype == dtype and final.dtype == torch.float32 and final.shape == (len(lengths), H, K, V)
    assert rel_rms(o, o_ref) <= BOUNDS[dtype]
    assert rel_rms(final, final_ref) <= BOUNDS[dtype]
    for n, L in enumerate(lengths):  # an empty sequence passes its initial state (or zeros) through exactly
        if L == 0:
            assert torch.equal(final[n], inp["initial_state"][n] if has_h0 else torch.zeros_like(final[n]))
    # Tinv is the unsplit forward's, bit for bit; without the final state or the backward, the same o
    with chunk_plan.overrides(split_partitions=1):
        _, _, saved_unsplit, _ = chunk.forward(*args, False, info, chunk_size=C)
    assert len(plans) == 1 and torch.equal(saved[0], saved_unsplit[0])
    o2, no_final, nothing, _ = chunk.forward(*args, False, info, needs_backward=False, chunk_size=C)
    assert no_final is None and nothing == () and torch.equal(o2, o)


def test_forward_split_growing_transition(poison, split):
    # unnormalized keys and beta up to 2: the transitions M_p are not contractions; the same function all the same
    split(3, 64)
    lengths, H, K, V = [150, 70], 1, 32, 24
    inp = make_inputs(1, sum(lengths), H, K, V, torch.float32, device=DEVICE, seed=9, normalized_keys=False,
                      beta_max=2.0, initial_state=True, N=2)
    cu = random_cu_seqlens(lengths, DEVICE)
    info = seq_info(1, sum(lengths), torch.device(DEVICE), cu, cu.cpu())
    o, final, _, _ = chunk.forward(inp["q"], inp["k"], inp["v"], inp["beta"], 0.3, inp["initial_state"], True, info,
                                   chunk_size=16)
    ref = {n: x.cpu().double() for n, x in inp.items()}
    o_ref, final_ref = recurrent_delta_rule(ref["q"], ref["k"], ref["v"], ref["beta"], 0.3, ref["initial_state"],
                                            True, cu_seqlens=cu.cpu())
    assert rel_rms(o, o_ref) <= BOUNDS[torch.float32] and rel_rms(final, final_ref) <= BOUNDS[torch.float32]


def test_no_sequence_long_enough(poison, split):
    # forced on, with no sequence of SPLIT_MIN_TOKENS: the unsplit forward, bit for bit
    plans = split(3, 1000)
    inp = make_inputs(1, 70, 1, 16, 16, torch.float16, device=DEVICE, seed=3)
    info = seq_info(1, 70, torch.device(DEVICE), None, None)
    args = (inp["q"], inp["k"], inp["v"], inp["beta"], 0.25, None, True, info)
    o, final, _, _ = chunk.forward(*args, chunk_size=16)
    assert plans == [None]
    with chunk_plan.overrides(split_partitions=1):
        o2, final2, _, _ = chunk.forward(*args, chunk_size=16)
    assert torch.equal(o, o2) and torch.equal(final, final2)


def test_pass1_walks_for_final_states(poison, split, monkeypatch):
    # pass 1 runs the plan's walk for its final states only (forward.walk_final_states: the portable walk's final
    # states here, the Hopper walk without its output on the GPU, test_seq_split_gpu.py): twice, on U and on W
    split(4, 32)
    calls = []
    final_states = chunk_forward.walk_final_states
    monkeypatch.setattr(chunk_forward, "walk_final_states", lambda *a: calls.append(a[6].num_seqs) or final_states(*a))
    lengths = [150, 1, 100]
    inp = make_inputs(1, sum(lengths), 2, 16, 24, torch.float16, device=DEVICE, seed=6, initial_state=True,
                      N=len(lengths))
    cu = random_cu_seqlens(lengths, DEVICE)
    info = seq_info(1, sum(lengths), torch.device(DEVICE), cu, cu.cpu())
    args = (inp["q"], inp["k"], inp["v"], inp["beta"], 0.25, inp["initial_state"], True, info)
    o, final = chunk.forward(*args, needs_backward=False, chunk_size=16)[:2]
    assert len(calls) == 2 and plans_split(info, 4, 32) is not None
    ref = {n: x.cpu().double() for n, x in inp.items()}
    o_ref, final_ref = recurrent_delta_rule(ref["q"], ref["k"], ref["v"], ref["beta"], 0.25, ref["initial_state"],
                                            True, cu_seqlens=cu.cpu())
    assert rel_rms(o, o_ref) <= BOUNDS[torch.float16] and rel_rms(final, final_ref) <= BOUNDS[torch.float16]


def plans_split(info, P, min_tokens):
    return seq_split.split_plan_for(info, P, min_tokens, 16, info.cu_seqlens.device)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only")
def test_no_side_stream_off_cuda(poison, split, monkeypatch):
    # the walk on W runs beside the walk on U on a side CUDA stream; on CPU tensors (the interpreter) never
    plans = split(4, 64)
    monkeypatch.setattr(seq_split, "side_stream", lambda *args: pytest.fail("asked for a side stream"))
    inp = make_inputs(1, 130, 1, 16, 16, torch.float32, device=DEVICE, seed=4)
    info = seq_info(1, 130, torch.device(DEVICE), None, None)
    chunk.forward(inp["q"], inp["k"], inp["v"], inp["beta"], 0.25, None, True, info, chunk_size=16)
    assert plans[-1].walk_w is not None


# ---------------------------------------------------------------- gradients through the API

def gradients(inp, do, dht, cu, fn, **opts):
    """(dq, dk, dv, dbeta, dh0) of sum(o * do) + sum(final_state * dht)."""
    o, final = fn(inp["q"], inp["k"], inp["v"], inp["beta"], 0.3, inp["initial_state"], True, cu_seqlens=cu,
                  **opts)[:2]
    loss = (o.double() * do.double()).sum() + (final.double() * dht.double()).sum()
    return torch.autograd.grad(loss, [inp[n] for n in ("q", "k", "v", "beta", "initial_state")])


@pytest.mark.parametrize("dtype, C, lengths, P", [
    (torch.float32, 16, [0, 100, 1, 70], 3),
    (torch.float16, 32, [161], 4),
])
def test_gradients_split(poison, split, monkeypatch, dtype, C, lengths, P):
    # the backward is the unsplit one (it recomputes from Tinv, the same bits split or not): the gradients with the
    # split forced equal those without it bit for bit, and both match the float64 recurrence's
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    plans = split(P, 2 * C)
    H, K, V = 1, 24, 32
    inp = make_inputs(1, sum(lengths), H, K, V, dtype, device=DEVICE, seed=P + C, initial_state=True,
                      N=len(lengths), requires_grad=True)
    cu = random_cu_seqlens(lengths, DEVICE)
    g = torch.Generator().manual_seed(P)
    do = torch.randn(1, sum(lengths), H, V, generator=g).to(dtype)
    dht = torch.randn(len(lengths), H, K, V, generator=g)
    got = gradients(inp, do.to(DEVICE), dht.to(DEVICE), cu, deltatron.chunk_delta_rule, chunk_size=C)
    assert plans[-1] is not None
    ref_inp = {n: x.detach().cpu().double().requires_grad_() for n, x in inp.items()}
    want = gradients(ref_inp, do, dht, cu.cpu(), recurrent_delta_rule)
    for name, x, ref in zip(("dq", "dk", "dv", "dbeta", "dh0"), got, want):
        assert rel_rms(x, ref) <= BOUNDS[dtype], name
    count = len(plans)
    with chunk_plan.overrides(split_partitions=1):
        unsplit = gradients(inp, do.to(DEVICE), dht.to(DEVICE), cu, deltatron.chunk_delta_rule, chunk_size=C)
    assert len(plans) == count
    assert all(torch.equal(a, b) for a, b in zip(got, unsplit))
