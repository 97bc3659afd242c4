"""The gated decode step's launch configuration swept: the GPU time of one step at Qwen3-Next's layout (the benchmark's
qwen3next-decode-bB rows: Hk 16, Hv 32, K = V = 128, bf16 inputs, q and k L2-normalized in the kernel, the fp32
state updated in place) for every (V-block, warps) of the fused_recurrent forward, beside the plan's own choice
(fused_recurrent._launch_config) and the floor (one read and one write of the states at the measured copy rate).

Each time is benchmarks/timing.graph_time_ms: the step captured in a CUDA graph per input set and replayed, L2
flushed before each replay, so the host's launch cost is out of it. A configuration whose program would hold fewer
than 4 state elements a thread is skipped. The fixed cost beside them: one launch of a kernel that stores one
number, timed the same way (the least any one-launch step can read).

    python tools/decode_launch_sweep.py [--batches 1 8 64 256] [--v-first] [--out F.json]
    python tools/decode_launch_sweep.py --smoke   # CPU, interpreter, tiny sizes, eager wall clock

--v-first sweeps the step on [V, K] states (state_v_first, the benchmark's deltatron.fused_recurrent_gated_v_first
row: vLLM's pool layout, the kernel's V_FIRST tiles).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["DELTATRON_BACKEND"] = "triton"  # the kernel in the interpreter, not the PyTorch backend

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: deltatron and benchmarks

from benchmarks import configs, harness, timing  # noqa: E402
from deltatron.kernels import fused_recurrent  # noqa: E402

V_BLOCKS = (8, 16, 32, 64, 128)
WARPS = (1, 2, 4, 8)


@triton.jit
def store_one(x):
    tl.store(x, 1.0)


def fixed_cost_us(opts: timing.Options) -> float:
    x = torch.empty(1, device=opts.device)
    return 1e3 * timing.graph_time_ms(lambda _: store_one[(1,)](x), [{}], opts)


@contextmanager
def launch_config(choice):
    """fused_recurrent's forward launched with (V-block, warps) = choice; None: the plan's own."""
    planned = fused_recurrent._launch_config
    if choice is not None:
        fused_recurrent._launch_config = lambda *args: choice
    try:
        yield
    finally:
        fused_recurrent._launch_config = planned


def sweep(cfg: configs.Config, opts: timing.Options, tbps: float, choices, impl: str) -> dict:
    """{label: (step µs, % of floor)} for the plan's choice ("plan BV/warps") and each of choices, of the benchmark
    row impl."""
    sets = configs.input_sets(cfg, opts.device, opts.l2_bytes, timing.SMOKE_INPUT_SETS if opts.smoke else
                              configs.MAX_INPUT_SETS, gated=True)
    call = harness.resolve(impl, smoke=False)

    def step(x):
        with torch.no_grad():
            call(x)

    floor_us = 1e6 * configs.work(cfg, gated=True)["bytes_fwd"] / (tbps * 1e12)
    K = cfg.K
    planned = fused_recurrent._launch_config(cfg.V, K, cfg.B * cfg.H, fused_recurrent.FWD_TILE, opts.device,
                                             impl.endswith("_v_first"))
    out = {}
    for choice in [None, *choices]:
        with launch_config(choice):
            us = 1e3 * timing.graph_time_ms(step, sets, opts)
        label = "plan {}/{}".format(*planned) if choice is None else "{}/{}".format(*choice)
        out[label] = (us, 100 * floor_us / us)
    return dict(floor_us=floor_us, times=out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--out", type=Path, help="write the results as JSON")
    p.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny sizes, eager wall clock")
    p.add_argument("--v-first", action="store_true", help="the step on [V, K] states (state_v_first)")
    args = p.parse_args()
    impl = "deltatron.fused_recurrent_gated" + ("_v_first" if args.v_first else "")
    if args.smoke:
        opts = timing.Options("smoke", 0, 0, 0.0)
        cfgs = [configs.Config(f"decode-smoke-b{B}", B, 1, 2, 16, 16, decode=True, Hk=1) for B in (1, 2)]
        choices, tbps = [(8, 1), (16, 1)], configs.ANCHOR_TBPS
    else:
        opts = timing.Options("full", 10, 40, 0.0, device=torch.device("cuda"))
        cfgs = [configs.qwen3next_decode(B) for B in args.batches]
        choices = [(bv, w) for bv, w in itertools.product(V_BLOCKS, WARPS) if 128 * bv // (32 * w) >= 4]
        tbps = timing.copy_tbps(opts)
        torch.cuda.empty_cache()
    results = {"fixed_cost_us": fixed_cost_us(opts), "impl": impl}
    print(f"{impl}: copy rate {tbps:.2f} TB/s; one launch of a one-store kernel {results['fixed_cost_us']:.1f} µs; "
          f"step µs (% of floor) per V-block/warps")
    for cfg in cfgs:
        r = results[cfg.name] = sweep(cfg, opts, tbps, choices, impl)
        best = min(r["times"].items(), key=lambda kv: kv[1][0])
        print(f"{cfg.name}: floor {r['floor_us']:.1f} µs, best {best[0]} {best[1][0]:.1f} µs ({best[1][1]:.1f} %)")
        print("  " + "  ".join(f"{k} {us:.1f} ({pct:.0f})" for k, (us, pct) in r["times"].items()), flush=True)
        timing.free_memory(opts)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
