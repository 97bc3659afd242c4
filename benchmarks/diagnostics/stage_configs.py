"""Each stage of the chunk pipeline at every warp count and pipelining depth: which launch is fastest, and
which ones give wrong results.

The chunk kernels launch with fixed configurations (4 warps, or 8 at K = 256 and in both fused walks at
K = 128; 2 stages, chosen for correctness, and 3 for the two WY kernels: kernels/utils.py, NOTES.md). This
forces num_warps in {2, 4, 8} and num_stages in {2, 3} on every Triton launch of one stage at a time
(stage_times.py's stages, the benchmark's bf16 inputs), compares the stage's outputs with those of the
shipped launch (relative RMS; a wrong configuration shows as a large error or an exception, not as a
speed-up) and times it. Prints per stage: the shipped time, the best right configuration and its time.

    python benchmarks/diagnostics/stage_configs.py [--config b8-t2048-h16-k128] [--stages wy ...] [--out FILE.json]
    python benchmarks/diagnostics/stage_configs.py --smoke     # CPU, interpreter, one configuration
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from isolated import forced_launch  # noqa: E402  (same folder: sys.path[0] when run as a script)
from stage_times import stage_calls, timer  # noqa: E402

from deltatron import bench  # noqa: E402

WARPS = (2, 4, 8)
STAGES = (2, 3)
WRONG = 1e-2  # relative RMS from the shipped launch's outputs beyond which a configuration is wrong


def tensors(result):
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for t in result if isinstance(t, torch.Tensor)]


def worst_difference(got, want) -> float:
    worst = 0.0
    for a, b in zip(tensors(got), tensors(want)):
        a, b = a.double(), b.double()
        if not torch.isfinite(a).all():
            return float("inf")
        worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-30)))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="b8-t2048-h16-k128")
    parser.add_argument("--stages", nargs="+", help="only the stages whose names contain one of these")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.smoke:
        cfg, device, choices = bench.SMOKE_CONFIGS[0], torch.device("cpu"), [(None, None)]
    else:
        cfg, device = {c.name: c for c in bench.CONFIGS}[args.config], torch.device("cuda")
        choices = list(itertools.product(WARPS, STAGES))
    measure = timer(args.smoke)
    stages, _, _ = stage_calls(cfg, device)
    report = {}
    for name, call in stages.items():
        if args.stages and not any(part in name for part in args.stages):
            continue
        shipped = call()
        rows = {"shipped": dict(ms=measure(call))}
        for warps, depth in choices:
            key = f"warps={warps} stages={depth}"
            try:
                with forced_launch(warps, depth):
                    error = worst_difference(call(), shipped)
                    ms = measure(call) if error <= WRONG else None
                rows[key] = dict(ms=ms, error=error)
            except Exception as e:  # out of shared memory, illegal access...: recorded, the sweep goes on
                rows[key] = dict(ms=None, error=None, exception=f"{type(e).__name__}: {str(e)[:80]}")
        right = {k: r for k, r in rows.items() if r["ms"] is not None and k != "shipped"}
        best = min(right, key=lambda k: right[k]["ms"]) if right else None
        report[name] = dict(rows=rows, best=best)
        best_text = f"{best} {right[best]['ms']:.3f} ms" if best else "none right"
        print(f"{name:<32} shipped {rows['shipped']['ms']:8.3f} ms   best {best_text}", flush=True)
        wrong = [k for k, r in rows.items() if k != "shipped" and r["ms"] is None]
        if wrong:
            print(f"{'':<32} wrong or failed: {', '.join(wrong)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(config=cfg.name, report=report), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
