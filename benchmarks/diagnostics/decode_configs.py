"""The decode step's kernel at every V-block width and warp count: which launch streams the state fastest.

The benchmark's decode row (B=64, H=16, K=V=128, one token, fp32 state updated in place) took 82.7 µs on
the H200 where reading and writing the state once takes 32 µs (NOTES.md). Each program of the fused
recurrent kernel loads its [K, BV] slice of the state, updates it and stores it, with nothing to overlap the
load's latency but other resident programs; the V-block width BV and the warps per program set how many
programs (and bytes in flight) an SM holds. This times fused_recurrent's forward (no API) for each
(BV, num_warps), checks each against the shipped choice's result, and prints µs and the achieved fraction
of the copy-rate floor. Like the benchmark row, each timing cycles through several input sets (states of
67 MB, four L2s in all), so that no step finds the state written by the one before still in L2.

    python benchmarks/diagnostics/decode_configs.py [--out FILE.json]
    python benchmarks/diagnostics/decode_configs.py --smoke      # CPU, interpreter, tiny: does it run
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from stage_times import timer  # noqa: E402  (same folder: sys.path[0] when run as a script)

from deltatron import bench  # noqa: E402
from deltatron.kernels import fused_recurrent  # noqa: E402
from deltatron.kernels.utils import head_block, seq_info  # noqa: E402

COPY_TBPS = 4.25  # the copy ceiling measured by the benchmark run of 2026-11-29


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.smoke:
        cfg, device, widths, warps = bench.SMOKE_CONFIGS[2], torch.device("cpu"), (16,), (1,)
    else:
        cfg, device = bench.decode(64, 16, 128), torch.device("cuda")
        widths, warps = (16, 32, 64, 128), (1, 2, 4, 8)
    measure = timer(args.smoke)

    l2 = bench.L2_BYTES if args.smoke else torch.cuda.get_device_properties(device).L2_cache_size
    sets = bench.input_sets(cfg, device, l2, bench.SMOKE_INPUT_SETS if args.smoke else bench.MAX_INPUT_SETS)
    x = sets[0]
    info = seq_info(cfg.B, 1, device, None, None)
    scale = cfg.K ** -0.5

    def rel_rms(got, want):
        return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))

    def step(x, state):
        # needs_backward=False as the API's inference path: with it the kernel also writes the backward's
        # per-token errors and a state checkpoint (this script timed that until session 8: 58.6-59.3 us)
        return fused_recurrent.forward(x["q"], x["k"], x["v"], x["beta"], scale, state, True, info,
                                       needs_backward=False, inplace_final_state=True)

    reference = step(x, x["h"].clone())
    shipped = fused_recurrent._launch_config(cfg.V, head_block(cfg.K), cfg.B * cfg.H, fused_recurrent.FWD_TILE,
                                             device)
    floor_us = 8 * cfg.B * cfg.H * cfg.K * cfg.V / (COPY_TBPS * 1e12) * 1e6
    choose = fused_recurrent._launch_config
    results = []
    try:
        for bv in widths:
            for nw in warps:
                fused_recurrent._launch_config = lambda *a, bv=bv, nw=nw: (bv, nw)
                o, s = step(x, x["h"].clone())[:2]
                # another V-block or warp count reorders the sums over K: bf16 outputs may differ in their last
                # bit (exact equality flagged every variant on the H200), so compare as the tests do
                same = rel_rms(o, reference[0]) <= 1e-2 and rel_rms(s, reference[1]) <= 1e-5
                us = measure(bench.cycling(sets, lambda y: step(y, y["h"]))) * 1e3  # states updated in place
                results.append(dict(BV=bv, num_warps=nw, us=us, pct_floor=100 * floor_us / us, same=same,
                                    shipped=(bv, nw) == tuple(shipped)))
    finally:
        fused_recurrent._launch_config = choose
    print(f"decode B={cfg.B} H={cfg.H} K=V={cfg.K}, {len(sets)} input sets cycled; floor {floor_us:.1f} us at "
          f"{COPY_TBPS} TB/s")
    for r in sorted(results, key=lambda r: r["us"]):
        print(f"  BV={r['BV']:<4} warps={r['num_warps']:<2} {r['us']:8.1f} us  {r['pct_floor']:5.1f} % of floor"
              f"{'  (shipped)' if r['shipped'] else ''}{'' if r['same'] else '  RESULT DIFFERS'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(floor_us=floor_us, rows=results), f, indent=1)
    return 0 if all(r["same"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
