"""The chunk forward's sequence split (deltatron/kernels/chunk/schedule/seq_split.py) at realistic sizes: the
benchmark's b1-t32768-h16 (where the rule splits on the H200) and a varlen batch with long and short sequences, split
(by the rule, or forced with plan.overrides(split_partitions=P)) against unsplit (split_partitions=1) and both
against the float64 chunkwise oracle; the pass-1 walks counted and the walk on W seen on the side stream; the
gradients (the backward is the unsplit one) bitwise equal with and without the split; pass 1 on the Hopper walk
without its output (its final states bitwise the full walk's: hopper/test_walk_gpu.py)."""
import importlib

import pytest
import torch

import deltatron
from deltatron.kernels import chunk
from deltatron.kernels.chunk import plan
from deltatron.kernels.utils import seq_info
from deltatron.reference import chunk_delta_rule_reference

from ....helpers import BOUNDS, make_inputs, random_cu_seqlens, rel_rms
from .. import test_forward_gpu
from ..helpers import hopper_fits

pytestmark = pytest.mark.gpu

gluon_walk_runs = test_forward_gpu.gluon_walk_runs  # the Hopper walk's hang guard (a fixture), shared
chunk_forward = importlib.import_module("deltatron.kernels.chunk.forward")  # the package exports a function


def oracle(x, scale, cu_seqlens=None):
    d = {n: t.double() for n, t in x.items() if n != "do"}
    return chunk_delta_rule_reference(d["q"], d["k"], d["v"], d["beta"], scale, d.get("initial_state"), True,
                                      cu_seqlens=cu_seqlens, chunk_size=64)


def forward(x, info, partitions=None, **forced):
    """chunk.forward under plan.overrides(split_partitions=partitions, **forced) (partitions None: the rule's, 1: no
    split): (o, final, the pass-1 walks [(sequences, stream)])."""
    walks, walk = [], chunk_forward.walk_final_states

    def spy(*args):  # pass 1's walks, each called through the module
        walks.append((args[6].num_seqs, torch.cuda.current_stream()))
        return walk(*args)

    saved = chunk_forward.walk_final_states
    chunk_forward.walk_final_states = spy
    try:
        with plan.overrides(split_partitions=partitions, **forced):
            o, final, _, _ = chunk.forward(x["q"], x["k"], x["v"], x["beta"], 128 ** -0.5, x.get("initial_state"),
                                           True, info, chunk_size=64)
    finally:
        chunk_forward.walk_final_states = saved
    return o, final, walks


def assert_pass1_walks_without_output(monkeypatch, x, info, partitions):
    """The split forward's pass 1 runs two walks (on U, on W) for their final states; where the Hopper walk runs,
    each is the Hopper walk without its output (gluon_state_final_fwd), the split forward within the bound of the
    unsplit one."""
    final_only = []
    if hopper_fits(x["k"], x["v"]):
        from deltatron.kernels.chunk.hopper import walk as gluon_walk

        walk = gluon_walk.gluon_state_final_fwd
        monkeypatch.setattr(gluon_walk, "gluon_state_final_fwd",
                            lambda *a, **kw: final_only.append(1) or walk(*a, **kw))
    o_unsplit, _, _ = forward(x, info, 1)
    assert final_only == []
    o, final, walks = forward(x, info, partitions)
    assert len(walks) == 2 and final_only == ([1, 1] if hopper_fits(x["k"], x["v"]) else [])
    assert rel_rms(o, o_unsplit) < BOUNDS[x["q"].dtype]


