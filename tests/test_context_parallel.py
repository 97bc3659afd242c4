"""Context parallelism (deltatron/context_parallel.py, DESIGN.md §13): a stream sharded over ranks gives the unsharded
op's outputs, final states and gradients. The shard's map [S_loc | M] against the float64 recurrence; the ranks run
one after another in one process (the per-rank pieces, on the PyTorch backend and the Triton kernels); process
groups of 2 and 4 ranks over gloo; and 2 GPUs over NCCL (marker gpu, with 2 GPUs)."""
import os
import subprocess
import sys
from typing import NamedTuple, Optional, Tuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import deltatron
import deltatron.layers
from deltatron import context_parallel
from deltatron.reference import recurrent_gated_delta_rule
from tests.helpers import BOUNDS, DEVICE, make_gated_inputs, rel_rms

RULES = ("delta", "gated", "kda")  # the delta rule, a gate per value head, a gate per key channel (KDA)
# per world size: the tokens of each shard, and the streams' sequence lengths (None: a fixed-length batch of 2 rows,
# each sharded along time): sequences crossing one or more boundaries, ending on a boundary, empty sequences on a
# boundary and at the end, ranks holding no sequence start
SHARD_TOKENS = {2: 24, 4: 16}
STREAMS = {2: (None, (5, 0, 30, 13), (5, 19, 0, 24, 0)), 4: (None, (3, 50, 0, 11), (16, 0, 20, 28))}
FP32_BOUND = 1e-5  # sharded against unsharded, both fp32


def make_stream(rule, world, lengths, initial_state, dtype=torch.float32, device="cpu", T=None, K=8, V=12, seed=0):
    """(inputs, cu_seqlens or None, loss weights (do, dht)) of a stream of world shards of T tokens (per row at fixed
    length); every input a leaf that requires grad, grouped value heads (Hk 2, Hv 4)."""
    T = world * (T or SHARD_TOKENS[world])
    B, N = (2, 2) if lengths is None else (1, len(lengths))
    inp = make_gated_inputs(B, T, 2, 4, K, V, dtype, N=N, initial_state=initial_state, seed=seed,
                            per_channel=rule == "kda")
    if rule == "delta":
        del inp["g"]
    inp = {n: x.to(device).requires_grad_(True) for n, x in inp.items()}
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(inp["v"].shape, generator=gen).to(device)
    dht = torch.randn(N, 4, K, V, generator=gen).to(device)
    return inp, cu, (do, dht)


def call(rule, inp, output_final_state=True, chunk_size=16, **options):
    """(o, final_state) of the rule's chunk op on the inputs (q, k, v, [g,] beta, [initial_state])."""
    args = [inp[n] for n in (("q", "k", "v", "beta") if rule == "delta" else ("q", "k", "v", "g", "beta"))]
    fn = {"delta": deltatron.chunk_delta_rule, "gated": deltatron.chunk_gated_delta_rule,
          "kda": deltatron.chunk_kda}[rule]
    return fn(*args, initial_state=inp.get("initial_state"), output_final_state=output_final_state,
              chunk_size=chunk_size, **options)


def shard(x, rank, world):
    """The rank's slice of the tokens of x [B, T, ...]."""
    T = x.shape[1] // world
    return x[:, rank * T:(rank + 1) * T]


def rank_inputs(inp, rank, world):
    return {n: x if n == "initial_state" else shard(x, rank, world) for n, x in inp.items()}


def results(inp, o, final, weights, world):
    """(o, final_state, gradients of every input) with the loss sum(o do) + sum(final dht) / world per rank (without
    its second term where final is None): the ranks' losses add up to the unsharded loss. o and do are the whole
    stream's or one rank's shard."""
    do, dht = weights
    loss = (o * do).sum() + (0 if final is None else (final * dht).sum() / world)
    # a rank where no sequence starts, without final states, has no share of dh0: zeros
    grads = torch.autograd.grad(loss, list(inp.values()), allow_unused=True, materialize_grads=True)
    return o.detach(), None if final is None else final.detach(), dict(zip(inp, grads))


def check(name, got, want, bound):
    err = rel_rms(got, want)
    assert err <= bound, f"{name}: relative RMS error {err:.2e} > {bound:.0e}"


