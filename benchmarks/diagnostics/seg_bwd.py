"""The segmented backward (kernels/chunk/segmented_bwd.py, backward.SEGMENTED_BACKWARD): the whole forward+backward
through the API with the switch False and True, their gradients compared and their times interleaved.

True cuts the batch into --segments segments (backward.FORCED_SEGMENTS) and, on CUDA, runs each later segment's grad
stage (dqkw + wy_bwd) on the side stream beside the reverse pass of the segment before it, state_fwd beside the
last segment's pass; False is the shipped backward (OVERLAP_STATE_PASSES as its rule says). Per config (the
benchmark's bf16 inputs and dO): the segments, whether the reverse pass is the Gluon kernel and what the rule
(None: segmented_bwd.segmented_pays) would choose; dq, dk, dv, dbeta with True against False, bitwise (the same
kernels on the same chunks; see segmented_bwd's docstring for where that may not hold) with the largest relative
difference where they differ; then torch.autograd.grad through deltatron.chunk_delta_rule timed with False and
True in turn, three readings each (stage_times' do_bench settings).

--smoke runs the flow on the CPU in the interpreter at tiny sizes (a one-sequence and a varlen batch of several
chunks), where the segments run in order on one stream (CPU tensors: no CUDA streams).

    python benchmarks/diagnostics/seg_bwd.py [--configs b1-t32768-h16-k128 ...] [--segments 2]
    python benchmarks/diagnostics/seg_bwd.py --smoke
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["DELTATRON_BACKEND"] = "triton"

import torch  # noqa: E402

# switch_probe: same folder (sys.path[0] when run as a script)
from switch_probe import (  # noqa: E402
    api_fwd_bwd, fwd_bwd_agree_and_time, gpu_configs, run_configs, with_settings)

from deltatron import bench  # noqa: E402
from deltatron.kernels.chunk import segmented_bwd, state_bwd  # noqa: E402

backward = importlib.import_module("deltatron.kernels.chunk.backward")  # the package exports a function of that name

CONFIGS = ["b1-t32768-h16-k128", "b1-t32768-h64-k128", "b2-t8192-h32-k128"]


def with_segments(on: bool, fn):
    """fn() with backward.SEGMENTED_BACKWARD set to on, restored after."""
    return with_settings(backward, dict(SEGMENTED_BACKWARD=on), fn)


def compare(cfg: bench.Config, device: torch.device, measure) -> bool:
    """Prints the config's segments, the gradients' comparison and the readings; whether the gradients agree."""
    x, fwd_bwd, info = api_fwd_bwd(cfg, device)
    plan = segmented_bwd.segment_plan(info, backward.FORCED_SEGMENTS, 64)
    rule = segmented_bwd.segmented_pays(info.num_seqs, cfg.H, info.total_tokens)
    gluon = state_bwd.gluon_reverse_pays(x["q"], x["k"], x["k"], x["do"], None, info, 64)  # w: k's shape and dtype
    streams = "two streams" if device.type == "cuda" else "one stream (CPU tensors)"
    segments = ("not segmented (fewer than 2 chunks)" if plan is None else
                f"{len(plan)} segments of {[s.t1 - s.t0 for s in plan]} tokens on {streams}")
    print(f"\n{cfg.name}: {info.num_seqs} x {cfg.H} sequences x heads, reverse pass {'Gluon' if gluon else 'Triton'}; "
          f"True: {segments}; the rule would choose {rule} segment{'s' if rule > 1 else ''}")
    return fwd_bwd_agree_and_time(measure, with_segments, fwd_bwd, "SEGMENTED_BACKWARD")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="bench.CONFIGS names")
    parser.add_argument("--segments", type=int, default=backward.FORCED_SEGMENTS, help="segments with True")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny sizes: the flow runs")
    args = parser.parse_args()
    backward.FORCED_SEGMENTS = args.segments
    if args.smoke:
        # one sequence of 3 chunks (C = 64), and 3 sequences of random lengths over 4 chunks
        device, configs = torch.device("cpu"), [bench.dense(1, 130, 1, 16), bench.varlen(200, 3, 1, 16, seed=0)]
    else:
        device, configs = gpu_configs(args.configs)
    return run_configs(compare, device, configs, args.smoke)


if __name__ == "__main__":
    sys.exit(main())
