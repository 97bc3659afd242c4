"""Where the host time of chunk_delta_rule's forward+backward goes, measured on a machine without a GPU.

The kernels are compiled for the H200 (sm_90) by triton 3.6 and "launched" through triton's real Python path
(JITFunction.run, or deltatron.kernels.launch's direct path) down to the generated C launcher, which is a no-op
here: a stand-in driver answers device 0, stream 0 and target sm_90, as in tests/kernels/test_launch.py. The
tensors are CPU tensors (the caching allocator is the CPU one; on the GPU each allocation goes to CUDA's). The
Gluon walk and reverse pass are taken where the H200 takes them (their applies are forced true, the SM count is
132), so the launches are the H200's: wy_kernel + gluon_walk_kernel forward; state_fwd_kernel (W, U on chip),
state_bwd_kernel, dqkw_kernel, wy_bwd_kernel and torch's dbeta cast backward, at 8 x 16 heads.

Rows (µs a call; the median and the minimum of --repeats runs of --calls back-to-back calls):
  host_time.py's rows: the public calls (forward under no_grad, forward with autograd's node, forward+backward
       through torch.autograd.grad), the backward alone (through autograd on a kept graph; chunk.backward called
       directly), stage_times.stage_calls' stages and their sums, autograd through a bare Function;
  stubbed form: the API rows with the form's forward and backward replaced by functions returning outputs made
       once (o freshly allocated): only the API, autograd.Function and DeltaRuleFunction's own Python remain;
  hand-off: chunk.backward handed to a waiting thread and waited for (a threading.Event each way), as
       torch.autograd.grad hands a backward on CUDA tensors to the device's autograd thread, which CPU tensors
       never do; to a thread on another core and on this one, and a no-op handed over.
Then host_time.py's split of the forward+backward by layer, and per forward+backward: the launches (the C
launcher's calls and the kernels that reached it through deltatron.kernels.launch), the torch calls
(TorchFunctionMode: what Python calls into torch; it does not see inside autograd's backward, so chunk.backward's
own calls are counted on their own) and the aten ops (TorchDispatchMode: what reaches a backend, a kernel or an
allocation on the GPU), Python's garbage collections, and with --profile cProfile's top functions.

    PYTHONPATH=/tmp/t36:$PWD python benchmarks/diagnostics/host_bwd_cpu.py [--profile]

(/tmp/t36: `pip install --target /tmp/t36 triton==3.6.0`; run without TRITON_INTERPRET). host_bwd_findings.md
beside this file reads its output."""
from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import sys
import threading

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("host_bwd_cpu.py launches compiled kernels through a stubbed launcher: run it without TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402

if not triton.__version__.startswith("3.6."):
    sys.exit(f"needs triton 3.6 (the H200's; launch.py's direct path is enabled there only), got {triton.__version__}"
             ": put a `pip install --target DIR triton==3.6.0` first on PYTHONPATH")

from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time import (BARE, BWD_FORM, BWD_GRAPH, FWD, FWDBWD, backward_calls, bare_round_trip,  # noqa: E402
                       host_runs, layer_split, print_profile, print_split, profile_calls)
from stage_times import api_calls, stage_calls, stage_sums  # noqa: E402  (sets DELTATRON_BACKEND=triton)
import offline_compile  # noqa: E402
from offline_compile import H200_SMS  # noqa: E402

from deltatron import backends, bench  # noqa: E402
from deltatron.kernels import chunk, fused_recurrent  # noqa: E402
from deltatron.kernels.chunk import gluon_reverse, gluon_walk, state, state_bwd  # noqa: E402
from deltatron.kernels.utils import seq_info  # noqa: E402

launcher_calls = [0]  # calls of the generated C launcher (stubbed)


def install_stand_in_driver() -> None:
    """offline_compile's stand-in H200 driver, the generated launcher's C `launch` counting its calls and
    fill_tma_descriptor a no-op. Kernels compile for sm_90 as usual."""
    def launch_stub(*args):
        launcher_calls[0] += 1

    offline_compile.install_stand_in_driver(launch_stub, lambda *args: None)


def take_the_h200_path() -> None:
    """CPU tensors down the Triton path the H200 takes at these shapes: the Triton backend (auto picks torch for
    CPU tensors), the Gluon kernels where they would apply on sm_90, 132 SMs for the launch decisions."""
    backends.select_backend = lambda q: "triton"
    state.gluon_walk_applies = lambda *a, **k: True
    state_bwd.gluon_reverse_applies = lambda *a, **k: True
    for module in (state_bwd, gluon_walk, gluon_reverse, fused_recurrent):
        module.num_sms = lambda device: H200_SMS


def per_call_us(fn, calls: int, repeats: int, warmup: int = 3):
    """(median, minimum) over `repeats` runs of the wall time of `calls` back-to-back calls of fn, µs a call."""
    runs = host_runs(fn, warmup, calls, repeats, lambda: None)
    return statistics.median(runs) * 1e6, min(runs) * 1e6


class StubForm:
    """A form (deltatron.autograd's contract) whose forward and backward return outputs made once: what is left
    of a call is the API, autograd and DeltaRuleFunction's Python around the form."""

    def __init__(self, x, info):
        q, k, v, beta = (x[n].detach() for n in ("q", "k", "v", "beta"))
        scale = q.shape[-1] ** -0.5
        _, _, self.saved, _ = chunk.forward(q, k, v, beta, scale, None, False, info, needs_backward=True)
        self.grads = chunk.backward(q, k, v, beta, scale, None, self.saved, x["do"], None, info)

    def forward(self, q, k, v, beta, scale, initial_state, output_final_state, info, needs_backward=True,
                chunk_size=64):
        return torch.empty_like(v), None, self.saved if needs_backward else (), ()

    def backward(self, q, k, v, beta, scale, initial_state, saved, do, dht, info, chunk_size=64):
        return self.grads


class HandOff:
    """Calls handed to a waiting thread and waited for (a threading.Event each way), as torch.autograd.grad hands
    a backward on CUDA tensors to the device's autograd thread and waits for it; the thread on core `cpu`."""

    def __init__(self, cpu: int):
        self.there, self.back, self.fn = threading.Event(), threading.Event(), None
        threading.Thread(target=self.serve, args=(cpu,), daemon=True).start()

    def serve(self, cpu: int):
        os.sched_setaffinity(0, {cpu})  # (0: the calling thread)
        while True:
            self.there.wait()
            self.there.clear()
            self.fn()
            self.back.set()

    def __call__(self, fn):
        self.fn = fn
        self.there.set()
        self.back.wait()
        self.back.clear()


class TorchCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


class AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def launched_kernels(fn) -> tuple:
    """(calls of the C launcher, {kernel: launches through deltatron.kernels.launch}) in one call of fn."""
    modules = [m for name, m in sys.modules.items() if name.startswith("deltatron.kernels.")
               and name != "deltatron.kernels.launch" and callable(getattr(m, "launch", None))]
    names, originals = collections.Counter(), {m: m.launch for m in modules}

    def recording(real):
        def launch(kernel, grid, *args, **kwargs):
            names[kernel.__name__] += 1
            return real(kernel, grid, *args, **kwargs)
        return launch

    for m in modules:
        m.launch = recording(originals[m])
    before = launcher_calls[0]
    try:
        fn()
    finally:
        for m, real in originals.items():
            m.launch = real
    return launcher_calls[0] - before, dict(names)


def collections_per_call(fn, calls: int) -> float:
    seen = [0]

    def count(phase, info):
        if phase == "start":
            seen[0] += 1

    gc.callbacks.append(count)
    try:
        for _ in range(calls):
            fn()
    finally:
        gc.callbacks.remove(count)
    return seen[0] / calls


def report(name: str, times) -> None:
    print(f"  {name:<58} {times[0]:8.1f} ({times[1]:6.1f})", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[8, 64, 16, 128], metavar=("B", "T", "H", "D"),
                        help="B, T, H and K = V (default 8 x 64 x 16 x 128: the benchmark's b8-t2048-h16-k128 "
                             "launches with small CPU allocations)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    install_stand_in_driver()
    take_the_h200_path()

    cpu = torch.device("cpu")
    B, T, H, D = args.shape
    cfg = bench.dense(B, T, H, D)
    stages, walk, x = stage_calls(cfg, cpu)
    rows = {**api_calls(x), **backward_calls(x, cfg, cpu), **stages, BARE.format("cpu"): bare_round_trip(cpu)}
    times = {}
    print(f"triton {triton.__version__}, torch {torch.__version__}, B={B} T={T} H={H} K=V={D} bf16, "
          f"{args.calls} calls x {args.repeats} repeats, µs a call: median (min)")
    for name, fn in rows.items():
        times[name] = per_call_us(fn, args.calls, args.repeats)
        report(name, times[name])
    for name, value in stage_sums({n: t[0] for n, t in times.items()}, walk).items():
        print(f"  {name:<58} {value:8.1f}")

    info = seq_info(B, T, cpu, None, None)
    stub, real_form = StubForm(x, info), backends.triton_form
    backends.triton_form = lambda name: stub
    try:
        stubbed = {n: fn for n, fn in api_calls(x).items() if n != FWD}
        stubbed[BWD_GRAPH] = backward_calls(x, cfg, cpu)[BWD_GRAPH]  # (its graph's forward through the stub)
        for name, fn in stubbed.items():
            report(f"stubbed form: {name}", per_call_us(fn, args.calls, args.repeats))
    finally:
        backends.triton_form = real_form

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        # this thread on one core; the hand-off to a thread on another core and to one on the same core
        os.sched_setaffinity(0, {cores[0]})
        other, same = HandOff(cores[1]), HandOff(cores[0])
        backward = rows[BWD_FORM]
        handed = {f"{BWD_FORM}, this thread (pinned)": backward,
                  "  handed to a thread on another core": lambda: other(backward),
                  "  handed to a thread on this core": lambda: same(backward),
                  "a no-op handed to a thread on another core": lambda: other(lambda: None),
                  "a no-op handed to a thread on this core": lambda: same(lambda: None)}
        try:
            for name, fn in handed.items():
                report(name, per_call_us(fn, args.calls, args.repeats))
        finally:
            os.sched_setaffinity(0, cores)

    fwdbwd = rows[FWDBWD]
    print()
    print_split(layer_split(fwdbwd, args, lambda: None, least=True), " (the least disturbed run)")
    for name in (FWD, FWDBWD):
        c_launches, through_launch = launched_kernels(rows[name])
        print(f"\n{name}: {c_launches} calls of the C launcher; through deltatron.kernels.launch: "
              + ", ".join(f"{n} x{c}" for n, c in sorted(through_launch.items())))
    for name in (FWDBWD, BWD_FORM, BWD_GRAPH):
        with TorchCalls() as calls_mode:
            rows[name]()
        with AtenOps() as ops_mode:
            rows[name]()
        print(f"\n{name}: {sum(calls_mode.calls.values())} torch calls from Python, "
              f"{sum(ops_mode.ops.values())} aten ops reaching a backend")
        print("  torch calls: " + ", ".join(f"{n} x{c}" for n, c in sorted(calls_mode.calls.items())))
        print("  aten ops:    " + ", ".join(f"{n} x{c}" for n, c in sorted(ops_mode.ops.items())))
    print(f"\ngarbage collections a forward+backward: {collections_per_call(fwdbwd, 200):.3f} (over 200 calls)")
    if args.profile:
        print_profile(profile_calls(fwdbwd, 200, lambda: None, top=30),
                      f"cProfile, {FWDBWD}, per call: the 30 functions of most own time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
