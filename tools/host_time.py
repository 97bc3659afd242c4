"""Where chunk_delta_rule's host time goes: each stage's time on the host against its time on the GPU.

At the benchmark's shapes the calls are nearly host-bound (H200, 8 x 16 heads, T = 2048: a forward costs the host
about 0.22 ms against 0.27 ms on the GPU, a forward+backward 0.8-1.2 ms against 1.2-1.4), so a GPU-side saving
shows only once the host keeps ahead. Per configuration, for each stage of stage_times.py's breakdown
(stage_calls: every launch of the chunk forward and backward on inputs prepared by the stages before it, the
"unfused:" alternatives the backward does not run among them) and the public API calls (stage_times.api_calls:
the forward under no_grad, the forward with autograd's node, the forward+backward through torch.autograd.grad):

    host    the wall time of N back-to-back calls with no synchronization among them, over N: what one call costs
            the CPU (Python, allocations, launches). After warm-up calls and a synchronize; N (20) calls queue a
            few hundred launches at most, far from filling the launch queue, so the host never waits on the GPU.
            The median of --repeats such runs.
    gpu     triton.testing.do_bench (L2 cleared before each call). Its events bracket each call on the stream, so
            where the host is the slower side they are as far apart as the host's launches: about max(host, GPU).
    gpu_q   the GPU's own time: N calls queued behind a GPU sleep (torch.cuda._sleep) long enough that the host has
            enqueued them all before the first starts, timed by events around them (so no host gap between
            launches; no L2 clearing either). The sleep is lengthened until the start event is still pending when
            the host has queued the last call.
    host_q  the host's time of one call while it enqueues those N calls behind the sleep: nothing in a call can
            wait there on the GPU's progress (the GPU has not started it), so host_q well under host says that
            something does in the back-to-back calls; about equal, that host is the host's own work.
    ratios  host / gpu and host / gpu_q: at 1 or more the call is host-bound.

The sums of the stages the forward and the backward run (stage_times.stage_sums) against the whole API call give
what the API, autograd and the dispatch add on the host. Rows that split it further:
    backward alone (autograd.grad on a kept graph)    the forward+backward less its forward: torch.autograd.grad
                                                      with retain_graph on the graph of one API forward;
    backward alone (chunk.backward, no autograd)      the chunk form's backward called directly (its stages and
                                                      its own Python; no API, no autograd);
    autograd.grad through a bare Function (cuda / cpu tensors)   autograd alone (host only): a Function with
                                                      DeltaRuleFunction's inputs and saved tensors and no deltatron
                                                      code;
    ... [autograd on the calling thread]              the forward+backward, the backward alone and the bare
                                                      Function again under torch.autograd.
                                                      set_multithreading_enabled(False). On CUDA tensors
                                                      torch.autograd.grad otherwise hands the backward to the
                                                      device's autograd thread and waits for it (on CPU tensors it
                                                      runs on the calling thread either way): each pair of rows
                                                      differs by that hand-off, and by our backward's Python running
                                                      on that thread.
And the whole forward+backward split by layer in one run (layer_split), with the backward on the autograd thread
and on the calling thread: N calls with the API forward, DeltaRuleFunction's forward and backward, the chunk form's
and each stage timed inside the call by wrappers; each layer's total and own time (less the layers inside it). The
root's own time is torch.autograd.grad's outside our backward (engine, hand-off, torch's Python); the stages'
times there against their rows above say whether our code runs slower inside the call than alone.

Gluon against Triton, where the plan can take the Hopper Gluon stages (sm_90, 16-bit, K = V = 128, C = 64): the
whole forward (no_grad) with the plan's hopper_walk forced True and False, and the whole forward+backward with
hopper_reverse forced True and False (plan.overrides). The Gluon launches build TMA descriptors on the host, which
is what these rows weigh against the GPU time they save.

Kernels per call: the device kernels (ours and torch's own copies and fills) of one forward and one
forward+backward, counted by torch.profiler's CUDA activity.

--profile: cProfile over N forward+backward calls through the API (after a warm-up call), the 25 functions of the
most own time (tottime), per call: which Python functions (ours, triton's JIT launch path, torch's autograd)
the host time goes to. cProfile's own cost per Python call inflates the Python-heavy entries (C functions such as
the launcher's are timed as one call each), so read it for the ranking, and host for the absolute time.

    python tools/host_time.py [--configs b8-t2048-h16-k128 ...] [--calls 20] [--profile] [--out FILE.json]
    python tools/host_time.py --smoke     # CPU, interpreter, tiny sizes: does it run

Times in µs per call (smoke: everything runs synchronously in Triton's interpreter, so host is the whole call,
gpu one wall-clock call, no gpu_q or host_q, no kernel count, and no Gluon rows: Gluon does not run in the
interpreter)."""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: deltatron and benchmarks
sys.path.insert(0, str(Path(__file__).resolve().parent))  # stage_times beside this file

