"""Two plans of chunk_delta_rule (or, with --gated, chunk_gated_delta_rule; with --kda, chunk_kda) against each
other: time and agreement of the forward and the forward+backward.

For each benchmark configuration, the API call on the benchmark's bf16 inputs runs under plan A's and plan B's
overrides (deltatron.kernels.chunk.plan.overrides; an empty side is the shipped plan): first the outputs o and the
gradients dq, dk, dv, dbeta (and dg) of both are compared (bitwise, or within --bound of B's relative norm), then the
forward (no_grad) and the forward+backward are timed, the readings of A and B interleaved --readings times (against
drift), and a short table prints each phase's fastest reading of A and B and their ratio. With --explain, each side's
plan as chunk.plan.explain words it. The exit status is 1 where a configuration's results disagree.

    python tools/plan_ab.py --a split_partitions=1 --b split_partitions=4 --configs b1-t32768-h16-k128
    python tools/plan_ab.py --a hopper_walk=0 --b "" --bound 1e-2 --configs b8-t2048-h16-k128
    python tools/plan_ab.py --smoke --a keep_states=0 --b keep_states=1    # CPU, interpreter, tiny sizes
    python tools/plan_ab.py --gated --a wy_maxnreg=168 --b wy_maxnreg=0 --configs qwen3next-b8-t4096
    python tools/plan_ab.py --kda --a fused_output=1,local_dv_apart=0 --b "" --bound 1e-2

Overrides are name=value pairs separated by commas: hopper_walk, residual, keep_states, overlap, hopper_reverse,
fused_output, local_dv_apart (0/1, true/false), split_partitions, split_min_tokens, segments, wy_maxnreg,
wy_bwd_maxnreg, dqkw_warps, walk_block_v, reverse_block_v (integers), or none for the rule's own choice. --gated runs the benchmark's gated rows'
call: its gate g (Qwen3-Next's), q and k L2-normalized in the op, gradients to g too; --kda the KDA rows' call (a
gate per key channel), likewise. Times: triton's do_bench medians in ms (L2 flushed per call); smoke: one
wall-clock call."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["DELTATRON_BACKEND"] = "triton"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: deltatron and benchmarks

import torch  # noqa: E402

import deltatron  # noqa: E402
from benchmarks import configs, harness  # noqa: E402
from deltatron.kernels.chunk import plan, plan_call  # noqa: E402
from deltatron.kernels.utils import seq_info  # noqa: E402
from stage_times import timer  # noqa: E402

BOOLEAN = ("hopper_walk", "residual", "keep_states", "overlap", "hopper_reverse", "fused_output", "local_dv_apart")
INTEGER = ("split_partitions", "split_min_tokens", "segments", "wy_maxnreg", "wy_bwd_maxnreg", "dqkw_warps",
           "walk_block_v", "reverse_block_v")


def parse_overrides(text: str) -> Dict[str, object]:
    """'hopper_walk=0,split_partitions=3' -> {'hopper_walk': False, 'split_partitions': 3}; '' -> {}."""
    choices: Dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in BOOLEAN + INTEGER:
            raise ValueError(f"{item!r}: expected name=value with name one of {', '.join(BOOLEAN + INTEGER)}")
        if value.lower() == "none":
            choices[name] = None
        elif name in BOOLEAN:
            if value.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"{item!r}: {name} takes 0/1 or true/false")
            choices[name] = value.lower() in ("1", "true")
        else:
            choices[name] = int(value)
    return choices


def result_names(gated: bool) -> tuple:
    return ("o", *(f"d{n}" for n in (configs.GATED_GRAD_INPUTS if gated else configs.GRAD_INPUTS)))


def calls(cfg: configs.Config, device: torch.device, gated: bool = False, per_channel: bool = False):
    """(the benchmark's inputs, the no_grad forward, the forward+backward returning (o, and the gradients of
    result_names)): chunk_delta_rule(q, k, v, beta), or gated chunk_gated_delta_rule(q, k, v, g, beta) as the
    benchmark's gated rows call it, or with per_channel too chunk_kda as the KDA rows do."""
    gated = gated or per_channel
    x = configs.make_inputs(cfg, device, seed=0, gated=gated, per_channel=per_channel)
    grads_of = [x[n] for n in (configs.GATED_GRAD_INPUTS if gated else configs.GRAD_INPUTS)]
    kwargs = dict(cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=x["cu_seqlens_cpu"]) if cfg.seqlens else {}
    op = deltatron.chunk_delta_rule
    if gated:
        op = deltatron.chunk_kda if per_channel else deltatron.chunk_gated_delta_rule
        kwargs = dict(kwargs, **harness.GATED_OPTIONS)

    def forward():
        with torch.no_grad():
            return op(*(t.detach() for t in grads_of), **kwargs)[0]

    def forward_backward():
        o = op(*grads_of, **kwargs)[0]
        return (o.detach(), *torch.autograd.grad(o, grads_of, x["do"]))

    return x, forward, forward_backward


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (||a - b|| where b is zero)."""
    diff, norm = (a.double() - b.double()).norm(), b.double().norm()
    return float(diff / norm if norm > 0 else diff)


def compare(results_a: Sequence[torch.Tensor], results_b: Sequence[torch.Tensor], bound: Optional[float],
            names: Sequence[str] = result_names(False)) -> tuple:
    """({result name: 'bitwise' or its relative difference}, whether all agree: bitwise, or within bound)."""
    words, agree = {}, True
    for name, a, b in zip(names, results_a, results_b):
        if torch.equal(a, b):
            words[name] = "bitwise"
            continue
        rel = relative(a, b)
        words[name] = f"rel {rel:.1e}"
        agree = agree and bound is not None and rel <= bound
    return words, agree


def probe(cfg: configs.Config, device: torch.device, sides: Dict[str, dict], args, measure) -> bool:
    """Compares and times cfg under both sides' overrides; prints its lines and table; whether the results agree."""
    x, forward, forward_backward = calls(cfg, device, args.gated, args.kda)
    print(f"\n{cfg.name}  A: {args.a or 'shipped plan'}  B: {args.b or 'shipped plan'}")
    if args.explain:
        q, k, v = (x[n].detach() for n in ("q", "k", "v"))
        info = seq_info(cfg.B, cfg.T, device, x.get("cu_seqlens"), x.get("cu_seqlens_cpu"))
        for side, choices in sides.items():
            with plan.overrides(**choices):
                chosen = plan_call(q, k, v, info, True, g=x["g"].detach() if args.gated else None)
                print(f"  plan {side}:\n    " + plan.explain(chosen).replace("\n", "\n    "))
    results = {}
    for side, choices in sides.items():
        with plan.overrides(**choices):
            results[side] = forward_backward()
    words, agree = compare(results["A"], results["B"], args.bound, result_names(args.gated))
    within = "bitwise" if args.bound is None else f"within {args.bound:g}"
    print("  A against B: " + ", ".join(f"{n} {w}" for n, w in words.items())
          + (f"  OK ({within})" if agree else f"  DIFFER (expected {within})"))
    phases = {"forward": forward, "forward+backward": forward_backward}
    readings: Dict[tuple, List[float]] = {(s, p): [] for s in sides for p in phases}
    for _ in range(args.readings):
        for side, choices in sides.items():
            with plan.overrides(**choices):
                for phase, fn in phases.items():
                    readings[(side, phase)].append(measure(fn))
    print(f"  {'phase':<18} {'A ms':>9} {'B ms':>9} {'B / A':>7}   (fastest of {args.readings})")
    for phase in phases:
        a, b = min(readings[("A", phase)]), min(readings[("B", phase)])
        print(f"  {phase:<18} {a:9.3f} {b:9.3f} {b / a:7.3f}")
    return agree


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--a", default="", help="plan A's overrides (name=value,...; empty: the shipped plan)")
    parser.add_argument("--b", default="", help="plan B's overrides")
    parser.add_argument("--configs", nargs="+", default=["b8-t2048-h16-k128"], help="the benchmark's configurations")
    parser.add_argument("--bound", type=float, help="relative difference allowed (default: bitwise equal)")
    parser.add_argument("--readings", type=int, default=3, help="interleaved readings of each side (default 3)")
    parser.add_argument("--explain", action="store_true", help="print each side's plan")
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, the smoke configurations")
    parser.add_argument("--gated", action="store_true", help="chunk_gated_delta_rule as the benchmark's gated rows")
    parser.add_argument("--kda", action="store_true", help="chunk_kda as the benchmark's KDA rows")
    args = parser.parse_args(argv)
    args.gated = args.gated or args.kda  # (KDA's calls take the gated rows' inputs and options, its gate per channel)
    try:
        sides = {"A": parse_overrides(args.a), "B": parse_overrides(args.b)}
    except ValueError as e:
        parser.error(str(e))
    names = args.configs if not args.smoke or args.configs != parser.get_default("configs") else \
        [c.name for c in configs.SMOKE_CONFIGS if not c.decode and (args.gated or c.Hk == c.H)]
    try:
        chosen = configs.by_name(names, smoke=args.smoke)
    except KeyError as e:
        parser.error(e.args[0])
    if any(c.decode for c in chosen):
        parser.error("decode configurations do not run the chunk form")
    if not args.gated and any(c.Hk != c.H for c in chosen):
        parser.error("grouped value heads (Hk < H) run the gated rows only: add --gated")
    device = torch.device("cpu" if args.smoke else "cuda")
    measure = timer(args.smoke)
    agree = [probe(cfg, device, sides, args, measure) for cfg in chosen]
    return 0 if all(agree) else 1


if __name__ == "__main__":
    sys.exit(main())
