"""The chunk forward's sequence split (kernels/chunk/seq_split.py, SEQ_SPLIT): the forward and the forward+backward
through the API with the switch False (no split) and True (split), their results compared and their times
interleaved.

Per config (the benchmark's bf16 inputs and dO): what the rule (SEQ_SPLIT = None: seq_split.split_partitions, a
prediction) would choose and what True runs (--partitions, default: the rule's count, at least 3), which sequences
are split and how many sequences x heads each walk runs; o and the final state with True against False (not
bitwise: the split rounds the states entering its partitions differently; within the bf16 bound) and the gradients
(bitwise: the backward is the unsplit one); then the forward (no_grad) and torch.autograd.grad through
deltatron.chunk_delta_rule, timed with False and True in turn, three readings each (stage_times' do_bench
settings). A config with no sequence of seq_split.SPLIT_MIN_TOKENS tokens runs the same launches both ways: a
control for the noise.

--pass1 compares pass 1's two forms instead (seq_split.PASS1_OUTPUT_FREE False: the forward's walk, its outputs
dropped; True, the default: state.state_final_fwd, the Gluon walk without its output where it runs), both with the
split on (True): o and the final state bitwise equal (the same final states enter the combine), then pass 1 and
the combine alone (seq_split.partition_states on the forward's W, U) and the whole forward (no_grad), timed
interleaved, three readings each.

--smoke runs the flow on the CPU in the interpreter at tiny sizes (SPLIT_MIN_TOKENS lowered to 128: a packed batch
with two of its three sequences split, and one with none). --precision (CPU, interpreter, a few minutes)
measures the split's error against the unsplit forward's, both against the float64 chunkwise oracle, on one
sequence of realistic inputs (unit keys, beta = sigmoid(randn)) at K = V = 128 in fp32, fp16 and bf16.

    python benchmarks/diagnostics/seq_split.py [--configs b1-t32768-h16-k128 ...] [--partitions P] [--pass1]
        [--min-tokens N]   (N: the shortest sequence the split takes, seq_split.SPLIT_MIN_TOKENS; e.g. to split the
                            two longest of varlen20's sequences, 7158 and 5720 tokens, with --min-tokens 4096)
    python benchmarks/diagnostics/seq_split.py --smoke [--pass1]
    python benchmarks/diagnostics/seq_split.py --precision [--tokens 8192]
"""
from __future__ import annotations

import argparse
import os
import sys

if "--smoke" in sys.argv or "--precision" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["DELTATRON_BACKEND"] = "triton"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# switch_probe: same folder (sys.path[0] when run as a script)
from switch_probe import (  # noqa: E402
    SETTINGS, gpu_configs, interleaved, rel, run_configs, with_settings)

import deltatron  # noqa: E402
from deltatron import bench  # noqa: E402
from deltatron.kernels.chunk import seq_split, wy  # noqa: E402
from deltatron.kernels.utils import num_sms, seq_info  # noqa: E402
from deltatron.reference import chunk_delta_rule_reference  # noqa: E402

CONFIGS = ["b1-t32768-h16-k128", "b1-t32768-h64-k128", "varlen20-t32768-h16-k128", "b2-t8192-h32-k128"]
SMOKE_CONFIGS = [bench.Config("varlen3-t353-h1-k16", 1, 353, 1, 16, 16, seqlens=(200, 3, 150)),
                 bench.dense(2, 40, 1, 16)]
BOUND = 1e-2  # bf16's, DESIGN.md §6


def with_split(split: bool, partitions, fn):
    """fn() with seq_split.SEQ_SPLIT = split (and SPLIT_PARTITIONS = partitions), restored after."""
    return with_settings(seq_split, dict(SEQ_SPLIT=split, SPLIT_PARTITIONS=partitions), fn)


def describe(cfg: bench.Config, x, device, partitions) -> str:
    info = seq_info(cfg.B, cfg.T, device, x.get("cu_seqlens"), x.get("cu_seqlens_cpu"))
    rule = seq_split.split_partitions(info.num_seqs, cfg.H, info.total_tokens, num_sms(device))
    head = (f"{cfg.name}: {info.num_seqs} x {cfg.H} sequences x heads; the rule would "
            + (f"split into {rule}" if rule > 1 else "not split"))
    plan = with_split(True, partitions, lambda: seq_split.plan_for(x["k"], x["v"], info, 64))
    if plan is None:
        return head + f"; no sequence of {seq_split.SPLIT_MIN_TOKENS} tokens: both settings run the same launches"
    P = len(plan.rows_parts)
    split = plan.parts.num_seqs - info.num_seqs
    walks = [plan.walk_u.num_seqs] + ([plan.walk_w.num_seqs] if plan.walk_w is not None else [])
    return (head + f"; True splits {split // (P - 1)} of {info.num_seqs} sequences into {P}: pass 1 walks "
            + " + ".join(f"{n} x {cfg.H}" for n in walks) + f", pass 2 {plan.parts.num_seqs} x {cfg.H} "
            "sequences x heads (fillers included)")