import importlib  # noqa: E402

import deltatron  # noqa: E402
from benchmarks import configs as bench  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from deltatron.autograd import DeltaRuleFunction  # noqa: E402
from deltatron.kernels import chunk  # noqa: E402
from deltatron.kernels.chunk import plan, plan_call  # noqa: E402
from deltatron.kernels.utils import INTERPRET, seq_info  # noqa: E402

# the modules whose functions the layer split wraps: autograd calls the chunk package's forward and backward, which call their stages
# through the names these modules imported
chunk_forward = importlib.import_module("deltatron.kernels.chunk.forward")
chunk_backward = importlib.import_module("deltatron.kernels.chunk.backward")
from stage_times import api_calls, stage_calls, stage_sums, timer  # noqa: E402

C = 64
DEFAULT_CONFIGS = ["b8-t2048-h16-k128", "b4-t4096-h16-k128", "b2-t8192-h32-k128"]
TOP_FUNCTIONS = 25
# torch.cuda._sleep counts SM clock cycles; at the H200's top clock (1,980 MHz) or below, this many a second
# sleeps at least as long as asked
SLEEP_CYCLES_PER_S = 2e9

FWD = "whole forward (API, no_grad)"
FWDBWD = "whole forward+backward (API)"
BWD_GRAPH = "backward alone (autograd.grad on a kept graph)"
BWD_FORM = "backward alone (chunk.backward, no autograd)"
BARE = "autograd.grad through a bare Function ({} tensors)"
# rows and the split timed again under torch.autograd.set_multithreading_enabled(False): the backward on the calling
# thread, where on CUDA tensors it otherwise runs on the device's autograd thread, handed over and waited for
CALLING = "[autograd on the calling thread]"
WALK_STAGE = "fwd, fused walk: state pass + output"
REVERSE_STAGE = "bwd: reverse state pass + local dV' (fused)"
# (plan choice, the rows timed with it forced on and off: plan.overrides)
GLUON_SWITCHES = (("hopper_walk", (FWD,)), ("hopper_reverse", (FWDBWD,)))


def host_runs(fn, warmup: int, calls: int, repeats: int, sync) -> list:
    """The host's time of one call of fn in each of `repeats` runs, s: the wall time of `calls` back-to-back calls
    over `calls`, each run started with nothing pending on the GPU."""
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls)
    sync()
    return runs


def host_ms(fn, warmup: int, calls: int, repeats: int, sync) -> float:
    """The median of host_runs, ms."""
    return statistics.median(host_runs(fn, warmup, calls, repeats, sync)) * 1e3


def queued_gpu_ms(fn, calls: int, host_per_call_ms: float) -> tuple:
    """(the GPU's time of one call of fn, the host's), ms, with the GPU out of the host's way: `calls` calls
    enqueued while the GPU sleeps, the GPU's time between an event after the sleep and one after the last call, the
    host's the wall time of enqueueing them over `calls` (nothing the host does can wait on a GPU that has not yet
    started them, so where it is well under the host column, something in the call waits on the GPU's progress)."""
    cycles = int(2 * calls * host_per_call_ms * 1e-3 * SLEEP_CYCLES_PER_S)
    for _ in range(6):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - began) * 1e3 / calls
        end.record()
        ahead = not start.query()  # the GPU still asleep when the last call was queued: no gap between calls
        torch.cuda.synchronize()
        if ahead:
            return start.elapsed_time(end) / calls, host
        cycles *= 4
    raise RuntimeError("the host did not get ahead of the GPU even behind a sleep of "
                       f"{cycles / 4 / SLEEP_CYCLES_PER_S * 1e3:.0f} ms")


