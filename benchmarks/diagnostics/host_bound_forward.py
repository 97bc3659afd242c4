"""Whether the benchmark's forward (no_grad, through the API) reads the GPU's time or the host's, and how the
host's time of the same call moves over a process's life.

do_bench (the benchmark's timer) brackets each call with events on the stream, so where one call costs the host
more than the GPU its reading is the host's time. Per configuration (NAME, or NAME:nosplit for the forward with
seq_split.SEQ_SPLIT = False), for the forward of deltatron.chunk on the benchmark's inputs:

    host     the wall time of N back-to-back calls with no synchronization among them, over N, in --windows
             windows (after warm-up calls and a synchronize): the lowest and highest window;
    gpu_q    the GPU's own time: N calls queued behind a GPU sleep long enough that the host has enqueued them all
             before the first starts;
    do_bench the benchmark's timer (bench.time_ms: do_bench's median, L2 cleared before each call);
    --profile  cProfile over N calls: the functions of the most own time (host_time.py's profile_calls).
The host and GPU timers are host_time.py's (host_runs, queued_gpu_ms).

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
import contextlib
import gc
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from deltatron import bench  # noqa: E402
from deltatron.kernels.chunk import seq_split  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time import forced, host_runs, print_profile, profile_calls, queued_gpu_ms  # noqa: E402

WARMUP = 3
ALLOC_STATS = ("num_device_alloc", "num_device_free")


def forward_call(cfg, device):
    """(the no_grad forward of deltatron.chunk on cfg's benchmark inputs, the inputs, the API call)."""
    x = bench.make_inputs(cfg, device, seed=0)
    call = bench.resolve("deltatron.chunk", smoke=device.type == "cpu")

    def fwd():
        with torch.no_grad():
            call(x)
    return fwd, x, call


def host_windows_ms(fn, sync, calls, windows):
    return [t * 1e3 for t in host_runs(fn, WARMUP, calls, windows, sync)]


def configs_report(args, device, sync, bench_ms):
    table = {c.name: c for c in (bench.SMOKE_CONFIGS if args.smoke else bench.CONFIGS) if not c.decode}
    for arg in args.configs:
        name, _, option = arg.partition(":")
        with forced(seq_split, "SEQ_SPLIT", False) if option == "nosplit" else contextlib.nullcontext():
            config_report(arg, table[name], args, device, sync, bench_ms)


def config_report(arg, cfg, args, device, sync, bench_ms):
    fn, _, _ = forward_call(cfg, device)
    hosts = host_windows_ms(fn, sync, args.calls, args.windows)
    line = f"{arg}: host {min(hosts):.3f}-{max(hosts):.3f} ms a call"
    if device.type == "cuda":
        gpu_q, _ = queued_gpu_ms(fn, args.calls, max(hosts))
        line += f", gpu_q {gpu_q:.3f}, do_bench {bench_ms(fn):.3f}"
    print(line, flush=True)
    if args.profile:
        print_profile(profile_calls(fn, args.calls, sync), f"{arg}: cProfile, per call")


def history(args, device, sync, bench_ms, long_cfg, other_cfg):
    fn, _, _ = forward_call(long_cfg, device)
    _, x_other, call = forward_call(other_cfg, device)

    def other_fwdbwd():
        o = call(x_other)
        torch.autograd.grad(o, [x_other[n] for n in bench.GRAD_INPUTS], x_other["do"])

    def window(tag):
        before = torch.cuda.memory_stats() if device.type == "cuda" else {}
        host = host_windows_ms(fn, sync, args.calls, 1)[0]
        after = torch.cuda.memory_stats() if device.type == "cuda" else {}
        allocs = {k: after.get(k, 0) - before.get(k, 0) for k in ALLOC_STATS}
        print(f"{long_cfg.name} forward, {tag:32s} host {host:.3f} ms, do_bench {bench_ms(fn):.3f} ms, "
              f"allocations {allocs}, gc objects {len(gc.get_objects())}", flush=True)

    window("first")
    bench_ms(other_fwdbwd)  # as the benchmark's row of that configuration times it
    window(f"after {other_cfg.name} fwd+bwd")
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
        chunk_configs = [c for c in bench.SMOKE_CONFIGS if not c.decode]
        args.configs = [f"{c.name}{option}" for c in chunk_configs for option in ("", ":nosplit")]
        args.calls, args.windows = 2, 2
        long_cfg = other_cfg = chunk_configs[0]
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device (use --smoke for the CPU check)")
        device = torch.device("cuda")
        table = {c.name: c for c in bench.CONFIGS}
        long_cfg, other_cfg = table["b1-t32768-h16-k128"], table["b8-t2048-h16-k128"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    opts = bench.Options(mode="smoke" if args.smoke else "full", warmup_ms=25, rep_ms=100, budget_s=0, device=device)

    def bench_ms(fn):  # the benchmark's timer (do_bench's median after settling; a wall clock in smoke mode)
        return bench.time_ms(fn, opts)
    configs_report(args, device, sync, bench_ms)
    if args.history:
        history(args, device, sync, bench_ms, long_cfg, other_cfg)


if __name__ == "__main__":
    main()
