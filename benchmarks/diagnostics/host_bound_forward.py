"""Whether the benchmark's forward (no_grad, through the API) reads the GPU's time or the host's, and how the
host's time of the same call moves over a process's life.

do_bench (the benchmark's timer) brackets each call with events on the stream, so where one call costs the host
more than the GPU its reading is the host's time. Per configuration (NAME, or NAME:nosplit for the forward with
seq_split.SEQ_SPLIT = False), for the forward of deltatron.chunk on the benchmark's inputs:

    host     the wall time of N back-to-back calls with no synchronization among them, over N, in --windows
             windows (after warm-up calls and a synchronize): the lowest and highest window;
    gpu_q    the GPU's own time: N calls queued behind a GPU sleep long enough that the host has enqueued them all
             before the first starts ("pending" says the start event was still waiting when the last was queued);
    do_bench triton.testing.do_bench's median (L2 cleared before each call), as the benchmark times it;
    --profile  cProfile over N calls: the functions of the most own time and of the most cumulative time.

--history times the long single sequence's forward (b1-t32768-h16, where the sequence split runs) in one process
before and after other calls (a b8-t2048-h16 forward+backward timed by do_bench, as a benchmark row is), then
with the garbage collector disabled and frozen: host and do_bench per window, and the CUDA allocator's device
allocations during it (none: the host's time is not the allocator's).

    python benchmarks/diagnostics/host_bound_forward.py [--configs b1-t32768-h16-k128 b1-t32768-h16-k128:nosplit]
                                                        [--calls 50] [--windows 5] [--profile] [--history]
    python benchmarks/diagnostics/host_bound_forward.py --smoke     # CPU, interpreter, tiny sizes: does it run
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from deltatron import bench  # noqa: E402
from deltatron.kernels.chunk import seq_split  # noqa: E402

SLEEP_CYCLES_PER_S = 2e9  # torch.cuda._sleep counts SM cycles: at the H200's clock or below, at least this long
ALLOC_STATS = ("num_device_alloc", "num_device_free")


def forward_call(cfg, device):
    x = bench.make_inputs(cfg, device, seed=0)
    call = bench.resolve("deltatron.chunk", smoke=device.type == "cpu")

    def fwd():
        with torch.no_grad():
            call(x)
    return fwd, x, call


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def host_windows(fn, device, calls, windows):
    """ms a call on the host, per window of `calls` back-to-back calls."""
    for _ in range(3):
        fn()
    sync(device)
    out = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e3)
        sync(device)
    return out


def gpu_queued(fn, calls, host_ms):
    """ms a call of the GPU's own time (calls queued behind a sleep) and whether the sleep outlasted the queueing."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(SLEEP_CYCLES_PER_S * calls * host_ms * 2e-3))
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    pending = not start.query()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls, pending


def do_bench_ms(fn, device):
    if device.type != "cuda":
        return None
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def profile(fn, device, calls):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    sync(device)
    text = io.StringIO()
    stats = pstats.Stats(pr, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    return text.getvalue()


def configs_report(args, device, table):
    for arg in args.configs:
        name, _, option = arg.partition(":")
        seq_split.SEQ_SPLIT = False if option == "nosplit" else None
        fn, _, _ = forward_call(table[name], device)
        hosts = host_windows(fn, device, args.calls, args.windows)
        line = f"{arg}: host {min(hosts):.3f}-{max(hosts):.3f} ms a call"
        if device.type == "cuda":
            gpu_q, pending = gpu_queued(fn, args.calls, max(hosts))
            line += (f", gpu_q {gpu_q:.3f} (start pending at the last call: {pending}), "
                     f"do_bench {do_bench_ms(fn, device):.3f}")
        print(line, flush=True)
        if args.profile:
            print(profile(fn, device, args.calls))
    seq_split.SEQ_SPLIT = None


def history(args, device, table, long_name, other_name):
    fn, _, _ = forward_call(table[long_name], device)
    other = table[other_name]
    _, x_other, call = forward_call(other, device)

    def other_fwdbwd():
        o = call(x_other)
        torch.autograd.grad(o, [x_other[n] for n in bench.GRAD_INPUTS], x_other["do"])

    def window(tag):
        before = torch.cuda.memory_stats() if device.type == "cuda" else {}
        host = host_windows(fn, device, args.calls, 1)[0]
        after = torch.cuda.memory_stats() if device.type == "cuda" else {}
        allocs = {k: after.get(k, 0) - before.get(k, 0) for k in ALLOC_STATS}
        bench_ms = do_bench_ms(fn, device)
        timed = "" if bench_ms is None else f" do_bench {bench_ms:.3f}"
        print(f"{long_name} forward, {tag:32s} host {host:.3f}{timed} ms, allocations {allocs}, "
              f"gc objects {len(gc.get_objects())}", flush=True)

    window("first")
    if device.type == "cuda":
        do_bench_ms(other_fwdbwd, device)  # as the benchmark's row of that configuration times it
    else:
        other_fwdbwd()
    window(f"after {other_name} fwd+bwd")
    gc.disable()
    window("gc disabled")
    gc.enable()
    gc.collect()
    gc.freeze()
    window("gc frozen")
    gc.unfreeze()
    window("gc unfrozen")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["b1-t32768-h16-k128", "b1-t32768-h16-k128:nosplit"])
    parser.add_argument("--calls", type=int, default=50, help="back-to-back calls a window (N)")
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--history", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny sizes")
    args = parser.parse_args()
    if args.smoke:
        device = torch.device("cpu")
        table = {c.name: c for c in bench.SMOKE_CONFIGS if not c.decode}
        args.configs = [f"{name}{option}" for name in table for option in ("", ":nosplit")]
        args.calls, args.windows = 2, 2
        long_name = other_name = next(iter(table))
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device (use --smoke for the CPU check)")
        device = torch.device("cuda")
        table = {c.name: c for c in bench.CONFIGS if not c.decode}
        long_name, other_name = "b1-t32768-h16-k128", "b8-t2048-h16-k128"
    configs_report(args, device, table)
    if args.history:
        history(args, device, table, long_name, other_name)


if __name__ == "__main__":
    main()
