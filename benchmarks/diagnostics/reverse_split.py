"""The backward's reverse pass split along long sequences (kernels/chunk/reverse_split.py, backward.REVERSE_SPLIT): the
reverse pass alone and the whole forward+backward through the API with the switch False and True, the gradients
compared and the times interleaved.

Per config (the benchmark's bf16 inputs and dO): the plan True runs (seq_split.forced_partitions' count, or
--partitions), which kernel (Gluon or Triton) the unsplit pass, pass 1 and pass 2 run; dq, dk, dv, dbeta with True
against False (not bitwise: the walk on W and the combine round otherwise; within BOUND of each other); then, READINGS
rounds interleaved: the reverse pass alone (state_bwd.state_bwd against reverse_split.split_state_bwd on the
recomputed W, no dht, dh0 kept) and torch.autograd.grad through deltatron.chunk_delta_rule. False is the shipped
backward, which segments where its rule says (segmented_bwd.segmented_pays: b1-t32768-h16 on the H200), True never
segments; --unsegmented runs both without segments (SEGMENTED_BACKWARD = False), the split against the plain pass.

--smoke runs the flow on the CPU in the interpreter at tiny sizes (seq_split.SPLIT_MIN_TOKENS = 128: a packed batch
with two sequences split, and one where nothing is long enough, the same launches both ways).

    python benchmarks/diagnostics/reverse_split.py [--configs b1-t32768-h16-k128 ...] [--partitions P] [--unsegmented]
    python benchmarks/diagnostics/reverse_split.py --smoke
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
from switch_probe import (SETTINGS, api_fwd_bwd, gpu_configs, interleaved, rel, run_configs,  # noqa: E402
                          with_settings)

from deltatron import bench  # noqa: E402
from deltatron.kernels import chunk  # noqa: E402
from deltatron.kernels.chunk import reverse_split, seq_split, state_bwd, wy  # noqa: E402

backward = importlib.import_module("deltatron.kernels.chunk.backward")  # the package exports a function of that name

CONFIGS = ["b1-t32768-h16-k128", "b1-t32768-h64-k128"]
SMOKE_CONFIGS = [bench.Config("varlen3-t353-h1-k16", 1, 353, 1, 16, 16, seqlens=(200, 3, 150)),
                 bench.dense(2, 40, 1, 16)]
BOUND = 1e-2  # bf16's, DESIGN.md §6
C = 64


def kernel_of(x, w, info) -> str:
    return "Gluon" if state_bwd.gluon_reverse_pays(x["q"], x["k"], w, x["do"], None, info, C) else "Triton"


def compare(cfg: bench.Config, device: torch.device, measure, partitions, segmented) -> bool:
    """Prints the plan, the gradients' comparison and the readings; whether the gradients agree within BOUND."""
    x, fwd_bwd, info = api_fwd_bwd(cfg, device)
    scale = cfg.K ** -0.5
    q, k, do = (x[n].reshape(1, -1, *x[n].shape[2:]) for n in ("q", "k", "do"))  # packed, as the backward's
    v, beta = (x[n].reshape(1, -1, *x[n].shape[2:]) for n in ("v", "beta"))
    _, _, (tinv,), _ = chunk.forward(q, k, v, beta, scale, None, False, info, chunk_size=C)
    w, _ = wy.recompute_w_u(k, v, beta, tinv, info, C)
    plan = with_settings(seq_split, dict(SPLIT_PARTITIONS=partitions), lambda: reverse_split.plan_for(k, info, C))

    head = f"\n{cfg.name}: {info.num_seqs} x {cfg.H} sequences x heads, the unsplit pass {kernel_of(x, w, info)}"
    if plan is None:
        print(head + f"; no sequence of {seq_split.SPLIT_MIN_TOKENS} tokens: both settings run the same launches")
    else:
        P = len(plan.rows_parts)
        walk_w = f" beside the walk on W over {plan.walk_w.num_seqs} x {cfg.H}" if plan.walk_w is not None else ""
        print(head + f"; True: P = {P}, pass 1 reverse over {plan.walk_rev.num_seqs} x {cfg.H} "
              f"({kernel_of(x, w, plan.walk_rev)}){walk_w}, pass 2 over {plan.parts.num_seqs} x {cfg.H} "
              f"({kernel_of(x, w, plan.parts)}) sequences x heads (fillers included)")

    def switch(on, fn):
        settings = dict(REVERSE_SPLIT=on) if segmented else dict(REVERSE_SPLIT=on, SEGMENTED_BACKWARD=False)
        return with_settings(backward, settings, lambda: with_settings(
            seq_split, dict(SPLIT_PARTITIONS=partitions), fn))

    def reverse_pass():
        if backward.REVERSE_SPLIT and plan is not None:
            return reverse_split.split_state_bwd(q, k, w, do, None, scale, True, plan, C)
        return state_bwd.state_bwd(q, k, w, do, None, None, scale, True, info, C)

    passes = {s: switch(s, reverse_pass) for s in SETTINGS}
    grads = {s: switch(s, fwd_bwd) for s in SETTINGS}
    errs = [rel(a, b) for a, b in zip(grads[True], grads[False])]
    pass_errs = [rel(a, b) for a, b in zip(passes[True], passes[False])]
    agree = max(errs + pass_errs) <= BOUND
    print("  True against False, rel RMS: reverse pass " + ", ".join(
        f"{n} {e:.2e}" for n, e in zip(("dh", "dv", "dh0"), pass_errs)) + "; gradients " + ", ".join(
        f"d{n} {e:.2e}" for n, e in zip(bench.GRAD_INPUTS, errs)) + ("  OK" if agree else "  DIFFER"))
    interleaved(measure, switch, {"reverse pass": reverse_pass, "forward+backward": fwd_bwd}, "REVERSE_SPLIT")
    return agree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="bench.CONFIGS names")
    parser.add_argument("--partitions", type=int, default=None,
                        help="the count True forces (default: the forward's rule's, at least 3)")
    parser.add_argument("--unsegmented", action="store_true", help="both settings without the segmented backward")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny sizes: the flow runs")
    args = parser.parse_args()
    if args.smoke:
        device, configs = torch.device("cpu"), SMOKE_CONFIGS
        seq_split.SPLIT_MIN_TOKENS = 128
    else:
        device, configs = gpu_configs(args.configs)
    return run_configs(lambda cfg, device, measure: compare(cfg, device, measure, args.partitions,
                                                            not args.unsegmented), device, configs, args.smoke)


if __name__ == "__main__":
    sys.exit(main())
