"""Where the time of the WY forward kernel (wy.wy_fwd: A, Tinv, W, U of every chunk) goes, without hardware
counters: the same jit helpers run to a given step and store what they have (so nothing is optimized away),
and the differences between steps are the steps' costs.

    A            A = tril(diag(beta) K K^T, -1) from K (kkt_tile), stored
    +diagonal    the 16 x 16 diagonal blocks inverted by batched doubling (invert_diagonal_blocks)
    +merges      the 16- and 32-block merges on the whole tile: Tinv in tf32 (the Newton step's input)
    Tinv         the whole inverse as shipped (tril_inverse: + the Newton step) = wy.tinv_fwd
    Tinv, whole-tile doubling   every doubling level (1, 2, 4, 8, 16, 32) as a masked whole-tile merge instead
                 of the batched 16 x 16 blocks, then the Newton step: a candidate, same math
    wy_fwd       the shipped kernel: Tinv, then W and U by the hi + lo application (stores Tinv too)
    recompute    W and U from a stored Tinv (the backward's first stage)

    python benchmarks/diagnostics/wy_breakdown.py [--configs b8-t2048-h16-k128 ...] [--out FILE.json]
    python benchmarks/diagnostics/wy_breakdown.py --smoke     # CPU, interpreter: every variant's Tinv vs shipped

bf16 inputs (the benchmark's). Times: triton.testing.do_bench medians in ms."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from stage_times import timer  # noqa: E402

from deltatron import bench  # noqa: E402
from deltatron.kernels.chunk import wy  # noqa: E402
from deltatron.kernels.chunk.kkt import chunk_span, kkt_tile  # noqa: E402
from deltatron.kernels.chunk.solve_tril import (invert_diagonal_blocks, merge_diagonal_blocks,  # noqa: E402
                                                tril_inverse)
from deltatron.kernels.utils import (WY_PIPELINE_STAGES, dot_precision, head_tile, mm,  # noqa: E402
                                     seq_info, store_rows, tril_precision)

C = 64
STEPS = {"A": 0, "+diagonal": 1, "+merges": 2, "Tinv": 3, "Tinv, whole-tile doubling": 4}


@triton.jit
def partial_wy_kernel(k, beta, out, cu_seqlens, chunk_indices, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                      BK: tl.constexpr, KKT_PREC: tl.constexpr, TRIL_PREC: tl.constexpr, STEP: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start, n = chunk_span(cu_seqlens, chunk_indices, i_c, C)
    k_c = k + start * H * K + i_h * K
    beta_c = beta + start * H + i_h
    if STEP == 3:
        t = tril_inverse(k_c, k_c, beta_c, n, H, C, K, BK, True, KKT_PREC, TRIL_PREC, True)
    else:
        a = kkt_tile(k_c, beta_c, n, H, 0, 0, C, C, K, BK, KKT_PREC)
        t = a
        if STEP == 1 or STEP == 2:
            t = invert_diagonal_blocks(a, C, 16, TRIL_PREC)
        if STEP == 2:
            t = merge_diagonal_blocks(t, a, C, 16, TRIL_PREC)
            t = merge_diagonal_blocks(t, a, C, 32, TRIL_PREC)
        if STEP == 4:
            r = tl.arange(0, C)
            eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
            t = eye
            for s in tl.static_range(0, 6):  # block sizes 1, 2, 4, 8, 16, 32
                t = merge_diagonal_blocks(t, a, C, 1 << s, TRIL_PREC)
            residual = eye - t - mm(a, t, "tf32x3")
            t = t + mm(t, residual, TRIL_PREC)
    store_rows(out, t, start, n, i_h, 0, H, C, C, C)


def variants(k, v, beta, info):
    """{name: a call running that variant}, and the shipped Tinv for the smoke comparison."""
    H, K = k.shape[2], k.shape[3]
    chunks = info.chunks(C)
    out = torch.empty(*k.shape[:3], C, device=k.device, dtype=torch.float32)
    prec, _ = tril_precision(k.dtype)

    def partial(step):
        return lambda: partial_wy_kernel[(chunks.num_chunks, H)](
            k, beta, out, info.cu_seqlens, chunks.chunk_indices, H, K, C, max(head_tile(K), 32),
            dot_precision(k.dtype), prec, step, num_warps=4, num_stages=WY_PIPELINE_STAGES)

    tinv = wy.tinv_fwd(k, beta, info, C)
    calls = {name: partial(step) for name, step in STEPS.items()}
    calls["wy_fwd (shipped)"] = lambda: wy.wy_fwd(k, v, beta, info, C)
    calls["recompute W, U from Tinv"] = lambda: wy.recompute_w_u(k, v, beta, tinv, info, C)
    return calls, out, tinv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["b8-t2048-h16-k128", "b2-t8192-h32-k128"])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    configs = [bench.dense(2, 130, 2, 32)] if args.smoke else [c for c in bench.CONFIGS if c.name in args.configs]
    measure = timer(args.smoke)  # stage_times' do_bench settings
    results = {}
    for cfg in configs:
        x = bench.make_inputs(cfg, device, seed=0)
        B, T = x["k"].shape[:2]
        k, v, beta = (x[n].detach().reshape(1, B * T, *x[n].shape[2:]) for n in ("k", "v", "beta"))
        if args.smoke:  # the interpreter's bf16 dots are wrong: fp16 there
            k, v = k.half(), v.half()
        info = seq_info(B, T, device, None, None)
        calls, out, tinv = variants(k, v, beta, info)
        print(cfg.name)
        row = {}
        for name, call in calls.items():
            if args.smoke:
                call()
                if name.startswith("Tinv"):  # same inverse as shipped, to tf32 rounding
                    err = ((out - tinv).norm() / tinv.norm()).item()
                    assert err < 1e-3, f"{name}: {err:.2e} off the shipped Tinv"
                row[name] = 0.0
            else:
                row[name] = measure(call)
            print(f"  {name:40s} {row[name]:8.3f} ms", flush=True)
        results[cfg.name] = row
    if args.out:
        bench.write_json(Path(args.out), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
