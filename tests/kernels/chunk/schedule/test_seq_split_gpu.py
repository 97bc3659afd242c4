"""The chunk forward's sequence split (deltatron/kernels/chunk/seq_split.py) at realistic sizes: the benchmark's
b1-t32768-h16 (where the rule splits on the H200) and a varlen batch with long and short sequences, split against
unsplit and both against the float64 chunkwise oracle; the pass-1 walks counted and the walk on W seen on the side
stream; the gradients (the backward is the unsplit one) bitwise equal with and without the split; pass 1 without
outputs (seq_split.PASS1_OUTPUT_FREE) against pass 1 with them: the same split forward, bit for bit."""
import pytest
import torch

import deltatron
from deltatron.kernels import chunk
from deltatron.kernels.chunk import seq_split, state
from deltatron.kernels.utils import seq_info
from deltatron.reference import chunk_delta_rule_reference

from ..helpers import BOUNDS, make_inputs, random_cu_seqlens, rel_rms
from . import test_chunk_forward_gpu

pytestmark = pytest.mark.gpu

gluon_walk_runs = test_chunk_forward_gpu.gluon_walk_runs  # the Gluon walk's hang guard (a fixture), shared


def oracle(x, scale, cu_seqlens=None):
    d = {n: t.double() for n, t in x.items() if n != "do"}
    return chunk_delta_rule_reference(d["q"], d["k"], d["v"], d["beta"], scale, d.get("initial_state"), True,
                                      cu_seqlens=cu_seqlens, chunk_size=64)


def forward(x, info, switch, partitions=None, output_free=True):
    """chunk.forward with SEQ_SPLIT = switch (and SPLIT_PARTITIONS, PASS1_OUTPUT_FREE = output_free), restored
    after: (o, final, the pass-1 walks [(sequences, stream)])."""
    walks, walk = [], seq_split.walk_final_states

    def spy(*args):  # pass 1's walks, each called through the module
        walks.append((args[5].num_seqs, torch.cuda.current_stream()))
        return walk(*args)

    saved = seq_split.SEQ_SPLIT, seq_split.SPLIT_PARTITIONS, seq_split.PASS1_OUTPUT_FREE, seq_split.walk_final_states
    seq_split.SEQ_SPLIT, seq_split.SPLIT_PARTITIONS, seq_split.PASS1_OUTPUT_FREE = switch, partitions, output_free
    seq_split.walk_final_states = spy
    try:
        o, final, _, _ = chunk.forward(x["q"], x["k"], x["v"], x["beta"], 128 ** -0.5, x.get("initial_state"), True,
                                       info, chunk_size=64)
    finally:
        (seq_split.SEQ_SPLIT, seq_split.SPLIT_PARTITIONS, seq_split.PASS1_OUTPUT_FREE,
         seq_split.walk_final_states) = saved
    return o, final, walks


def assert_pass1_output_free_same_bits(monkeypatch, x, info, switch, partitions):
    """The split forward with pass 1 walking without outputs (the default) gives the same o and final states, bit
    for bit, as with pass 1 on the forward's walk, its outputs dropped; where the Gluon walk runs, pass 1 ran its
    walk without the output twice (walk on U, walk on W)."""
    final_only = []
    if state.gluon_walk_applies(x["k"], x["v"], 64):
        from deltatron.kernels.chunk import gluon_walk

        walk = gluon_walk.gluon_state_final_fwd
        monkeypatch.setattr(gluon_walk, "gluon_state_final_fwd",
                            lambda *a, **kw: final_only.append(1) or walk(*a, **kw))
    o_old, final_old, _ = forward(x, info, switch, partitions, output_free=False)
    assert final_only == []
    o, final, walks = forward(x, info, switch, partitions)
    assert len(walks) == 2 and final_only == ([1, 1] if state.gluon_walk_applies(x["k"], x["v"], 64) else [])
    assert torch.equal(o, o_old) and torch.equal(final, final_old)


