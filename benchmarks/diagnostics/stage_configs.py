"""Each stage of the chunk pipeline at every warp count, pipelining depth and (optionally) register cap:
which launch is fastest, and which ones give wrong results.

The chunk kernels launch with fixed configurations (4 warps, or 8 at K = 256 and in both fused walks at
K = 128; 2 stages, chosen for correctness, and 3 for the two WY kernels: kernels/utils.py, NOTES.md) and no
register cap but the WY forward's. This forces num_warps in {2, 4, 8} and num_stages in {2, 3} (or the ones given), each
uncapped and under every --maxnreg cap, on every Triton launch of one stage at a time (stage_times.py's
stages, the benchmark's bf16 inputs), compares the stage's outputs with those of the shipped launch
(relative RMS; a wrong configuration shows as a large error or an exception, not as a speed-up) and times
it. Prints per stage: the shipped time, the best right configuration and its time.

Without a cap ptxas takes 195-255 registers a thread in the WY forward and backward, dQ/dK/dW and the walks
with Q in them (sm_90, K = V = 128); a cap (maxnreg 168: 3 blocks of 4 warps an SM, 128: 4) trades spills
for blocks, which pays only where shared memory holds the extra blocks too. --offline compiles each
stage's launch for sm_90 under the same choices instead (no GPU; put triton 3.6, the H200's, first on
PYTHONPATH) and prints registers, spills, shared memory and the blocks an SM holds, to pick the caps worth
timing.

--tiles forces the head-dimension tile widths (BK, BW, BV) of the kernels that take them, beside the code's
own: meant for the stages whose kernels loop over K and V in tiles (the WY kernels, dQ/dK/dW), chosen with
--stages; in the state passes BK and BV are the state's blocks, and a forced one shows as wrong. A cap of 0
lifts the code's own cap (the WY forward's 168).

    python benchmarks/diagnostics/stage_configs.py [--config b8-t2048-h16-k128] [--stages wy ...]
        [--warps shipped 8] [--num-stages 2 3] [--maxnreg 168 128] [--tiles 32] [--offline] [--out FILE.json]
    python benchmarks/diagnostics/stage_configs.py --smoke     # CPU, interpreter, one configuration
                                                               # (the interpreter ignores caps)
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


def shipped_or_int(text: str):
    """A --warps / --num-stages value: a number, or "shipped" (None: each stage's own)."""
    return None if text == "shipped" else int(text)


def label(warps, depth, maxnreg, tile=None) -> str:
    shown = ["shipped" if x is None else x for x in (warps, depth)]
    return (f"warps={shown[0]} stages={shown[1]}" + ("" if maxnreg is None else f" maxnreg={maxnreg}")
            + ("" if tile is None else f" tile={tile}"))


def forced(warps, depth, maxnreg, tile=None):
    """forced_launch for one choice: tile forces the head-dimension tile widths (BK, BW, BV) of the
    kernels that take them."""
    return forced_launch(warps, depth, maxnreg, **({} if tile is None else dict(BK=tile, BW=tile, BV=tile)))


def selected(stages: dict, parts) -> dict:
    return {name: call for name, call in stages.items() if not parts or any(part in name for part in parts)}


def run_forced(call, shipped, forcing, measure):
    """(dict(ms, error), outputs) of call under forcing (a forced_launch), against the shipped launch's
    outputs: ms None where the outputs are wrong (relative RMS over WRONG); on an exception (out of shared
    memory, illegal access...) ms and error None, the exception recorded and outputs None, so a sweep goes on."""
    try:
        with forcing:
            got = call()
            error = worst_difference(got, shipped)
            ms = measure(call) if error <= WRONG else None
        return dict(ms=ms, error=error), got
    except Exception as e:
        return dict(ms=None, error=None, exception=f"{type(e).__name__}: {str(e)[:80]}"), None


def time_choices(cfg, parts, choices, device, measure) -> dict:
    """{stage: dict(rows={"shipped" or a choice's label: dict(ms, error)}, best=the fastest right label)}"""
    stages, _, _ = stage_calls(cfg, device)
    report = {}
    for name, call in selected(stages, parts).items():
        shipped = call()
        rows = {"shipped": dict(ms=measure(call))}
        for choice in choices:
            rows[label(*choice)], _ = run_forced(call, shipped, forced(*choice), measure)
        right = {k: r for k, r in rows.items() if r["ms"] is not None and k != "shipped"}
        best = min(right, key=lambda k: right[k]["ms"]) if right else None
        report[name] = dict(rows=rows, best=best)
        best_text = f"{best} {right[best]['ms']:.3f} ms" if best else "none right"
        print(f"{name:<32} shipped {rows['shipped']['ms']:8.3f} ms   best {best_text}", flush=True)
        wrong = [k for k, r in rows.items() if k != "shipped" and r["ms"] is None]
        if wrong:
            print(f"{'':<32} wrong or failed: {', '.join(wrong)}")
    return report


def compile_choices(cfg, parts, choices) -> dict:
    """{stage: {choice's label: [offline_compile's row of each launch]}}: compiled for sm_90 on CPU tensors,
    nothing run."""
    from offline_compile import OfflineLaunches, usage  # it refuses the interpreter: imported only here

    with OfflineLaunches(kernels=()):  # stage_calls' own launches, which prepare its inputs: nothing compiled
        stages, _, _ = stage_calls(cfg, torch.device("cpu"))
    report = {}
    for name, call in selected(stages, parts).items():
        report[name] = {}
        for choice in choices:
            with OfflineLaunches() as offline, forced(*choice):
                call()
            report[name][label(*choice)] = offline.rows
            for r in offline.rows:
                print(f"{name:<44} {label(*choice):<40} {r['kernel']:<18} {r.get('error') or usage(r)}", flush=True)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="b8-t2048-h16-k128")
    parser.add_argument("--stages", nargs="+", help="only the stages whose names contain one of these")
    parser.add_argument("--warps", type=shipped_or_int, nargs="+", default=WARPS, help='numbers or "shipped"')
    parser.add_argument("--num-stages", type=shipped_or_int, nargs="+", default=STAGES, help='numbers or "shipped"')
    parser.add_argument("--maxnreg", type=int, nargs="+", default=[],
                        help="register caps (0: none, even where the code sets one), each beside the code's own")
    parser.add_argument("--tiles", type=int, nargs="+", default=[],
                        help="head-dimension tile widths (BK, BW, BV where a kernel takes them), each beside the code's")
    parser.add_argument("--offline", action="store_true", help="compile for sm_90 instead of running")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    caps, tiles = [None, *args.maxnreg], [None, *args.tiles]
    if args.smoke:
        cfg, choices = bench.SMOKE_CONFIGS[0], [(None, None, cap, tile) for cap in caps for tile in tiles]
    else:
        cfg = {c.name: c for c in bench.CONFIGS}[args.config]
        choices = list(itertools.product(args.warps, args.num_stages, caps, tiles))
    if args.offline:
        report = compile_choices(cfg, args.stages, choices)
    else:
        device = torch.device("cpu" if args.smoke else "cuda")
        report = time_choices(cfg, args.stages, choices, device, timer(args.smoke))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(config=cfg.name, report=report), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
