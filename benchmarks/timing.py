"""The benchmark's timers: one call's median time, its host time, its peak memory, and the run's matmul and copy
ceilings.

On the GPU a time is triton's do_bench median (L2 flushed before every timed call) after SETTLE_S of
back-to-back calls; in smoke mode (CPU) it is a wall clock over SMOKE_REPS calls. A decode step is timed as a
replayed CUDA graph (graph_time_ms): its GPU work lasts microseconds, less than the host's launch cost, so an
eager call's events would time the host. The host's cost per call is timed apart (host_ms)."""
from __future__ import annotations

import gc
import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from benchmarks.configs import ANCHOR_TBPS, ANCHOR_TFLOPS, L2_BYTES, Peaks

SMOKE_REPS = 2
SMOKE_INPUT_SETS = 2

# Seconds of back-to-back calls before every GPU timing. After an idle spell (compiling, autotuning, another
# process starting) the first row timed ran slow, as if at lower clocks, and do_bench's 25 ms of warm-up did
# not cure it (H200: b8-t2048-h16-k128's forward read 0.378 ms as a run's first row against 0.275 ms once
# warm, fla's 0.733 against 0.520, the decode step 69.8 us against 44.2).
SETTLE_S = 0.3
HOST_CALLS = 20  # calls per host-time measurement


@dataclass
class Options:
    mode: str                 # "full", "quick" or "smoke"
    warmup_ms: int
    rep_ms: int
    budget_s: float
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    l2_bytes: int = L2_BYTES

    @property
    def smoke(self) -> bool:
        return self.mode == "smoke"


def sync(opts: Options) -> None:
    if not opts.smoke:
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], opts: Options) -> float:
    """Median time of fn in ms (fn already warm): triton's do_bench on the GPU (it flushes L2 before every
    timed call) after SETTLE_S of calls, a wall clock on the CPU in smoke mode."""
    if opts.smoke:
        times = []
        for _ in range(SMOKE_REPS):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)
    from triton.testing import do_bench

    settled = time.perf_counter() + SETTLE_S
    while time.perf_counter() < settled:
        fn()
        torch.cuda.synchronize()  # not queued far ahead: the loop ends SETTLE_S from now, not seconds later
    return do_bench(fn, warmup=opts.warmup_ms, rep=opts.rep_ms, return_mode="median")


def graph_time_ms(step: Callable[[dict], object], sets: Sequence[dict], opts: Options) -> float:
    """Median GPU time of step in ms: one CUDA graph per input set, captured after a warm-up call on a side stream
    (as torch.cuda.graphs asks), replayed in turn under time_ms. Smoke mode: time_ms of the eager calls."""
    if opts.smoke:
        return time_ms(cycling(sets, step), opts)
    graphs = []
    for x in sets:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(x)
        graphs.append(graph)
    replays = itertools.cycle(graphs)
    return time_ms(lambda: next(replays).replay(), opts)


def host_ms(fn: Callable[[], object], opts: Options, calls: int = HOST_CALLS) -> float:
    """The host's time of one call in ms: the wall time of `calls` back-to-back calls (fn already warm) started on
    an idle GPU, over `calls`. They queue far fewer launches than the launch queue holds, so the host waits on the
    GPU only where a call itself synchronizes; then this is the slower of the two."""
    sync(opts)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    sync(opts)
    return 1e3 * elapsed / calls


def peak_memory(fn: Callable[[], object], opts: Options) -> Optional[int]:
    """Bytes allocated by one call at its peak, above what was held before it (inputs included)."""
    if opts.smoke:
        return None
    gc.collect()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - held


def cycling(sets: Sequence[dict], step: Callable[[dict], object]) -> Callable[[], object]:
    it = itertools.cycle(sets)
    return lambda: step(next(it))


def measure_peaks(opts: Options) -> Peaks:
    """The ceilings of this run: a bf16 8192^3 matmul on random data, and a 1 GiB device-to-device copy
    (read + write bytes); the H200 anchors in smoke mode."""
    if opts.smoke:
        return Peaks(ANCHOR_TFLOPS, ANCHOR_TBPS, measured=False)
    tflops, tbps = matmul_tflops(opts), copy_tbps(opts)  # each frees its buffers on return
    torch.cuda.empty_cache()
    return Peaks(tflops, tbps, measured=True)


def matmul_tflops(opts: Options, n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device=opts.device, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    return 2 * n**3 / (time_ms(lambda: torch.mm(a, b, out=c), opts) * 1e-3) / 1e12


def copy_tbps(opts: Options, numel: int = 2**29) -> float:
    src = torch.randn(numel, device=opts.device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / (time_ms(lambda: dst.copy_(src), opts) * 1e-3) / 1e12


def free_memory(opts: Options) -> None:
    gc.collect()
    if not opts.smoke:
        torch.cuda.empty_cache()
