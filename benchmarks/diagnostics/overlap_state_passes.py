"""The backward's recompute state pass overlapped with its reverse state pass on two CUDA streams
(kernels/chunk/backward.py, OVERLAP_STATE_PASSES): the whole forward+backward through the API with the switch
False and True, their gradients compared and their times interleaved.

Where the backward's recompute takes two launches (state.wy_on_chip False: wy.recompute_w_u, then
state.state_fwd), True runs state_fwd on a side stream beside the reverse pass; where it takes one (W, U on
chip) both settings run the same launches on one stream: a control for the noise. Per config (the benchmark's
bf16 inputs and dO): which recompute runs, whether the overlap is taken and what the rule (None:
backward.overlap_pays, a prediction) would choose; dq, dk, dv, dbeta with True against False, bitwise (the
same kernels on the same inputs); then torch.autograd.grad through deltatron.chunk_delta_rule timed with False
and True in turn, three readings each (stage_times' do_bench settings).

--smoke runs the flow on the CPU in the interpreter at tiny sizes (a one-launch and a two-launch recompute),
where the overlap cannot apply (CPU tensors: no CUDA streams), so both settings run one stream there.

    python benchmarks/diagnostics/overlap_state_passes.py [--configs b1-t32768-h16-k128 ...]
    python benchmarks/diagnostics/overlap_state_passes.py --smoke
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
from deltatron.kernels.chunk import state  # noqa: E402

backward = importlib.import_module("deltatron.kernels.chunk.backward")  # the package exports a function of that name

CONFIGS = ["b1-t32768-h16-k128", "b1-t32768-h64-k128", "varlen20-t32768-h16-k128", "b2-t8192-h32-k128"]


def with_overlap(overlap: bool, fn):
    """fn() with backward.OVERLAP_STATE_PASSES set to overlap, restored after."""
    return with_settings(backward, dict(OVERLAP_STATE_PASSES=overlap), fn)


def compare(cfg: bench.Config, device: torch.device, measure) -> bool:
    """Prints the config's path, the gradients' comparison and the readings; whether the gradients agree."""
    x, fwd_bwd, info = api_fwd_bwd(cfg, device)
    if state.wy_on_chip(cfg.K, cfg.V, info.num_seqs * cfg.H, x["k"].element_size()):
        path = "the recompute in one launch (W, U on chip): the overlap does not apply"
    elif with_overlap(True, lambda: backward.overlaps(x["k"], info)):
        rule = backward.overlap_pays(info.num_seqs, cfg.H, info.total_tokens)
        path = f"the recompute in two launches: True overlaps the passes (the rule would {'' if rule else 'not '}do so)"
    else:
        path = "the recompute in two launches; the overlap cannot apply here (CPU tensors: no CUDA streams)"
    print(f"\n{cfg.name}: {info.num_seqs} x {cfg.H} sequences x heads, {path}")
    return fwd_bwd_agree_and_time(measure, with_overlap, fwd_bwd, "OVERLAP_STATE_PASSES")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="bench.CONFIGS names")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny sizes: the flow runs")
    args = parser.parse_args()
    if args.smoke:
        # a varlen batch whose recompute is one launch (K = 16), a head size where it is two (K = 100)
        device, configs = torch.device("cpu"), [bench.SMOKE_CONFIGS[1], bench.dense(1, 40, 1, 100)]
    else:
        device, configs = gpu_configs(args.configs)
    return run_configs(compare, device, configs, args.smoke)


if __name__ == "__main__":
    sys.exit(main())
