"""Context parallelism's scaling (DESIGN.md §13): chunk_gated_delta_rule on one stream (B = 1), on one GPU against
sharded over the processes (one GPU each, NCCL), forward and forward+backward.

    torchrun --nproc-per-node 2 benchmarks/context_parallel.py [--tokens 131072 524288] [--out cp.json]
    python benchmarks/context_parallel.py --world 2 --device cpu --tokens 64 --heads-k 1 --heads-v 2 --head-dim 16

The layer is Qwen3-Next's by default (Hk = 16 key heads, Hv = 32 value heads, K = V = 128, bf16): q and k
L2-normalized in the op, the gate g = -exp(A_log) softplus(a + dt_bias) made in the op from the projection a (A_log =
log(uniform(0, 16)) and dt_bias = 1, configs.gate's initialization), beta = sigmoid(b); no initial or final state.
For each T and mode: the unsharded op on rank 0's device alone (the other ranks wait at a barrier); each rank's local
pass alone (its shard through the rule's op, 2 V wide on a rank that the sequence enters: the sharded call's
kernels); the collectives alone on the summary's size (the all-gather of every rank's fp32 [1, Hv, K, V + K] map, and
the reduce-scatter of its backward); the sharded call. A time is the median of --reps calls after --warmup more (the
first call, which compiles, timed apart), each call between CUDA events and started on every rank together (a
barrier); a sharded time is its slowest rank's. Peak memory: torch.cuda.max_memory_allocated of each rank over one
measurement's calls, inputs included. speedup = the unsharded time / the sharded time. The table comes last; --out
writes every figure as JSON. An unsharded call that runs out of memory is recorded as such.

--device cpu runs gloo between CPU processes on the PyTorch backend: wall-clock times and no memory figures, the
code path alone (tests/benchmarks/test_context_parallel_bench.py)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):  # run as a script: the checkout's root on the path, as benchmarks/run.py does
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import Options, free_memory, sync  # noqa: E402
from deltatron import chunk_gated_delta_rule, context_parallel  # noqa: E402

MODES = ("fwd", "fwdbwd")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GIB = 2 ** 30


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """The options, checked; world: the number of processes (torchrun's, or --world's)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[131072, 524288],
                        help="stream lengths T (B = 1), each a multiple of the processes")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--heads-k", type=int, default=16)
    parser.add_argument("--heads-v", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128, help="K = V")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--world", type=int, help="spawn this many processes (without torchrun)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls after the first")
    parser.add_argument("--reps", type=int, default=5, help="timed calls (their median)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    a = parser.parse_args(argv)
    under_torchrun = "WORLD_SIZE" in os.environ
    if under_torchrun and a.world is not None:
        parser.error("--world spawns the processes itself: leave it out under torchrun")
    if not under_torchrun and a.world is None:
        parser.error("run under torchrun --nproc-per-node N, or give --world N")
    a.world = int(os.environ["WORLD_SIZE"]) if under_torchrun else a.world
    for name in ("world", "heads_k", "heads_v", "head_dim", "reps"):
        if getattr(a, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if a.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {a.warmup}")
    if a.heads_v % a.heads_k:
        parser.error(f"--heads-v {a.heads_v} must be a multiple of --heads-k {a.heads_k} (grouped value heads)")
    bad = [T for T in a.tokens if T < 1 or T % a.world]
    if bad:
        parser.error(f"--tokens {' '.join(map(str, bad))}: each must be a positive multiple of the {a.world} "
                     f"processes (rank r holds tokens [r T / world, (r + 1) T / world))")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", a.world))
    if a.device == "cuda" and torch.cuda.device_count() < local:
        parser.error(f"--device cuda needs {local} GPUs on this node, one a process; found "
                     f"{torch.cuda.device_count()} (--device cpu runs gloo between CPU processes)")
    return a


def make_inputs(T: int, a: argparse.Namespace, device: torch.device, seed: int) -> dict:
    """T tokens (B = 1) of the layer: q, k [1, T, Hk, K], v [1, T, Hv, V], the gate's projection a and beta
    [1, T, Hv] in the dtype, A_log and dt_bias [Hv] fp32: leaves that require grad."""
    gen = torch.Generator(device=device).manual_seed(seed)
    Hk, Hv, K, dt = a.heads_k, a.heads_v, a.head_dim, DTYPES[a.dtype]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dt)

    x = dict(q=randn(1, T, Hk, K), k=randn(1, T, Hk, K), v=randn(1, T, Hv, K), a=randn(1, T, Hv),
             beta=randn(1, T, Hv).sigmoid(),
             A_log=torch.rand(Hv, generator=gen, device=device).mul(16).log(), dt_bias=torch.ones(Hv, device=device))
    return {name: t.requires_grad_() for name, t in x.items()}


def layer_op(x: dict, v: Optional[torch.Tensor] = None, **options):
    """(o, final state) of chunk_gated_delta_rule on x as Qwen3-Next's layer calls it, with v in place of x's."""
    return chunk_gated_delta_rule(x["q"], x["k"], x["v"] if v is None else v, x["a"], x["beta"],
                                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=x["A_log"],
                                  dt_bias=x["dt_bias"], **options)


def call_of(mode: str, x: dict, outputs: Callable[[], List[torch.Tensor]]) -> Callable[[], None]:
    """One call of the mode: outputs() under no_grad, or outputs() and the gradients of every input of
    sum <out, weight> over the outputs (fixed random weights of their shapes, drawn after one call under no_grad)."""
    if mode == "fwd":
        return torch.no_grad()(outputs)
    with torch.no_grad():
        weights = [torch.randn_like(out) for out in outputs()]

    def fwdbwd():
        torch.autograd.grad(outputs(), list(x.values()), weights)
    return fwdbwd


def measure(fn: Callable[[], object], a: argparse.Namespace, opts: Options, group=None) -> dict:
    """ms: the median time of fn over a.reps calls after a.warmup, each started after a barrier of group (every
    rank's calls then meet in their collectives); first_call_s: the first call (compiling); peak_bytes: the device's
    peak memory over all of them."""
    cuda = not opts.smoke
    free_memory(opts)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    fn()
    sync(opts)
    first = time.perf_counter() - t0
    for _ in range(a.warmup):
        fn()
    times = []
    for _ in range(a.reps):
        if group is not None:
            dist.barrier(group)
        sync(opts)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return dict(ms=statistics.median(times), first_call_s=round(first, 3),
                peak_bytes=torch.cuda.max_memory_allocated() if cuda else None)


def rank_figures(T: int, a: argparse.Namespace, opts: Options, rank: int, group) -> dict:
    """This rank's figures for T: per mode, "single" (rank 0: the unsharded op; its "error" where it ran out of
    memory), "local" (the local pass), "sharded" (the call); "allgather" and "reduce_scatter" (the collectives)."""
    world, K, device = a.world, a.head_dim, opts.device
    out = {mode: {} for mode in a.modes}
    if rank == 0:
        for mode in a.modes:
            try:
                x = make_inputs(T, a, device, seed=0)
                out[mode]["single"] = measure(call_of(mode, x, lambda: [layer_op(x)[0]]), a, opts)
            except torch.cuda.OutOfMemoryError as e:
                out[mode]["single"] = dict(error=f"out of memory: {str(e).splitlines()[0]}"[:300])
            x = None
            free_memory(opts)
    dist.barrier(group)
    x = make_inputs(T // world, a, device, seed=1 + rank)
    summary = torch.randn(1, a.heads_v, K, 2 * K, device=device)  # one sequence's map [S_loc | M], fp32
    gathered = summary.new_empty(world, *summary.shape[1:])
    figures = dict(
        allgather=measure(lambda: context_parallel._all_gather_single(gathered, summary, group=group), a, opts, group),
        reduce_scatter=measure(lambda: context_parallel._reduce_scatter_single(summary, gathered, group=group), a,
                               opts, group))
    layout = context_parallel.shard_layout(rank, world, 1, T // world, None, False)

    def local_pass():
        def op(v, h0, cu, cu_cpu):
            return layer_op(x, v, initial_state=h0, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
        return list(context_parallel.local_pass(op, x["v"], K, None, layout))

    for mode in a.modes:
        out[mode]["local"] = measure(call_of(mode, x, local_pass), a, opts, group)
        out[mode]["sharded"] = measure(call_of(mode, x, lambda: [layer_op(x, cp_group=group)[0]]), a, opts, group)
    return dict(out, **figures)


def rows_of(T: int, ranks: List[dict], a: argparse.Namespace) -> List[dict]:
    """The table's rows for T from every rank's figures: a sharded time is the slowest rank's; collective_ms the
    all-gather's, plus the reduce-scatter's with the backward."""
    rows = []
    for mode in a.modes:
        single = ranks[0][mode]["single"]
        per_rank = {part: [r[mode][part] for r in ranks] for part in ("local", "sharded")}
        gather = max(r["allgather"]["ms"] for r in ranks)
        scatter = max(r["reduce_scatter"]["ms"] for r in ranks)
        sharded_ms = max(f["ms"] for f in per_rank["sharded"])
        rows.append(dict(
            T=T, mode=mode, single_ms=single.get("ms"), single_error=single.get("error"),
            single_first_call_s=single.get("first_call_s"), single_peak_bytes=single.get("peak_bytes"),
            sharded_ms=sharded_ms, speedup=single["ms"] / sharded_ms if "ms" in single else None,
            local_ms=max(f["ms"] for f in per_rank["local"]),
            allgather_ms=gather, reduce_scatter_ms=scatter if mode == "fwdbwd" else None,
            collective_ms=gather + (scatter if mode == "fwdbwd" else 0.0),
            **{f"{part}_{key}_per_rank": [f[key] for f in figures] for part, figures in per_rank.items()
               for key in ("ms", "first_call_s", "peak_bytes")}))
    return rows


def table(rows: List[dict], world: int) -> str:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    def gib(x):
        return "-" if x is None else f"{x / GIB:.2f}"

    head = (f"{'T':>8} {'mode':>6} {'1 rank ms':>10} {f'{world} ranks ms':>11} {'speedup':>7} {'local ms':>9} "
            f"{'coll. ms':>8} {'peak GiB 1':>10}  peak GiB per rank")
    lines = [head]
    for r in rows:
        single = num(r["single_ms"], ".3f") if r["single_error"] is None else "OOM"
        peaks = " / ".join(gib(p) for p in r["sharded_peak_bytes_per_rank"])
        lines.append(f"{r['T']:>8} {r['mode']:>6} {single:>10} {r['sharded_ms']:>11.3f} {num(r['speedup'], '.2f'):>7} "
                     f"{r['local_ms']:>9.3f} {r['collective_ms']:>8.3f} {gib(r['single_peak_bytes']):>10}  {peaks}")
    return "\n".join(lines)


def run_rank(rank: int, a: argparse.Namespace, init_method: str, local_rank: int) -> None:
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=a.world)
    group = dist.group.WORLD
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    opts = Options("full" if cuda else "smoke", 0, 0, 0.0, device)
    try:
        mine = [rank_figures(T, a, opts, rank, group) for T in a.tokens]
        everyone = [None] * a.world
        dist.all_gather_object(everyone, mine, group=group)
        if rank == 0:
            rows = [row for i, T in enumerate(a.tokens) for row in rows_of(T, [r[i] for r in everyone], a)]
            if a.out is not None:
                a.out.parent.mkdir(parents=True, exist_ok=True)
                a.out.write_text(json.dumps(dict(
                    command=" ".join(sys.argv), world=a.world, device=torch.cuda.get_device_name() if cuda else "cpu",
                    torch=torch.__version__, dtype=a.dtype, Hk=a.heads_k, Hv=a.heads_v, K=a.head_dim, V=a.head_dim,
                    warmup=a.warmup, reps=a.reps, rows=rows), indent=1))
            print(f"chunk_gated_delta_rule, B = 1, Hk {a.heads_k}, Hv {a.heads_v}, K = V = {a.head_dim}, {a.dtype}, "
                  f"{a.world} ranks ({'NCCL' if cuda else 'gloo, CPU'}); local: the local pass alone (slowest rank); "
                  f"coll.: the all-gather (+ the reduce-scatter with the backward)")
            print(table(rows, a.world), flush=True)
        dist.barrier(group)  # no rank tears the group down while another still reads from it
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, a: argparse.Namespace, init_method: str) -> None:
    run_rank(rank, a, init_method, rank)


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse(argv)
    if "WORLD_SIZE" in os.environ:  # torchrun
        run_rank(int(os.environ["RANK"]), a, "env://", int(os.environ.get("LOCAL_RANK", 0)))
        return 0
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_spawned, args=(a, f"file://{folder}/store"), nprocs=a.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