def count_pairs(monkeypatch) -> list:
    """A list that gets an entry each time the forward makes the residual form's Tb (forward.tinv_pair_fwd)."""
    pairs, pair_fwd = [], chunk_forward.tinv_pair_fwd
    monkeypatch.setattr(chunk_forward, "tinv_pair_fwd", lambda *a, **kw: pairs.append(1) or pair_fwd(*a, **kw))
    return pairs


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("partitions", [None, 4])
def test_split_b1_t32768_h16(poison, monkeypatch, request, partitions, residual):
    # None: the rule's choice, P = 3 on the H200; 4: forced. Split and unsplit against the
    # float64 oracle, the split's error within a fifth of the unsplit's (the emulation of the roundings found them
    # equal to 3 digits); pass 1's two walks: on U (partitions 0..P-2) on the forward's stream, on W (1..P-2) on
    # the side stream. residual: the split's walks in the residual form (overrides(residual=...): pass 1 on Tb and
    # V, and on Tb and K for the walk on W), where the Hopper walk runs; the unsplit forward runs it there by the rule
    x = make_inputs(1, 32768, 16, 128, 128, torch.bfloat16, device="cuda", initial_state=True, seed=11)
    info = seq_info(1, 32768, torch.device("cuda"), None, None)
    gluon = hopper_fits(x["k"], x["v"])
    if partitions is None and not gluon:
        pytest.skip("the rule splits where the Hopper walk runs (sm_90) only")
    if residual and not gluon:
        pytest.skip("the residual form runs on the Hopper walk (sm_90) only")
    if gluon:
        request.getfixturevalue("gluon_walk_runs")
    pairs = count_pairs(monkeypatch)
    o0, final0, walks0 = forward(x, info, 1)
    o, final, walks = forward(x, info, partitions, residual=residual)
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
    # Split and unsplit in the same form (overrides(residual=...)), so that the sequences the split leaves alone get
    # bitwise the same outputs: the W, U form, or the residual form (the Hopper walk's by the rule)
    lengths = [20000, 0, 1, 63, 64, 65, 9000, 3000]
    TT, N = sum(lengths), len(lengths)
    x = make_inputs(1, TT, 16, 128, 128, dtype, device="cuda", initial_state=True, N=N, seed=5)
    cu = random_cu_seqlens(lengths, "cuda")
    info = seq_info(1, TT, torch.device("cuda"), cu, cu.cpu())
    if residual and not hopper_fits(x["k"], x["v"]):
        pytest.skip("the residual form runs on the Hopper walk (sm_90) only")
    if hopper_fits(x["k"], x["v"]):
        request.getfixturevalue("gluon_walk_runs")
    pairs = count_pairs(monkeypatch)
    o0, final0, _ = forward(x, info, 1, residual=residual)
    o, final, walks = forward(x, info, 3, residual=residual)
    assert len(walks) == 2  # the walk on U (with a filler), the walk on W
    assert len(pairs) == (2 if residual and hopper_fits(x["k"], x["v"]) else 0)
    o_ref, final_ref = oracle(x, 128 ** -0.5, cu_seqlens=cu.cpu())
    for got in ((o, final), (o0, final0)):
        assert rel_rms(got[0], o_ref) < BOUNDS[dtype] and rel_rms(got[1], final_ref) < BOUNDS[dtype]
    assert rel_rms(o, o_ref) <= 1.2 * rel_rms(o0, o_ref)
    assert torch.equal(final[1], x["initial_state"][1])
    # the sequences not split: the same walk on the same states as unsplit, so their outputs are bitwise equal
    # where both forwards run the same kernel (the Hopper walk at these counts, or the same Triton launch)
    if hopper_fits(x["k"], x["v"]):
        short = slice(20000, 20000 + 1 + 63 + 64 + 65)
        assert torch.equal(o[:, short], o0[:, short])


def test_split_fp32_triton_walk(poison):
    # fp32 (the portable walks: the Hopper one is 16-bit) at P = 4 forced, K = V = 128, 4 heads, initial state
    x = make_inputs(1, 16384, 4, 128, 128, torch.float32, device="cuda", initial_state=True, seed=3)
    info = seq_info(1, 16384, torch.device("cuda"), None, None)
    o, final, walks = forward(x, info, 4)
    assert [n for n, _ in walks] == [3, 2]
    o_ref, final_ref = oracle(x, 128 ** -0.5)
    assert rel_rms(o, o_ref) < BOUNDS[torch.float32] and rel_rms(final, final_ref) < BOUNDS[torch.float32]


def test_split_gradients_equal_unsplit(monkeypatch, request):
    # forward+backward through the API at b1-t32768-h16 (bf16), split by the rule (forced at P = 3 off sm_90):
    # the backward recomputes from Tinv, the same bits split or not, so the gradients are bitwise equal
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    x = make_inputs(1, 32768, 16, 128, 128, torch.bfloat16, device="cuda", seed=2, requires_grad=True)
    do = torch.randn_like(x["v"])
    if hopper_fits(x["k"], x["v"]):
        request.getfixturevalue("gluon_walk_runs")
        partitions = None
    else:
        partitions = 3
    results = {}
    for split in (False, True):
        with plan.overrides(split_partitions=partitions if split else 1):
            call_plan = chunk.plan_call(x["q"], x["k"], x["v"], seq_info(1, 32768, torch.device("cuda"), None, None),
                                        True)
            assert call_plan.split == split
            o, _ = deltatron.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"])
        results[split] = (o, torch.autograd.grad(o, [x[n] for n in ("q", "k", "v", "beta")], do))
    assert rel_rms(results[True][0], results[False][0]) < BOUNDS[torch.bfloat16]
    assert all(torch.equal(a, b) for a, b in zip(results[True][1], results[False][1]))


def test_pass1_without_output_b1_t32768_h16(poison, monkeypatch, request):
    # the rule's split where the Hopper walk runs (P = 3 on the H200), else P = 3 forced on the portable walk
    x = make_inputs(1, 32768, 16, 128, 128, torch.bfloat16, device="cuda", initial_state=True, seed=12)
    info = seq_info(1, 32768, torch.device("cuda"), None, None)
    if hopper_fits(x["k"], x["v"]):
        request.getfixturevalue("gluon_walk_runs")
        assert_pass1_walks_without_output(monkeypatch, x, info, None)
    else:
        assert_pass1_walks_without_output(monkeypatch, x, info, 3)


def test_pass1_without_output_varlen(poison, monkeypatch, request):
    # test_split_varlen's batch (two long sequences split at P = 3 forced, fillers in pass 1, short and empty ones)
    lengths = [20000, 0, 1, 63, 64, 65, 9000, 3000]
    TT, N = sum(lengths), len(lengths)
    x = make_inputs(1, TT, 16, 128, 128, torch.bfloat16, device="cuda", initial_state=True, N=N, seed=5)
    cu = random_cu_seqlens(lengths, "cuda")
    info = seq_info(1, TT, torch.device("cuda"), cu, cu.cpu())
    if hopper_fits(x["k"], x["v"]):
        request.getfixturevalue("gluon_walk_runs")
    assert_pass1_walks_without_output(monkeypatch, x, info, 3)