def emulated(rule, inp, cu, weights, world):
    """(o, final_state, gradients) of the ranks run one after another (context_parallel.emulate_ranks): o the ranks'
    shards concatenated, the final state checked equal on every rank, gradients the sums of the ranks' shares."""
    parts = [rank_inputs(inp, r, world) for r in range(world)]

    def op_of_rank(r):
        return lambda v, h0, c, c_cpu: call(rule, {**parts[r], "v": v, "initial_state": h0}, cu_seqlens=c,
                                            cu_seqlens_cpu=c_cpu)

    out = context_parallel.emulate_ranks(op_of_rank, [p["v"] for p in parts], inp["q"].shape[-1],
                                         inp.get("initial_state"), True, None if cu is None else cu.cpu())
    for r, (_, final) in enumerate(out[1:], 1):
        assert torch.equal(final, out[0][1]), f"rank {r}'s final state differs from rank 0's"
    o, (do, dht) = torch.cat([o for o, _ in out], dim=1), weights
    loss = (o * do).sum() + sum((final * dht).sum() for _, final in out) / world
    return o.detach(), out[0][1].detach(), dict(zip(inp, torch.autograd.grad(loss, list(inp.values()))))


def unsharded(rule, inp, cu, weights):
    return results(inp, *call(rule, inp, cu_seqlens=cu), weights, 1)


def oracle(rule, inp, cu, weights):
    """The unsharded op in float64 on the CPU (the PyTorch backend)."""
    exact = {n: x.detach().double().cpu().requires_grad_(True) for n, x in inp.items()}
    with mock.patch.dict(os.environ, DELTATRON_BACKEND="torch"):
        return unsharded(rule, exact, None if cu is None else cu.cpu(), tuple(w.double().cpu() for w in weights))


def check_all(name, got, want, bound):
    check(f"{name}: o", got[0], want[0], bound)
    check(f"{name}: final state", got[1], want[1], bound)
    for n in want[2]:
        check(f"{name}: d{n}", got[2][n], want[2][n], bound)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_shard_map_is_the_transition_product(rule, backend, monkeypatch):
    """The op on [v | 0] from [0 | I]: final state [S_loc | M] with S_loc the float64 recurrence from zero and M the
    product of the tokens' transitions (I - beta_t k_t k_t^T) exp(g_t) (diag(exp(g_t)) per key channel); the
    output's last K columns scale q_t^T M_t; and from any S_in the recurrence ends at S_loc + M S_in (37 tokens:
    partial chunks)."""
    monkeypatch.setenv("DELTATRON_BACKEND", backend)
    K, V = 8, 12
    inp, _, _ = make_stream(rule, 1, None, True, T=37, K=K, V=V)
    x = {n: t.detach()[:1] for n, t in inp.items()}
    q, k, v, beta, S_in = (x[n].double() for n in ("q", "k", "v", "beta", "initial_state"))
    g = torch.zeros_like(beta) if rule == "delta" else x["g"].double()
    wide = {**x, "v": torch.cat([x["v"], x["v"].new_zeros(1, 37, 4, K)], -1),
            "initial_state": torch.cat([torch.zeros(1, 4, K, V), torch.eye(K).expand(1, 4, K, K)], -1)}
    device = DEVICE if backend == "triton" else "cpu"  # the Triton kernels: on the GPU, else in the interpreter
    o, maps = (t.cpu() for t in call(rule, {n: t.to(device) for n, t in wide.items()}))
    G = v.shape[2] // q.shape[2]
    kv, qv = k.repeat_interleave(G, 2)[0], q.repeat_interleave(G, 2)[0]  # [T, Hv, K]
    M, qM = torch.eye(K, dtype=torch.float64).expand(4, K, K), []
    for t in range(37):
        step = torch.eye(K, dtype=torch.float64) - beta[0, t, :, None, None] * kv[t, :, :, None] * kv[t, :, None, :]
        decay = g[0, t].exp()  # [Hv] or, per key channel, [Hv, K]: diag(exp(g_t)) scales the rows of the state
        M = step @ ((decay[:, :, None] if rule == "kda" else decay[:, None, None]) * M)
        qM.append(K ** -0.5 * torch.einsum("hk,hkj->hj", qv[t], M))
    _, S_loc = recurrent_gated_delta_rule(q, k, v, g, beta, K ** -0.5, None, True)
    check("S_loc", maps[..., :V], S_loc, BOUNDS[torch.float32])
    check("M", maps[..., V:], M[None], BOUNDS[torch.float32])
    check("scale q^T M_t", o[..., V:], torch.stack(qM)[None], BOUNDS[torch.float32])
    _, S_out = recurrent_gated_delta_rule(q, k, v, g, beta, K ** -0.5, S_in, True)
    check("S_loc + M S_in", S_loc + M[None] @ S_in, S_out, 1e-12)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stream", [0, 1, 2])
