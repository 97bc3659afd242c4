"""The chunk forward's sequence split (deltatron/kernels/chunk/seq_split.py): the rule, the plan of the passes, and
the forward and its gradients with the split forced (SEQ_SPLIT = True, P = 2..4) against the float64 recurrence.
Tiny shapes for the interpreter; tests/gpu/test_seq_split_gpu.py runs realistic ones."""
import pytest
import torch

import deltatron
from deltatron.kernels import chunk
from deltatron.kernels.chunk import seq_split, state
from deltatron.kernels.utils import seq_info
from deltatron.reference import recurrent_delta_rule

from ..helpers import BOUNDS, DEVICE, INTERPRET, make_inputs, random_cu_seqlens, rel_rms

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")


@pytest.fixture
def split(monkeypatch):
    """force(P, min_tokens) forces the split; returns the list to which each forward's plan is appended."""
    plans = []
    plan_for = seq_split.plan_for

    def spy(*args):
        plan = plan_for(*args)
        plans.append(plan)
        return plan

    monkeypatch.setattr(seq_split, "plan_for", spy)

    def force(P, min_tokens):
        monkeypatch.setattr(seq_split, "SEQ_SPLIT", True)
        monkeypatch.setattr(seq_split, "SPLIT_PARTITIONS", P)
        monkeypatch.setattr(seq_split, "SPLIT_MIN_TOKENS", min_tokens)
        return plans

    return force


# ---------------------------------------------------------------- the rule and the plan

@pytest.mark.parametrize("N, H, T, sms, expected", [
    (1, 16, 32768, 132, 3),  # b1-t32768-h16: (2P - 3) x 16 x 2 <= 132 up to P = 3
    (1, 22, 32768, 132, 3), (1, 23, 32768, 132, 1),  # 3 x 23 x 2 > 132: no P >= 3 fits
    (2, 8, 16384, 132, 1), (2, 8, 65536, 264, 4),  # two sequences: (4P - 3) x 8 x 2 <= SMs (fillers counted)
    (1, 16, 32768, 264, 5),  # more SMs, more partitions
    (1, 16, 8192, 264, 4),  # partitions of 2048 tokens at least
    (1, 8, 32768, 132, 1),  # below 16 sequences x heads
    (1, 64, 32768, 132, 1), (2, 32, 8192, 132, 1), (20, 16, 32768, 132, 1),  # 64 and more
    (1, 16, 8191, 132, 1), (2, 8, 16382, 132, 1),  # sequences shorter than 8192 tokens on average
])
def test_split_partitions_rule(N, H, T, sms, expected):
    assert seq_split.split_partitions(N, H, T, sms) == expected


def test_partition_count_by_switch(monkeypatch):
    k = torch.empty(1, 1, 16, 128, dtype=torch.bfloat16)
    info = seq_info(1, 32768, torch.device("cpu"), None, None)
    monkeypatch.setattr(seq_split, "num_sms", lambda device: 132)
    for switch, gluon, expected in [(False, True, 1), (None, False, 1), (None, True, 3), (True, False, 3)]:
        monkeypatch.setattr(seq_split, "SEQ_SPLIT", switch)
        monkeypatch.setattr(state, "gluon_walk_applies", lambda k, v, C, _gluon=gluon: _gluon)
        assert seq_split.partition_count(k, k, info, 64) == expected, (switch, gluon)
    monkeypatch.setattr(seq_split, "SPLIT_PARTITIONS", 5)
    assert seq_split.partition_count(k, k, info, 64) == 5


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
    assert plan.first_part.tolist() == [0, 1, 2, 6, 7]
    # the backward's pass 1 (reverse_split.py): partitions 1..3, fillers over [151, 239)
    rev = plan.walk_rev.cu_seqlens_cpu.tolist()
    assert rev == [49, 97, 129, 151, 199, 239, 271, 303, 320]
    assert plan.rows_rev[0] is None and [rows(rev[1:], r) for r in plan.rows_rev[1:]] == [[0, 5], [1, 6], [2, 7]]
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
    seq_split.SEQ_SPLIT = False
    _, _, saved_unsplit, _ = chunk.forward(*args, False, info, chunk_size=C)
    assert plans[-1] is None and torch.equal(saved[0], saved_unsplit[0])
    seq_split.SEQ_SPLIT = True
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
    seq_split.SEQ_SPLIT = False
    o2, final2, _, _ = chunk.forward(*args, chunk_size=16)
    assert torch.equal(o, o2) and torch.equal(final, final2)


def test_pass1_output_free_same_bits(poison, split, monkeypatch):
    # pass 1 through state.state_final_fwd (PASS1_OUTPUT_FREE, the default) or state_output_fwd, its outputs
    # dropped: the same final states, so the same split forward bit for bit (here on the Triton walk, whose final
    # states state_final_fwd takes from state_output_fwd; the Gluon walk's: tests/gpu/test_seq_split_gpu.py)
    split(4, 32)
    calls = []
    final_fwd = state.state_final_fwd
    monkeypatch.setattr(state, "state_final_fwd", lambda *a: calls.append(a[5].num_seqs) or final_fwd(*a))
    lengths = [150, 1, 100]
    inp = make_inputs(1, sum(lengths), 2, 16, 24, torch.float16, device=DEVICE, seed=6, initial_state=True,
                      N=len(lengths))
    cu = random_cu_seqlens(lengths, DEVICE)
    info = seq_info(1, sum(lengths), torch.device(DEVICE), cu, cu.cpu())
    args = (inp["q"], inp["k"], inp["v"], inp["beta"], 0.25, inp["initial_state"], True, info)
    results = {}
    for output_free in (False, True):
        monkeypatch.setattr(seq_split, "PASS1_OUTPUT_FREE", output_free)
        results[output_free] = chunk.forward(*args, needs_backward=False, chunk_size=16)[:2]
        assert len(calls) == (2 if output_free else 0)  # the walks on U and on W
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))


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
    seq_split.SEQ_SPLIT = False
    unsplit = gradients(inp, do.to(DEVICE), dht.to(DEVICE), cu, deltatron.chunk_delta_rule, chunk_size=C)
    assert plans[-1] is None
    assert all(torch.equal(a, b) for a, b in zip(got, unsplit))
