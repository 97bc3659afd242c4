"""Where each implementation's GPU time goes, kernel by kernel: ours against fla and FlashQLA on the same inputs.

For each config (the benchmark's bf16 inputs) and implementation (by default deltatron.chunk, fla.chunk, flash_qla.g0;
--impls takes any of the benchmark's, e.g. deltatron.chunk_kda fla.chunk_kda, with their inputs; where installed and
applicable), the forward and the forward+backward run a few times to warm up, then CALLS times under
torch.profiler; every kernel's device time is summed over those calls and divided by CALLS. The table lists the
kernels by time, with launches a call, and the sum: the GPU work of one call, host time and gaps excluded
(at b8-t2048-h16 on the H200 it showed FlashQLA's forward as its kkt_solve, 0.060 ms, plus its walk, 0.112, against
our wy_kernel, 0.180, plus our Gluon walk, 0.099: the forward's gap to it is the WY stage).

    python tools/kernel_breakdown.py [--configs b8-t2048-h16-k128 ...] [--impls ...] [--out F.json]
    python tools/kernel_breakdown.py --smoke   # CPU, interpreter, tiny sizes: CPU ops, not kernels
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: deltatron and benchmarks

from benchmarks import configs, harness  # noqa: E402

IMPLS = ("deltatron.chunk", "fla.chunk", "flash_qla.g0")
PHASES = ("fwd", "fwdbwd")
TOP = 14  # kernels listed per call; the sum counts them all


def step(impl: str, call, x: dict, phase: str) -> None:
    o = call(x)
    if phase == "fwdbwd":
        o.backward(x["do"])
        for name in configs.grad_inputs(impl):
            x[name].grad = None


def breakdown(impl: str, call, x: dict, phase: str, calls: int, smoke: bool) -> dict:
    """{kernel name: [ms a call, launches a call]} over `calls` profiled calls, after warm-up."""
    for _ in range(2 if smoke else 5):
        step(impl, call, x, phase)
    cuda = not smoke
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            step(impl, call, x, phase)
        if cuda:
            torch.cuda.synchronize()
    device = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    total, count = collections.defaultdict(float), collections.Counter()
    for ev in prof.events():
        if ev.device_type == device:
            total[ev.name] += ev.device_time if cuda else ev.cpu_time
            count[ev.name] += 1
    return {name: [t / calls / 1e3, count[name] / calls] for name, t in total.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["b8-t2048-h16-k128", "b2-t8192-h32-k128"])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=configs.IMPLS)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--strong-kda-gate", action="store_true",
                   help="KDA rows with Qwen3-Next's per-head gate drawn per channel (down to -64 a token) instead of "
                        "Kimi Linear's: the per-channel stages' exact path")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    table = configs.SMOKE_CONFIGS if args.smoke else configs.CONFIGS
    known = {c.name: c for c in table}
    names = [next(iter(known))] if args.smoke else args.configs
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"unknown configs {unknown}; known: {', '.join(known)}")
    device = torch.device("cpu" if args.smoke else "cuda")
    results = {}
    for name in names:
        cfg = known[name]
        for impl in args.impls:
            if not configs.applies(impl, cfg):
                continue
            x = configs.make_inputs(cfg, device, seed=0, gated=impl in configs.GATED, per_channel=impl in configs.KDA)
            if impl in configs.KDA and args.strong_kda_gate:  # Qwen3-Next's per-head gate drawn per channel
                gen = torch.Generator(device=device).manual_seed(0)
                x["g"] = configs.gate(cfg.B, cfg.T, cfg.H * cfg.K, gen, device).view_as(x["g"]).requires_grad_()
            try:
                call = harness.resolve(impl, args.smoke)
            except harness.Unavailable as e:
                print(f"== {name} {impl}: {e}")
                continue
            for phase in PHASES:
                rows = breakdown(impl, call, x, phase, 1 if args.smoke else args.calls, args.smoke)
                results[f"{name} {impl} {phase}"] = rows
                print(f"== {name} {impl} {phase}: {sum(t for t, _ in rows.values()):.3f} ms a call"
                      f"{' (CPU ops)' if args.smoke else ''}")
                for kernel, (ms, launches) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:TOP]:
                    print(f"   {ms:8.4f} ms  x{launches:<4g} {kernel[:100]}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