@pytest.mark.parametrize("initial_state", [True, False])
def test_ranks_in_turn_equal_unsharded(rule, world, stream, initial_state):
    """The per-rank pieces run in turn on the PyTorch backend (fp32) equal the unsharded op within 1e-5: o, the final
    states, the gradients of every input (dh0 the sum of the ranks' shares)."""
    inp, cu, weights = make_stream(rule, world, STREAMS[world][stream], initial_state)
    check_all(f"{rule}, {world} ranks, stream {STREAMS[world][stream]}", emulated(rule, inp, cu, weights, world),
              unsharded(rule, inp, cu, weights), FP32_BOUND)


def check_triton_ranks(rule, world, lengths, dtype, device, T, K, V):
    inp, cu, weights = make_stream(rule, world, lengths, True, dtype=dtype, device=device, T=T, K=K, V=V)
    check_all(f"{rule} {dtype}", emulated(rule, inp, cu, weights, world), oracle(rule, inp, cu, weights),
              BOUNDS[dtype])


@pytest.mark.parametrize("rule", RULES)
def test_ranks_in_turn_on_triton(rule, monkeypatch):
    """The per-rank pieces on the Triton kernels (the interpreter, or the GPU where there is one): 2 ranks, a sequence
    across them, an empty sequence on the boundary, against the float64 unsharded op."""
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    check_triton_ranks(rule, 2, (3, 9, 0, 4), torch.float32, DEVICE, 8, 8, 12)


@pytest.mark.gpu
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [None, (100, 1500, 0, 300, 148)])
def test_ranks_in_turn_on_gpu(rule, dtype, lengths):
    """The per-rank pieces on the Triton kernels of a GPU: 4 ranks of 512 tokens, K = V = 64 (the carried ranks' op
    128 columns wide), against the float64 unsharded op."""
    check_triton_ranks(rule, 4, lengths, dtype, "cuda", 512, 64, 64)


class Case(NamedTuple):
    """A sharded call checked against the unsharded op, both run on every rank of a group: the rule, the stream's
    lengths (None: fixed length), an initial state, whether the final states are asked for, the kernels of the
    sharded call and of the unsharded one ("torch": the PyTorch backend, or "triton"), the inputs' dtype (checked
    within GROUP_BOUNDS), the tokens per rank (None: SHARD_TOKENS), the head sizes and the chunk size."""
    rule: str
    lengths: Optional[Tuple[int, ...]]
    initial_state: bool
    final: bool = True
    kernels: str = "torch"
    reference: str = "torch"
    dtype: torch.dtype = torch.float32
    T: Optional[int] = None
    K: int = 8
    V: int = 12
    chunk_size: int = 16


GROUP_BOUNDS = {torch.float32: FP32_BOUND, torch.bfloat16: BOUNDS[torch.bfloat16]}  # sharded against unsharded


def check_case(rank, world, case, device):
    """The case's sharded call on this rank against the unsharded op: o and the gradients of the rank's shard, the
    final states, dh0 summed over the ranks. Returns the stream's inputs."""
    inp, cu, (do, dht) = make_stream(case.rule, world, case.lengths, case.initial_state, dtype=case.dtype,
                                     device=device, T=case.T, K=case.K, V=case.V)
    os.environ["DELTATRON_BACKEND"] = case.reference
    want = results(inp, *call(case.rule, inp, case.final, case.chunk_size, cu_seqlens=cu), (do, dht), 1)
    os.environ["DELTATRON_BACKEND"] = case.kernels
    mine = rank_inputs(inp, rank, world)
    got = results(inp, *call(case.rule, mine, case.final, case.chunk_size, cu_seqlens=cu, cp_group=dist.group.WORLD),
                  (shard(do, rank, world), dht), world)
    name = (f"rank {rank}/{world}, {case.rule} {case.dtype}, stream {case.lengths}, initial state "
            f"{case.initial_state}, {case.kernels}, final state {case.final}")
    bound = GROUP_BOUNDS[case.dtype]
    check(f"{name}: o", got[0], shard(want[0], rank, world), bound)
    if case.final:
        check(f"{name}: final state", got[1], want[1], bound)
    for n, grad in got[2].items():
        if n == "initial_state":  # this rank's share
            dist.all_reduce(grad)
            check(f"{name}: dh0 summed over the ranks", grad, want[2][n], bound)
        else:
            check(f"{name}: d{n}", shard(grad, rank, world), shard(want[2][n], rank, world), bound)
    return inp