def measure_row(fn, args, gpu_ms, sync) -> dict:
    row = dict(host_ms=host_ms(fn, args.warmup, args.calls, args.repeats, sync), gpu_ms=gpu_ms(fn))
    if not args.smoke:
        row["gpu_queued_ms"], row["host_queued_ms"] = queued_gpu_ms(fn, args.calls, row["host_ms"])
    return row


def backward_calls(x: dict, cfg: bench.Config, device) -> dict:
    """{name: a call}: the backward alone through autograd, torch.autograd.grad on a graph kept from one forward
    through the API (retain_graph: the whole forward+backward less its forward), and as the chunk form's backward
    called directly on the forward's saved Tinv (no API, no autograd: its stages and its own Python)."""
    q, k, v, beta, do = (x[n].detach() for n in ("q", "k", "v", "beta", "do"))
    cu, cu_cpu = x.get("cu_seqlens"), x.get("cu_seqlens_cpu")
    kwargs = dict(cu_seqlens=cu, cu_seqlens_cpu=cu_cpu) if cu is not None else {}
    info = seq_info(cfg.B, cfg.T, device, cu, cu_cpu)
    scale = cfg.K ** -0.5
    grads_of = [x[n] for n in bench.GRAD_INPUTS]
    kept = deltatron.chunk_delta_rule(*grads_of, **kwargs)[0]
    _, _, saved, _ = chunk.forward(q, k, v, beta, scale, None, False, info, needs_backward=True)
    return {BWD_GRAPH: lambda: torch.autograd.grad(kept, grads_of, do, retain_graph=True),
            BWD_FORM: lambda: chunk.backward(q, k, v, beta, scale, None, saved, do, None, info)}


class BareFunction(torch.autograd.Function):
    """DeltaRuleFunction's autograd structure without deltatron's code: four inputs taking gradients, eight
    tensors saved (three of them None), one output; the backward returns gradients made once."""

    @staticmethod
    def forward(ctx, q, k, v, beta, tinv, grads):
        ctx.grads = grads
        ctx.save_for_backward(q, k, v, beta, None, None, None, tinv)
        return torch.empty_like(v)

    @staticmethod
    def backward(ctx, do):
        ctx.saved_tensors
        return (*ctx.grads, None, None)