def count_pairs(monkeypatch) -> list:
    """A list that gets an entry each time the forward makes the residual form's Tb (chunk.tinv_pair_fwd)."""
    pairs, pair_fwd = [], chunk.tinv_pair_fwd
    monkeypatch.setattr(chunk, "tinv_pair_fwd", lambda *a, **kw: pairs.append(1) or pair_fwd(*a, **kw))
    return pairs


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("partitions", [None, 4])
def test_split_b1_t32768_h16(poison, monkeypatch, request, partitions, residual):
    # None: the rule's choice (SEQ_SPLIT = None), P = 3 on the H200; 4: forced. Split and unsplit against the
    # float64 oracle, the split's error within a fifth of the unsplit's (the emulation of the roundings found them
    # equal to 3 digits); pass 1's two walks: on U (partitions 0..P-2) on the forward's stream, on W (1..P-2) on
    # the side stream. residual: the split's walks in the residual form (seq_split.RESIDUAL_SPLIT: pass 1 on Tb and
    # V, and on Tb and K for the walk on W), where the Gluon walk runs; the unsplit forward runs it there either way
    monkeypatch.setattr(seq_split, "RESIDUAL_SPLIT", residual)
    x = make_inputs(1, 32768, 16, 128, 128, torch.bfloat16, device="cuda", initial_state=True, seed=11)
    info = seq_info(1, 32768, torch.device("cuda"), None, None)
    gluon = state.gluon_walk_applies(x["k"], x["v"], 64)
    if partitions is None and not gluon:
        pytest.skip("the rule splits where the Gluon walk runs (sm_90) only")
    if gluon:
        request.getfixturevalue("gluon_walk_runs")
    pairs = count_pairs(monkeypatch)
    o0, final0, walks0 = forward(x, info, False)
    o, final, walks = forward(x, info, None if partitions is None else True, partitions)
    assert len(pairs) == ((2 if residual else 1) if gluon else 0)
    P = 3 if partitions is None else partitions
    assert walks0 == [] and [n for n, _ in walks] == [P - 1, P - 2]
    assert walks[0][1] == torch.cuda.current_stream() and walks[1][1] != walks[0][1]
    o_ref, final_ref = oracle(x, 128 ** -0.5)
    err, err0 = rel_rms(o, o_ref), rel_rms(o0, o_ref)
    assert err < BOUNDS[torch.bfloat16] and err0 < BOUNDS[torch.bfloat16]
    assert err <= 1.2 * err0, (err, err0)
    errf, errf0 = rel_rms(final, final_ref), rel_rms(final0, final_ref)
    assert errf < BOUNDS[torch.bfloat16] and errf <= 1.2 * errf0, (errf, errf0)
    assert rel_rms(o, o0) < BOUNDS[torch.bfloat16]


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_varlen(poison, monkeypatch, request, dtype, residual):
    # two long sequences split (P = 3 forced; the rule does not split 8 x 16 sequences x heads), short ones, an
    # empty one and one of one token untouched; fillers in pass 1 over the gaps between the long ones' partitions.
    # Split and unsplit in the same form, so that the sequences the split leaves alone get bitwise the same outputs:
    # the W, U form (RESIDUAL_WALK off), or the residual form (RESIDUAL_SPLIT on; the unsplit forward's default)
    monkeypatch.setattr(state, "RESIDUAL_WALK", residual)
    monkeypatch.setattr(seq_split, "RESIDUAL_SPLIT", residual)
    lengths = [20000, 0, 1, 63, 64, 65, 9000, 3000]
    TT, N = sum(lengths), len(lengths)
    x = make_inputs(1, TT, 16, 128, 128, dtype, device="cuda", initial_state=True, N=N, seed=5)
    cu = random_cu_seqlens(lengths, "cuda")
    info = seq_info(1, TT, torch.device("cuda"), cu, cu.cpu())
    if state.gluon_walk_applies(x["k"], x["v"], 64):
        request.getfixturevalue("gluon_walk_runs")
    pairs = count_pairs(monkeypatch)
    o0, final0, _ = forward(x, info, False)
    o, final, walks = forward(x, info, True, 3)
    assert len(walks) == 2  # the walk on U (with a filler), the walk on W
    assert len(pairs) == (2 if residual and state.gluon_walk_applies(x["k"], x["v"], 64) else 0)
    o_ref, final_ref = oracle(x, 128 ** -0.5, cu_seqlens=cu.cpu())
    for got in ((o, final), (o0, final0)):
        assert rel_rms(got[0], o_ref) < BOUNDS[dtype] and rel_rms(got[1], final_ref) < BOUNDS[dtype]
    assert rel_rms(o, o_ref) <= 1.2 * rel_rms(o0, o_ref)
    assert torch.equal(final[1], x["initial_state"][1])
    # the sequences not split: the same walk on the same states as unsplit, so their outputs are bitwise equal
    # where both forwards run the same kernel (the Gluon walk at these counts, or the same Triton launch)
    if state.gluon_walk_applies(x["k"], x["v"], 64):
        short = slice(20000, 20000 + 1 + 63 + 64 + 65)
        assert torch.equal(o[:, short], o0[:, short])


