"""The Gluon WY forward (kernels/chunk/gluon_wy.py) against wy_kernel (wy.wy_fwd with wy.GLUON_WY off): agreement
and times on the GPU, or what triton 3.6 makes of it offline.

On the GPU, per config (bench.make_inputs' K, V, beta, packed as the forward packs them): Tinv, W and U of the
Gluon kernel against wy_kernel's (relative RMS: Tinv within fp32-level agreement, < 1e-4; W, U within a rounding
of the input dtype, < 1e-2), rerun bitwise (no atomics: a race shows as a change), for both forms of the doubling
levels (blocked_levels: the whole tile, or pieces of their nonzero blocks) at the shipped register cap and at 128,
then all timed with Tinv stored (the training forward) and without (inference), then the whole forward
(chunk.forward, no backward) with wy.GLUON_WY off and on.

--offline compiles the Gluon kernel for sm_90 (bf16 and fp16 at K = V = 128, bf16 at 64, with and without Tinv;
each with the doubling levels on the whole tile and on pieces of their nonzero blocks, blocked_levels)
on a machine without a GPU (put triton 3.6 first on PYTHONPATH) and prints ptxas's registers and spills, shared
memory, blocks an SM, the PTX's wgmma and barrier counts and the SASS instructions by source line (--sass-lines;
wy_kernel's come from offline_compile.py --forms chunk --kernels wy_kernel --sass-lines N).

    python benchmarks/diagnostics/gluon_wy.py [--configs b8-t2048-h16-k128 b2-t8192-h32-k128 b16-t2048-h8-k64]
    python benchmarks/diagnostics/gluon_wy.py --offline [--sass-lines 12] [--dump DIR]
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import sys

os.environ["DELTATRON_BACKEND"] = "triton"

import torch  # noqa: E402

from deltatron import bench  # noqa: E402
from deltatron.kernels import chunk  # noqa: E402
from deltatron.kernels.chunk import wy  # noqa: E402
from deltatron.kernels.utils import packed_info, seq_info  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stage_configs import worst_difference as rel_rms  # noqa: E402
from switch_probe import with_settings  # noqa: E402

C = 64
CONFIGS = ["b8-t2048-h16-k128", "b2-t8192-h32-k128", "b16-t2048-h8-k64"]


def compare(cfg: bench.Config, measure) -> None:
    from deltatron.kernels.chunk import gluon_wy

    x = bench.make_inputs(cfg, torch.device("cuda"), seed=0)
    q, k, v, beta = (x[n].detach().reshape(1, cfg.B * cfg.T, *x[n].shape[2:]) for n in ("q", "k", "v", "beta"))
    info = packed_info(range(0, cfg.B * cfg.T + 1, cfg.T), cfg.B * cfg.T, k.device)
    # both forms of the levels, at the shipped register cap and at 128 (4 programs an SM where shared memory
    # allows it: K = V = 64)
    variants = [(blocked, cap) for blocked in (False, True) for cap in (gluon_wy.MAX_REGISTERS, 128)]

    def gluon(blocked, cap, store=True):
        return with_settings(gluon_wy, dict(MAX_REGISTERS=cap),
                             lambda: gluon_wy.gluon_wy_fwd(k, v, beta, info, C, store, blocked))

    def with_switch(on, fn):
        return with_settings(wy, dict(GLUON_WY=on), fn)

    ref = with_switch(False, lambda: wy.wy_fwd(k, v, beta, info, C))
    print(f"\n{cfg.name}:")
    for blocked, cap in variants:
        got, again = gluon(blocked, cap), gluon(blocked, cap)
        same = all(torch.equal(a, b) for a, b in zip(got, again))
        errs = [rel_rms(a, b) for a, b in zip(got, ref)]
        finite = all(torch.isfinite(a).all() for a in got)
        ok = errs[0] < 1e-4 and max(errs[1:]) < 1e-2 and finite and same
        print(f"  gluon_wy (blocked_levels {blocked}, maxnreg {cap}) against wy_kernel: Tinv rel RMS "
              f"{errs[0]:.1e}, W {errs[1]:.1e}, U {errs[2]:.1e}, rerun bitwise {same}  {'OK' if ok else 'WRONG'}")
    runs = {"wy_kernel (wy.wy_fwd)": lambda store: with_switch(False, lambda: wy.wy_fwd(k, v, beta, info, C, store))}
    for blocked, cap in variants:
        runs[f"gluon_wy blocked {blocked!s:<5} maxnreg {cap}"] = functools.partial(gluon, blocked, cap)
    for store in (True, False):
        for name, fn in runs.items():
            print(f"  {name:<36} Tinv stored {store!s:<5} {measure(lambda: fn(store)):8.3f} ms", flush=True)
    # the whole forward (no backward: Tinv not stored) with the switch off and on (the shipped form and cap), twice,
    # interleaved against drift
    for on in (False, True) * 2:
        ms = with_switch(on, lambda: measure(
            lambda: chunk.forward(q, k, v, beta, cfg.K ** -0.5, None, False, info, needs_backward=False)))
        print(f"  forward, GLUON_WY {on!s:<5} {ms:8.3f} ms", flush=True)


def offline(dump, sass_lines: int) -> int:
    """Compiles the kernel for sm_90 (nothing runs) on 8 x 16 heads of 256 tokens: bf16 and fp16 at K = V = 128,
    bf16 at 64, each with Tinv stored, and bf16 at 128 without."""
    import triton
    from gluon_walk import compiling_for_sm90

    import offline_compile as oc  # it refuses the interpreter: imported only here
    from deltatron.kernels.chunk import gluon_wy

    B, T, H = 8, 256, 16
    info = seq_info(B, T, torch.device("cpu"), None, None)
    variants = [(name, dtype, D, store, blocked) for blocked in (False, True)
                for name, dtype, D, store in [("bf16", torch.bfloat16, 128, True), ("fp16", torch.float16, 128, True),
                                              ("bf16", torch.bfloat16, 128, False), ("bf16", torch.bfloat16, 64, True)]]
    with compiling_for_sm90() as compiled:
        for _, dtype, D, store, blocked in variants:
            x = oc.inputs(B, T, H, D, D, dtype)
            gluon_wy.gluon_wy_fwd(x["k"], x["v"], x["beta"], info, C, store, blocked)
    assert len(compiled) == len(variants), f"{len(compiled)} kernels compiled for {len(variants)} launches"
    for (name, _, D, store, blocked), kernel in zip(variants, compiled):
        ptx = kernel.asm["ptx"]
        usage = oc.ptxas_usage(ptx)
        warps, shared = kernel.metadata.num_warps, kernel.metadata.shared
        print(f"\ngluon_wy_kernel {name} K=V={D} C={C} Tinv stored {store} blocked_levels {blocked}: {warps} warps, "
              f"ptxas {usage['regs']} "
              f"registers, {usage['spills']} B of spills, shared {shared} B, "
              f"{oc.blocks_per_sm(usage['regs'], shared, warps)} blocks an SM")
        print("  PTX: wgmma.mma_async", len(re.findall(r"wgmma\.mma_async", ptx)), " wgmma.wait_group",
              len(re.findall(r"wgmma\.wait_group", ptx)), " bar.sync",
              len(re.findall(r"\b(?:bar|barrier)\.sync", ptx)), " cp.async.bulk.tensor",
              len(re.findall(r"cp\.async\.bulk\.tensor", ptx)), " shfl", len(re.findall(r"shfl\.sync", ptx)),
              " st.shared", len(re.findall(r"st\.shared", ptx)), " ld.shared", len(re.findall(r"ld\.shared", ptx)))
        lines = oc.sass_by_line(kernel.asm["cubin"])
        if sass_lines:
            oc.print_sass_lines(lines, sass_lines)
        else:
            print(f"  {sum(sum(ops.values()) for ops in lines.values())} SASS instructions")
        if dump:
            os.makedirs(dump, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                with open(os.path.join(dump, f"gluon_wy_{name}_k{D}_tinv{int(store)}_blocked{int(blocked)}.{ext}"),
                          "w") as f:
                    f.write(kernel.asm[ext])
    print(f"triton {triton.__version__}, target sm_90")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS)
    parser.add_argument("--offline", action="store_true", help="compile for sm_90 instead of running")
    parser.add_argument("--sass-lines", type=int, default=0, help="--offline: list the N lines with most SASS")
    parser.add_argument("--dump", help="--offline: write the TTGIR and PTX into this folder")
    args = parser.parse_args()
    if args.offline:
        return offline(args.dump, args.sass_lines)
    import triton

    known = {c.name: c for c in bench.CONFIGS}
    for name in args.configs:
        compare(known[name], lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100))
    return 0


if __name__ == "__main__":
    sys.exit(main())