def bare_round_trip(device):
    """A forward+backward through BareFunction on small tensors of a device: autograd's own cost of a call. On
    CUDA tensors torch.autograd.grad hands the backward to the device's autograd thread and waits for it (unless
    torch.autograd.set_multithreading_enabled(False)); on CPU tensors it runs it on the calling thread."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(1, 64, 2, 16, generator=gen, device=device) for _ in range(4))
    beta = torch.rand(1, 64, 2, generator=gen, device=device)
    tinv = torch.randn(1, 64, 2, 64, generator=gen, device=device)
    inputs = [t.requires_grad_() for t in (q, k, v, beta)]
    grads = tuple(torch.zeros_like(t) for t in inputs)
    return lambda: torch.autograd.grad(BareFunction.apply(*inputs, tinv, grads), inputs, do)


# One forward+backward through the API split by layer (layer_split): while it is timed, each (label, owner,
# attribute, parent) is replaced by a wrapper adding its wall time to its label. A layer's own time is its time less
# its children's. The root, the whole call (timed outside), holds the API forward and DeltaRuleFunction's
# backward: its own time is torch.autograd.grad's work outside our backward (torch's Python around it, the engine,
# on CUDA tensors the hand-off to the device's autograd thread and back, the graph's release).
WHOLE = "whole forward+backward (autograd.grad)"
API_FWD = "API forward (checks, Function.apply)"
LAYERS = (
    (API_FWD, deltatron, "chunk_delta_rule", WHOLE),
    ("DeltaRuleFunction.forward", DeltaRuleFunction, "forward", API_FWD),
    ("chunk.forward", chunk, "forward", "DeltaRuleFunction.forward"),
    ("fwd stage: wy_fwd", chunk_forward, "wy_fwd", "chunk.forward"),
    ("fwd stage: state_output_fwd", chunk_forward, "state_output_fwd", "chunk.forward"),
    ("fwd stage: state_fwd", chunk_forward, "state_fwd", "chunk.forward"),
    ("fwd stage: output_fwd", chunk_forward, "output_fwd", "chunk.forward"),
    ("DeltaRuleFunction.backward", DeltaRuleFunction, "backward", WHOLE),
    ("chunk.backward", chunk, "backward", "DeltaRuleFunction.backward"),
    ("bwd stage: state_wy_fwd", chunk_backward, "state_wy_fwd", "chunk.backward"),
    ("bwd stage: recompute_w_u", chunk_backward, "recompute_w_u", "chunk.backward"),
    ("bwd stage: state_fwd", chunk_backward, "state_fwd", "chunk.backward"),
    ("bwd stage: state_bwd", chunk_backward, "state_bwd", "chunk.backward"),
    ("bwd stage: dqkw", chunk_backward, "dqkw", "chunk.backward"),
    ("bwd stage: wy_bwd", chunk_backward, "wy_bwd", "chunk.backward"),
)


@contextlib.contextmanager
def timed_layers(totals: collections.Counter):
    """LAYERS' functions replaced by wrappers adding their wall time (s) to totals[label]; restored after."""
    def timed(fn, label):
        def wrapper(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - began
        return wrapper

    originals = []
    for label, owner, attribute, _ in LAYERS:
        original = vars(owner)[attribute]
        if isinstance(original, staticmethod):
            setattr(owner, attribute, staticmethod(timed(original.__func__, label)))
        else:
            setattr(owner, attribute, timed(original, label))
        originals.append((owner, attribute, original))
    try:
        yield
    finally:
        for owner, attribute, original in originals:
            setattr(owner, attribute, original)


def layer_split(fn, args, sync, least: bool = False) -> dict:
    """{layer: {total_us, own_us}} a call of fn (the whole forward+backward) with LAYERS timed inside it: of
    --repeats runs of `calls` back-to-back calls (after a warm-up call), the run of the median whole time, as the
    host column's (least: of the least, for a noisy machine); layers that did not run are left out. The wrappers
    add about 0.3 µs each to their parents."""
    runs = []
    totals = collections.Counter()
    with timed_layers(totals):
        fn()
        for _ in range(args.repeats):
            totals.clear()
            sync()
            began = time.perf_counter()
            for _ in range(args.calls):
                fn()
            totals[WHOLE] = time.perf_counter() - began
            sync()
            runs.append(dict(totals))
    run = sorted(runs, key=lambda r: r[WHOLE])[0 if least else len(runs) // 2]
    children = collections.Counter()
    for label, _, _, parent in LAYERS:
        children[parent] += run.get(label, 0)
    return {label: dict(total_us=run[label] / args.calls * 1e6,
                        own_us=(run[label] - children[label]) / args.calls * 1e6)
            for label in (WHOLE, *(layer[0] for layer in LAYERS)) if run.get(label)}


def print_split(split: dict, how: str) -> None:
    depth = {WHOLE: 0}
    for label, _, _, parent in LAYERS:
        depth[label] = depth[parent] + 1
    print(f"  {FWDBWD}{how} split by layer, µs a call (total, own: less the layers inside it)")
    for label, t in split.items():
        print(f"    {'  ' * depth[label] + label:<58} {t['total_us']:7.1f} {t['own_us']:7.1f}")


def gluon_applies(x: dict) -> dict:
    """{switch: None where its Gluon kernel applies to the benchmark's inputs x, else why not}."""
    if INTERPRET:
        reason = "Gluon does not run in Triton's interpreter (TRITON_INTERPRET=1)"
        return {switch: reason for switch, _ in GLUON_SWITCHES}
    q, k, v = (x[n].detach() for n in ("q", "k", "v"))
    info = seq_info(q.shape[0], q.shape[1], q.device, x.get("cu_seqlens"), x.get("cu_seqlens_cpu"))
    with plan.overrides(hopper_walk=True, hopper_reverse=True):
        chosen = plan_call(q, k, v, info, needs_backward=True)
    return {"hopper_walk": None if chosen.walk == "hopper" else f"does not apply:\n{plan.explain(chosen)}",
            "hopper_reverse": None if chosen.reverse == "hopper" else f"does not apply:\n{plan.explain(chosen)}"}


def device_kernels(fn) -> dict:
    """{device activity name: how many times it ran} in one call of fn (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    return dict(collections.Counter(e.name for e in prof.events()
                                    if e.device_type == torch.autograd.DeviceType.CUDA))


def profile_calls(fn, calls: int, sync, top: int = TOP_FUNCTIONS) -> list:
    """cProfile's `top` functions of most own time over `calls` calls of fn (after a warm-up call), each as
    {function, calls, tottime_us, cumtime_us}, per call of fn."""
    fn()
    sync()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    sync()
    stats = pstats.Stats(profiler).sort_stats("tottime")
    rows = []
    for path, line, name in stats.fcn_list[:top]:
        _, ncalls, tottime, cumtime, _ = stats.stats[(path, line, name)]
        where = f" ({'/'.join(Path(path).parts[-3:])}:{line})" if line else ""  # none for C functions
        rows.append(dict(function=name + where, calls=ncalls / calls, tottime_us=tottime / calls * 1e6,
                         cumtime_us=cumtime / calls * 1e6))
    return rows


def print_profile(rows: list, title: str) -> None:
    """profile_calls' rows under a title."""
    print(f"  {title}")
    print(f"    {'calls':>9} {'own us':>9} {'cum us':>9}  function")
    for e in rows:
        print(f"    {e['calls']:9.1f} {e['tottime_us']:9.1f} {e['cumtime_us']:9.1f}  {e['function']}")


def config_report(cfg: bench.Config, device, args) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gpu_ms = timer(args.smoke)
    cpu = torch.device("cpu")
    stages, walk, x = stage_calls(cfg, device)
    calls = {**stages, **api_calls(x), **backward_calls(x, cfg, device)}
    rows = {}
    for name, fn in calls.items():
        rows[name] = measure_row(fn, args, gpu_ms, sync)
        print(f"  {name:<58} {format_row(rows[name])}", flush=True)
    sums = {column: stage_sums({n: r[column] for n, r in rows.items()}, walk) for column in rows[FWD]}
    rows.update({name: {column: sums[column][name] for column in sums} for name in sums["host_ms"]})
    skipped, why_not = {}, gluon_applies(x)
    for switch, names in GLUON_SWITCHES:
        reason = why_not[switch]
        if reason:
            skipped[switch] = reason
            print(f"  {switch} rows skipped: {reason}")
            continue
        for value in (True, False):
            with plan.overrides(**{switch: value}):
                for name in names:
                    row = f"{name} [{switch}={value}]"
                    rows[row] = measure_row(calls[name], args, gpu_ms, sync)
                    print(f"  {row:<58} {format_row(rows[row])}", flush=True)
    with torch.autograd.set_multithreading_enabled(False):
        for name in (FWDBWD, BWD_GRAPH):
            row = f"{name} {CALLING}"
            rows[row] = measure_row(calls[name], args, gpu_ms, sync)
            print(f"  {row:<58} {format_row(rows[row])}", flush=True)
    # autograd alone, host only (no GPU work to time): on the device's tensors, on the calling thread too where
    # that differs (CUDA), and on CPU tensors
    bare = [(BARE.format(device.type), device, True)]
    if device.type != "cpu":
        bare += [(f"{BARE.format(device.type)} {CALLING}", device, False), (BARE.format("cpu"), cpu, True)]
    for row, where, threads in bare:
        with torch.autograd.set_multithreading_enabled(threads):
            rows[row] = dict(host_ms=host_ms(bare_round_trip(where), args.warmup, args.calls, args.repeats, sync))
        print(f"  {row:<58} {format_row(rows[row])}", flush=True)
    report = dict(walk=walk, rows=rows, gluon_skipped=skipped, split=layer_split(calls[FWDBWD], args, sync))
    print_split(report["split"], "")
    with torch.autograd.set_multithreading_enabled(False):
        report["split_calling_thread"] = layer_split(calls[FWDBWD], args, sync)
    print_split(report["split_calling_thread"], f" {CALLING}")
    if not args.smoke:
        report["kernels"] = {name: device_kernels(calls[name]) for name in (FWD, FWDBWD)}
        for name, kernels in report["kernels"].items():
            print(f"  device kernels in one {name}: {sum(kernels.values())}")
            for kernel, count in sorted(kernels.items()):
                print(f"    {count:3d} x {kernel}")
    if args.profile:
        report["profile"] = profile_calls(calls[FWDBWD], args.calls, sync)
        print_profile(report["profile"], f"cProfile, {FWDBWD}, {args.calls} calls: the {TOP_FUNCTIONS} functions of "
                                         "most own time, per call")
    return report


def format_row(row: dict) -> str:
    """host, host_q, gpu, gpu_q in µs and host / gpu, host / gpu_q ("-" where not measured)."""
    us = [row.get(k) for k in ("host_ms", "host_queued_ms", "gpu_ms", "gpu_queued_ms")]
    times = (f"{t * 1e3:9.1f}" if t is not None else f"{'-':>9}" for t in us)
    ratios = (f"{us[0] / t:9.2f}" if t else f"{'-':>9}" for t in us[2:])
    return " ".join(times) + " " + " ".join(ratios)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    chunk_configs = [c.name for c in bench.CONFIGS if not c.decode and c.Hk == c.H]  # the delta rule's
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=chunk_configs)
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls a host timing (N)")
    parser.add_argument("--repeats", type=int, default=5, help="host timings a row, of which the median")
    parser.add_argument("--warmup", type=int, default=3, help="calls before a row's host timings")
    parser.add_argument("--profile", action="store_true", help="cProfile over N forward+backward calls")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny sizes")
    parser.add_argument("--out", help="JSON of the times")
    args = parser.parse_args()
    if args.smoke:
        # every call runs for a while in the interpreter: as few as show that the flow works
        device, configs = torch.device("cpu"), [c for c in bench.SMOKE_CONFIGS if not c.decode and c.Hk == c.H]
        args.calls, args.repeats, args.warmup = 1, 1, 1
    else:
        device = torch.device("cuda")
        known = {c.name: c for c in bench.CONFIGS}
        configs = [known[n] for n in args.configs]
    header = f"  {'':<58} {'host':>9} {'host_q':>9} {'gpu':>9} {'gpu_q':>9} {'host/gpu':>9} {'host/gpu_q':>9}"
    results = dict(meta=dict(torch=torch.__version__, triton=triton.__version__, calls=args.calls,
                             repeats=args.repeats, mode="smoke" if args.smoke else "gpu",
                             device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"))
    for cfg in configs:
        print(f"\n{cfg.name} (µs a call)\n{header}", flush=True)
        results[cfg.name] = config_report(cfg, device, args)
    print(f"\nHost time against GPU time, µs a call ({args.calls} back-to-back calls; gpu: do_bench, gpu_q: "
          f"queued behind a sleep)")
    for cfg in configs:
        rows = results[cfg.name]["rows"]
        print(f"{cfg.name}\n{header}")
        for name, row in rows.items():
            if not name.startswith(("fwd", "bwd", "unfused")) or "[" in name:  # the calls, sums and Gluon rows
                print(f"  {name:<58} {format_row(row)}")
    if args.out:
        write_json(Path(args.out), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
