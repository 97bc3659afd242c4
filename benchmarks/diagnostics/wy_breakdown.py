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

Then (part "launches") wy_fwd under candidate launches, against the shipped one: warps, pipelining depth,
the width of the W and U tiles (BW = BV) and a register cap (maxnreg), each checked on its outputs
(Tinv, W, U against the shipped launch's: bitwise equal, or their relative RMS difference; beyond 1e-2 the
launch is wrong and not timed). The shipped kernel needs about 250 registers a thread at 4 warps, so an SM
holds 2 blocks (ncu, session 6: latency-bound); the candidates trade that for a third or fourth block.

    python benchmarks/diagnostics/wy_breakdown.py [--configs b8-t2048-h16-k128 ...] [--parts steps launches]
                                                  [--out FILE.json]
    python benchmarks/diagnostics/wy_breakdown.py --smoke     # CPU, interpreter: every variant's Tinv vs
                                                              # shipped, every launch's outputs bitwise equal

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
from isolated import forced_launch  # noqa: E402  (same folder: sys.path[0] when run as a script)
from stage_configs import run_forced  # noqa: E402
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
# Candidate launches of wy_fwd: (warps, stages, W and U tile width, maxnreg or None). Offline compile for
# sm_90 with triton 3.6 at K = V = 128, bf16: registers a thread, spill bytes, blocks per SM by registers
# (65536 a SM; shared memory, 32 KiB a block at 4 warps and 64 at 8, allows 7 and 3). The shipped launch
# is 4 warps, 3 stages, 64-wide tiles, capped at 168 registers (16-bit, K <= 128); maxnreg 0 lifts the cap.
LAUNCHES = {
    "w4 s3 tile64 uncapped": (4, 3, 64, 0),  # 252, 0, 2: the launch shipped before the cap
    "w4 s3 tile32": (4, 3, 32, None),  # 234, 0, 2: narrower accumulators alone (ptxas still takes ~235)
    "w4 s3 tile32 maxnreg168": (4, 3, 32, 168),  # 168, 0, 3
    "w4 s2 tile32 maxnreg168": (4, 2, 32, 168),  # 168, 0, 3
    "w4 s2 tile64 maxnreg168": (4, 2, 64, 168),  # 168, 12, 3
    "w4 s3 tile64 maxnreg168": (4, 3, 64, 168),  # 168, 48, 3
    "w4 s3 tile32 maxnreg128": (4, 3, 32, 128),  # 128, 248, 4
    "w4 s2 tile32 maxnreg128": (4, 2, 32, 128),  # 128, 276, 4
    "w8 s3 tile64": (8, 3, 64, None),  # 227, 0, 1
    "w8 s3 tile64 maxnreg128": (8, 3, 64, 128),  # 128, 176, 2 (16 warps a SM, as 4 blocks of 4)
}


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


def steps(k, v, beta, info, measure, smoke: bool) -> dict:
    """{step or variant name: ms} (smoke: 0.0, after checking each inverse variant's Tinv)."""
    calls, out, tinv = variants(k, v, beta, info)
    row = {}
    for name, call in calls.items():
        if smoke:
            call()
            if name.startswith("Tinv"):  # same inverse as shipped, to tf32 rounding
                err = ((out - tinv).norm() / tinv.norm()).item()
                assert err < 1e-3, f"{name}: {err:.2e} off the shipped Tinv"
            row[name] = 0.0
        else:
            row[name] = measure(call)
        print(f"  {name:40s} {row[name]:8.3f} ms", flush=True)
    return row


def launches(k, v, beta, info, measure, smoke: bool) -> dict:
    """{launch name: dict(ms, equal, error)} for the shipped launch and every candidate of LAUNCHES (smoke:
    ms 0.0)."""
    def call():
        return wy.wy_fwd(k, v, beta, info, C)  # (Tinv, W, U)

    if smoke:
        measure = lambda fn: 0.0  # noqa: E731
    shipped = call()
    rows = {"shipped": dict(ms=measure(call), equal=True, error=0.0)}
    for name, (warps, stages, tile, maxnreg) in LAUNCHES.items():
        rows[name], got = run_forced(call, shipped, forced_launch(warps, stages, maxnreg, BW=tile, BV=tile),
                                     measure)
        rows[name]["equal"] = got is not None and all(torch.equal(a, b) for a, b in zip(got, shipped))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["b8-t2048-h16-k128", "b2-t8192-h32-k128"])
    parser.add_argument("--parts", nargs="+", choices=("steps", "launches"), default=["steps", "launches"])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    configs = [bench.dense(2, 130, 2, 32)] if args.smoke else [c for c in bench.CONFIGS if c.name in args.configs]
    measure = timer(args.smoke)  # stage_times' do_bench settings
    results = {part: {} for part in args.parts}
    for cfg in configs:
        x = bench.make_inputs(cfg, device, seed=0)
        B, T = x["k"].shape[:2]
        k, v, beta = (x[n].detach().reshape(1, B * T, *x[n].shape[2:]) for n in ("k", "v", "beta"))
        if args.smoke:  # the interpreter's bf16 dots are wrong: fp16 there
            k, v = k.half(), v.half()
        info = seq_info(B, T, device, None, None)
        print(cfg.name)
        if "steps" in args.parts:
            results["steps"][cfg.name] = steps(k, v, beta, info, measure, args.smoke)
        if "launches" in args.parts:
            rows = launches(k, v, beta, info, measure, args.smoke)
            for name, r in rows.items():
                ms = "wrong" if r["ms"] is None else f"{r['ms']:8.3f} ms"
                same = ("bitwise equal" if r["equal"] else f"differs by {r['error']:.1e}" if r["error"] is not None
                        else r["exception"])
                print(f"  launch {name:33s} {ms:>11}  {same}", flush=True)
                if args.smoke:  # the interpreter forces only the tile widths: the same products
                    assert r["equal"], f"{name}: outputs differ from the shipped launch's"
            results["launches"][cfg.name] = rows
    if args.out:
        bench.write_json(Path(args.out), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
