"""`deltatron explain`: which kernels chunk_delta_rule (or chunk_gated_delta_rule, or chunk_kda) runs for a shape, and
why (the call's plan).

    deltatron explain --batch 8 --seqlen 2048 --heads 16 --head-dim 128 --dtype bf16 --gpu sm90
    deltatron explain --lengths 4096 100 0 --heads 16 --gpu sm80 --inference
    deltatron explain --batch 8 --seqlen 4096 --heads 32 --key-heads 16 --gated     # Qwen3-Next's layout
    deltatron explain --batch 1 --seqlen 8192 --heads 32 --kda --inference            # a KDA prefill
    deltatron explain --kda --head-dim 256      # KDA at heads its chunk kernels do not take: fused_recurrent, why
    deltatron explain --gated --inference --chunk-states                            # a prefill for prefix caching

Runs on any machine: the plan is made for the named GPU's capabilities (--gpu), or this machine's (--gpu here)."""
from __future__ import annotations

import argparse
import sys

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parser() -> argparse.ArgumentParser:
    from ..kernels.chunk.plan import NAMED_GPUS

    p = argparse.ArgumentParser(prog="deltatron explain", description=__doc__.splitlines()[0])
    p.add_argument("--batch", "-B", type=int, default=8, help="sequences of --seqlen tokens (default 8)")
    p.add_argument("--seqlen", "-T", type=int, default=2048, help="tokens a sequence (default 2048)")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="packed variable-length sequences (cu_seqlens), instead of --batch and --seqlen")
    p.add_argument("--heads", "-H", type=int, default=16, help="heads (value heads with --key-heads; default 16)")
    p.add_argument("--key-heads", type=int, default=None,
                   help="heads of q and k, dividing --heads: grouped value heads (default: as many as --heads)")
    p.add_argument("--gated", action="store_true", help="the gated delta rule (chunk_gated_delta_rule)")
    p.add_argument("--kda", action="store_true",
                   help="KDA's per-channel gate (chunk_kda)")
    p.add_argument("--head-dim", "-K", type=int, default=128, help="key head size K (default 128)")
    p.add_argument("--value-dim", "-V", type=int, default=None, help="value head size V (default: K)")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="bf16", help="input dtype (default bf16)")
    p.add_argument("--chunk-size", type=int, choices=[16, 32, 64], default=64, help="chunk size (default 64)")
    p.add_argument("--gpu", default="sm90", choices=sorted(NAMED_GPUS) + ["cpu", "here"],
                   help="plan for this GPU (sm90: H100/H200 with 132 SMs), the CPU (Triton's interpreter), "
                        "or this machine's device ('here'; default sm90)")
    p.add_argument("--inference", action="store_true", help="a forward without backward (default: training)")
    p.add_argument("--save-states", action="store_true", help="chunk_delta_rule(..., save_states=True)")
    p.add_argument("--chunk-states", action="store_true",
                   help="output_chunk_states=True (the state entering every chunk, for prefix caching)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from ..kernels.chunk import plan as chunk_plan

    for name, value in (("--batch", args.batch), ("--seqlen", args.seqlen), ("--heads", args.heads),
                        ("--head-dim", args.head_dim)):
        if value < 1:
            print(f"deltatron explain: {name} must be at least 1, got {value}", file=sys.stderr)
            return 2
    if args.lengths is not None and (not args.lengths or min(args.lengths) < 0):
        print("deltatron explain: --lengths takes sequence lengths >= 0", file=sys.stderr)
        return 2
    key_heads = args.key_heads or args.heads
    if key_heads < 1 or args.heads % key_heads:
        print(f"deltatron explain: --key-heads must divide --heads ({args.heads}), got {key_heads}", file=sys.stderr)
        return 2
    V = args.value_dim or args.head_dim
    if max(args.head_dim, V) > 256:
        print(f"deltatron explain: head sizes up to 256, got K = {args.head_dim}, V = {V}", file=sys.stderr)
        return 2
    if args.gpu == "here":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        caps = chunk_plan.device_capabilities(device)
    else:
        caps = chunk_plan.named_capabilities(args.gpu)
    refusal = chunk_plan.kda_chunk_refusal(args.head_dim, V, caps) if args.kda else None
    if refusal and args.chunk_states:
        print(f"deltatron explain: --chunk-states needs the chunk kernels' walk, and {refusal}", file=sys.stderr)
        return 2
    if refusal:
        print(f"form: fused_recurrent: {refusal}")
        return 0
    lengths = tuple(args.lengths) if args.lengths else None
    num_seqs, tokens = (len(lengths), sum(lengths)) if lengths else (args.batch, args.batch * args.seqlen)
    problem = chunk_plan.Problem(DTYPES[args.dtype], args.heads, args.head_dim, V, num_seqs, tokens,
                                 args.chunk_size, not args.inference, args.save_states, True, args.gated or args.kda,
                                 0 if key_heads == args.heads else key_heads, chunk_states=args.chunk_states,
                                 per_channel=args.kda)
    print(chunk_plan.explain(chunk_plan.make_plan(problem, caps)))
    return 0