def compare(cfg: bench.Config, device: torch.device, measure, partitions) -> bool:
    """Prints the config's plan, the comparison of the results and the readings; whether the results agree."""
    x = bench.make_inputs(cfg, device, seed=0)
    varlen = dict(cu_seqlens=x.get("cu_seqlens"), cu_seqlens_cpu=x.get("cu_seqlens_cpu"))
    grad_inputs = [x[n] for n in bench.GRAD_INPUTS]

    def forward():
        with torch.no_grad():
            return deltatron.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], output_final_state=True, **varlen)

    def fwd_bwd():
        o = deltatron.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], **varlen)[0]
        return torch.autograd.grad(o, grad_inputs, x["do"])

    print("\n" + describe(cfg, x, device, partitions))
    outs = {s: with_split(s, partitions, forward) for s in SETTINGS}
    grads = {s: with_split(s, partitions, fwd_bwd) for s in SETTINGS}
    err_o, err_s = rel(outs[True][0], outs[False][0]), rel(outs[True][1], outs[False][1])
    same = all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    agree = err_o <= BOUND and err_s <= BOUND and same
    print(f"  True against False: o rel RMS {err_o:.2e}, final state {err_s:.2e}; gradients bitwise {same}"
          + ("  OK" if agree else "  DIFFER"))
    interleaved(measure, lambda s, fn: with_split(s, partitions, fn), {"forward": forward, "forward+backward": fwd_bwd},
                "SEQ_SPLIT")
    return agree


def compare_pass1(cfg: bench.Config, device: torch.device, measure, partitions) -> bool:
    """With the split on: prints the plan, whether o and the final state are bitwise equal with pass 1 with and
    without outputs, and the readings of pass 1 (with the combine) and of the forward under each; whether equal."""
    x = bench.make_inputs(cfg, device, seed=0)
    varlen = dict(cu_seqlens=x.get("cu_seqlens"), cu_seqlens_cpu=x.get("cu_seqlens_cpu"))
    info = seq_info(cfg.B, cfg.T, device, x.get("cu_seqlens"), x.get("cu_seqlens_cpu"))
    C = 64

    def switch(output_free, fn):
        return with_split(True, partitions, lambda: with_settings(seq_split, dict(PASS1_OUTPUT_FREE=output_free), fn))

    def forward():
        with torch.no_grad():
            return deltatron.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], output_final_state=True, **varlen)

    print("\n" + describe(cfg, x, device, partitions))
    outs = {s: switch(s, forward) for s in SETTINGS}
    same = all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
    print(f"  PASS1_OUTPUT_FREE True against False: o and final state bitwise {same}"
          + ("  OK" if same else "  DIFFER"))
    phases = {"forward": forward}
    plan = with_split(True, partitions, lambda: seq_split.plan_for(x["k"], x["v"], info, C))
    if plan is not None:
        _, w, u = wy.wy_fwd(x["k"], x["v"], x["beta"], info, C, store_tinv=False)
        phases = {"pass 1 + combine": lambda: seq_split.partition_states(x["q"], x["k"], w, u, None, plan, C),
                  **phases}
    interleaved(measure, switch, phases, "PASS1_OUTPUT_FREE")
    return same


def precision(tokens: int) -> None:
    """Rel RMS of o and the final state against the float64 chunkwise oracle, unsplit and split (P = 3, 4), one
    sequence of `tokens` tokens, one head, K = V = 128, C = 64, in the interpreter."""
    g = torch.Generator().manual_seed(0)
    H, D = 1, 128
    q = torch.randn(1, tokens, H, D, generator=g)
    k = F.normalize(torch.randn(1, tokens, H, D, generator=g), dim=-1)
    v = torch.randn(1, tokens, H, D, generator=g)
    beta = torch.randn(1, tokens, H, generator=g).sigmoid()
    print(f"one sequence of {tokens} tokens, 1 head, K = V = 128, unit keys, beta = sigmoid(randn); rel RMS against "
          "the float64 chunkwise oracle, o / final state:")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        xs = [t.to(dtype) for t in (q, k, v, beta)]
        o_ref, s_ref = chunk_delta_rule_reference(*(t.double() for t in xs), D ** -0.5, None, True, chunk_size=64)
        cells = []
        for split, P in ((False, None), (True, 3), (True, 4)):
            o, s = with_split(split, P, lambda: deltatron.chunk_delta_rule(*xs, output_final_state=True))
            cells.append(f"{'P = ' + str(P) if split else 'unsplit'} {rel(o, o_ref):.3e} / {rel(s, s_ref):.3e}")
        print(f"  {str(dtype).replace('torch.', ''):<9} " + ", ".join(cells), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="bench.CONFIGS names")
    parser.add_argument("--partitions", type=int, default=None,
                        help="the count True forces (default: the rule's, at least 3)")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny sizes: the flow runs")
    parser.add_argument("--precision", action="store_true", help="CPU, interpreter: the split's error")
    parser.add_argument("--pass1", action="store_true",
                        help="pass 1 with outputs against without (PASS1_OUTPUT_FREE), the split on")
    parser.add_argument("--tokens", type=int, default=8192, help="--precision's sequence length")
    parser.add_argument("--min-tokens", type=int, default=None,
                        help="seq_split.SPLIT_MIN_TOKENS for the run: the shortest sequence True splits")
    args = parser.parse_args()
    if args.min_tokens is not None:
        seq_split.SPLIT_MIN_TOKENS = args.min_tokens
    if args.precision:
        precision(args.tokens)
        return 0
    if args.smoke:
        device, configs = torch.device("cpu"), SMOKE_CONFIGS
        seq_split.SPLIT_MIN_TOKENS = 128
    else:
        device, configs = gpu_configs(args.configs)
    probe = compare_pass1 if args.pass1 else compare
    return run_configs(lambda cfg, device, measure: probe(cfg, device, measure, args.partitions), device, configs,
                       args.smoke)


if __name__ == "__main__":
    sys.exit(main())