def test_split_fp32_triton_walk(poison):
    # fp32 (the Triton walks: the Gluon one is 16-bit) at P = 4 forced, K = V = 128, 4 heads, initial state
    x = make_inputs(1, 16384, 4, 128, 128, torch.float32, device="cuda", initial_state=True, seed=3)
    info = seq_info(1, 16384, torch.device("cuda"), None, None)
    o, final, walks = forward(x, info, True, 4)
    assert [n for n, _ in walks] == [3, 2]
    o_ref, final_ref = oracle(x, 128 ** -0.5)
    assert rel_rms(o, o_ref) < BOUNDS[torch.float32] and rel_rms(final, final_ref) < BOUNDS[torch.float32]


def test_split_gradients_equal_unsplit(monkeypatch, request):
    # forward+backward through the API at b1-t32768-h16 (bf16), split by the rule (forced at P = 3 off sm_90):
    # the backward recomputes from Tinv, the same bits split or not, so the gradients are bitwise equal
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    x = make_inputs(1, 32768, 16, 128, 128, torch.bfloat16, device="cuda", seed=2, requires_grad=True)
    do = torch.randn_like(x["v"])
    if state.gluon_walk_applies(x["k"], x["v"], 64):
        request.getfixturevalue("gluon_walk_runs")
        switch, partitions = None, None
    else:
        switch, partitions = True, 3
    results = {}
    for split in (False, True):
        monkeypatch.setattr(seq_split, "SEQ_SPLIT", switch if split else False)
        monkeypatch.setattr(seq_split, "SPLIT_PARTITIONS", partitions)
        plan = seq_split.plan_for(x["k"], x["v"], seq_info(1, 32768, torch.device("cuda"), None, None), 64)
        assert (plan is not None) == split
        o, _ = deltatron.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"])
        results[split] = (o, torch.autograd.grad(o, [x[n] for n in ("q", "k", "v", "beta")], do))
    assert rel_rms(results[True][0], results[False][0]) < BOUNDS[torch.bfloat16]
    assert all(torch.equal(a, b) for a, b in zip(results[True][1], results[False][1]))


def test_pass1_output_free_b1_t32768_h16(poison, monkeypatch, request):
    # the rule's split where the Gluon walk runs (P = 3 on the H200), else P = 3 forced on the Triton walk
    x = make_inputs(1, 32768, 16, 128, 128, torch.bfloat16, device="cuda", initial_state=True, seed=12)
    info = seq_info(1, 32768, torch.device("cuda"), None, None)
    if state.gluon_walk_applies(x["k"], x["v"], 64):
        request.getfixturevalue("gluon_walk_runs")
        assert_pass1_output_free_same_bits(monkeypatch, x, info, None, None)
    else:
        assert_pass1_output_free_same_bits(monkeypatch, x, info, True, 3)


def test_pass1_output_free_varlen(poison, monkeypatch, request):
    # test_split_varlen's batch (two long sequences split at P = 3 forced, fillers in pass 1, short and empty ones)
    lengths = [20000, 0, 1, 63, 64, 65, 9000, 3000]
    TT, N = sum(lengths), len(lengths)
    x = make_inputs(1, TT, 16, 128, 128, torch.bfloat16, device="cuda", initial_state=True, N=N, seed=5)
    cu = random_cu_seqlens(lengths, "cuda")
    info = seq_info(1, TT, torch.device("cuda"), cu, cu.cpu())
    if state.gluon_walk_applies(x["k"], x["v"], 64):
        request.getfixturevalue("gluon_walk_runs")
    assert_pass1_output_free_same_bits(monkeypatch, x, info, True, 3)