def _group_worker(rank, world, store, cases, backend="gloo", device=None):
    """One rank of a process group: each case (check_case), then a stream whose cu_seqlens does not end at world * T
    refused. gloo: the tensors of a case on the PyTorch backend on the CPU, on the Triton kernels on DEVICE (gloo
    carries CUDA tensors); NCCL: device "cuda", GPU rank for rank."""
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for case in cases:
            inp = check_case(rank, world, case, device or (DEVICE if case.kernels == "triton" else "cpu"))
        stream = rf"{world} \* T = {inp['q'].shape[1]} .*context-parallel.*got 4"
        with pytest.raises(ValueError, match=f"cu_seqlens must end at {stream}"):
            call(case.rule, rank_inputs(inp, rank, world), cu_seqlens=torch.tensor([0, 4], device=inp["q"].device),
                 cp_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_process_group(world, tmp_path):
    """world processes over gloo, both rules, every stream, with and without initial states, forward and backward on
    the PyTorch backend; without final states (ranks whose results read no gathered map); and a sequence across the
    ranks on the Triton backend (the GPU's, else the interpreter; 2 ranks)."""
    cases = [Case(rule, lengths, h0) for rule in RULES for lengths in STREAMS[world] for h0 in (True, False)]
    cases += [Case(rule, STREAMS[world][2], True, final=False) for rule in RULES]
    if world == 2:  # one small case of the sharded call on the Triton kernels (the interpreter is slow)
        cases.append(Case("gated", STREAMS[world][1], True, kernels="triton"))
    mp.spawn(_group_worker, args=(world, str(tmp_path / "store"), cases), nprocs=world)


# NCCL on two GPUs: a fixed-length batch (2 rows), and a packed stream with a sequence across the boundary and an
# empty one, 2048 tokens a rank
NCCL_TOKENS = 2048
NCCL_STREAMS = (None, (700, 2900, 0, 496))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs: NCCL with one GPU a process")
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nccl_process_group(rule, dtype, tmp_path):
    """2 processes over NCCL, one GPU each, the Triton kernels at K = V = 128 (the widened rank's op 256 columns wide):
    the sharded call equals the unsharded op on the same GPU (bf16 within 1e-2, fp32 within 1e-5; o, final states,
    every gradient), both streams, with and without initial states; and without final states (rank 0 reads no map,
    its backward joins the reduce-scatter through the tie)."""
    cases = [Case(rule, lengths, h0, kernels="triton", reference="triton", dtype=dtype, T=NCCL_TOKENS, K=128, V=128,
                  chunk_size=64) for lengths in NCCL_STREAMS for h0 in (True, False)]
    cases.append(cases[-1]._replace(final=False))
    mp.spawn(_group_worker, args=(2, str(tmp_path / "store"), cases, "nccl", "cuda"), nprocs=2)


LAYERS = {"DeltaNet": dict(hidden_size=32, num_heads=2, mode="chunk"),
          "GatedDeltaNet": dict(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)}
# (tokens per rank, sequence lengths or None): short shards of 2 tokens (a convolution of 4 taps reads 3 tokens from
# the ranks before), and a packed stream with a sequence across all ranks and an empty one
LAYER_STREAMS = ((2, None), (8, (3, 20, 0, 9)))


def _gloo_layer_worker(rank, world, store):
    """One rank of a gloo group: each layer on its shard (cp_group) against the unsharded layer: the output, dx, and
    every parameter's gradient summed over the ranks."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for name, config in LAYERS.items():
            for T, lengths in LAYER_STREAMS:
                torch.manual_seed(0)
                layer = getattr(deltatron.layers, name)(**config)
                x = torch.randn(1 if lengths else 2, world * T, 32, requires_grad=True)
                weight = torch.randn(x.shape)
                cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
                params = list(layer.parameters())
                want = torch.autograd.grad((layer(x, cu_seqlens=cu) * weight).sum(), [x, *params])
                y = layer(shard(x, rank, world), cu_seqlens=cu, cp_group=dist.group.WORLD)
                check(f"rank {rank}, {name}, {T} tokens a rank, {lengths}: y", y,
                      shard(layer(x, cu_seqlens=cu), rank, world), FP32_BOUND)
                got = torch.autograd.grad((y * shard(weight, rank, world)).sum(), [x, *params])
                check(f"rank {rank}, {name}: dx", shard(got[0], rank, world), shard(want[0], rank, world), FP32_BOUND)
                for (pname, _), g, w in zip(layer.named_parameters(), got[1:], want[1:]):
                    dist.all_reduce(g)
                    check(f"rank {rank}, {name}, {T} tokens a rank, {lengths}: d{pname}", g, w, FP32_BOUND)
    finally:
        dist.destroy_process_group()


def test_gloo_layers(tmp_path):
    """DeltaNet and GatedDeltaNet over 4 gloo processes equal the unsharded layers (their convolutions exchange the
    tokens before each shard), forward and backward."""
    mp.spawn(_gloo_layer_worker, args=(4, str(tmp_path / "store")), nprocs=4)


def test_training_example():
    """examples/train_context_parallel.py under torchrun with 2 processes: its gradient check passes (the sharded
    model's summed gradients equal the unsharded model's) and it trains."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         os.path.join(root, "examples", "train_context_parallel.py"), "--steps", "2", "--eval-every", "1",
         "--seq-len", "16", "--num-kv", "2", "--batch-size", "4", "--check"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "largest relative RMS difference" in run.stdout and "step 2: loss" in run.stdout, run.stdout


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_refusals(one_rank_group):
    """cp_group: a ProcessGroup; no state pool or chunk states. (The stream's length in cu_seqlens: the gloo
    test.)"""
    with pytest.raises(TypeError, match="cp_group must be a torch.distributed ProcessGroup"):
        call("delta", make_stream("delta", 1, None, True, T=8)[0], cp_group=0)
    for option in (dict(output_chunk_states=True), dict(ssm_state_indices=torch.zeros(4, dtype=torch.int32)),
                   dict(inplace_final_state=True)):
        with pytest.raises(ValueError, match=f"{next(iter(option))} cannot be combined with cp_group"):
            call("gated", make_stream("gated", 1, None, True, T=8)[0], cp_group=one_rank_group, **option)


def test_layer_refusals(one_rank_group):
    """A layer's cp_group needs mode "chunk" and no cache."""
    x = torch.randn(1, 8, 32)
    with pytest.raises(ValueError, match="cp_group needs mode 'chunk' and no cache"):
        deltatron.layers.DeltaNet(**{**LAYERS["DeltaNet"], "mode": "fused_recurrent"})(x, cp_group=one_rank_group)
    with pytest.raises(ValueError, match="cp_group needs mode 'chunk' and no cache.*and a cache"):
        deltatron.layers.GatedDeltaNet(**LAYERS["GatedDeltaNet"], layer_idx=0)(
            x, cache=deltatron.layers.DeltaNetCache(), cp_group=one_rank_group)


def test_needs_initialized_distributed():
    inp, _, _ = make_stream("gated", 1, None, False, T=8)
    with pytest.raises(RuntimeError, match="cp_group needs torch.distributed initialized"):
        call("gated", inp, cp_group=object())


def test_state_v_first(one_rank_group):
    """The gated rule's state_v_first layout in and out of a context-parallel call (one rank: the plain op)."""
    inp, cu, _ = make_stream("gated", 1, (10, 0, 14), True, T=24)
    x = {n: t.detach() for n, t in inp.items()}
    o, final = call("gated", x, cu_seqlens=cu)
    flipped = {**x, "initial_state": x["initial_state"].transpose(-1, -2)}
    o_cp, final_cp = call("gated", flipped, cu_seqlens=cu, cp_group=one_rank_group, state_v_first=True)
    check("o", o_cp, o, FP32_BOUND)
    check("final state", final_cp.transpose(-1, -2), final, FP32_BOUND)
