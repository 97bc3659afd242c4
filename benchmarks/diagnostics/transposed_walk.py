"""The forward's fused walk (state.state_output_fwd) on S against the same walk on S^T (state.transposed_walk,
forced by state.TRANSPOSED_WALK; the forward chooses by state.transposed_walk_pays): times, agreement, and
(offline) what triton makes of each.

On the GPU, per config (the benchmark's bf16 inputs, W and U from wy.wy_fwd as the forward makes them, a
random fp32 initial state): both walks timed as the forward runs them (no final state), and the transposed
one's o and final state against the one on S (relative RMS; o must stay under 1e-2, one bf16 rounding
apart at most, the state about fp32 summation order apart).

--offline compiles both for sm_90 on a machine without a GPU (put triton 3.6, the H200's, first on
PYTHONPATH) and prints registers, spills, shared memory, the products (warp_group_dot) and how many are
followed by a wait for all of them (warp_group_dot_wait pendings = 0: nothing left in flight); --smoke runs
both walks in the interpreter at a tiny size.

    python benchmarks/diagnostics/transposed_walk.py [--configs b8-t2048-h16-k128 b4-t4096-h16-k128]
    python benchmarks/diagnostics/transposed_walk.py --offline [--heads 64 100 128] [--dtype bf16]
    python benchmarks/diagnostics/transposed_walk.py --smoke
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["DELTATRON_BACKEND"] = "triton"

import torch  # noqa: E402

from stage_configs import worst_difference  # noqa: E402  (same folder: sys.path[0] when run as a script)
from stage_times import timer  # noqa: E402

from deltatron import bench  # noqa: E402
from deltatron.kernels.chunk import state, wy  # noqa: E402
from deltatron.kernels.utils import seq_info  # noqa: E402

C = 64
WALKS = {"on S": False, "on S^T": True}


def walk_inputs(cfg: bench.Config, device):
    """(q, k, w, u, scale, h0, info) of the forward's fused walk on the benchmark's inputs, packed as the
    forward packs them (a varlen configuration as its sequences)."""
    x = bench.make_inputs(cfg, device, seed=0)
    q, k, v, beta = (x[n].detach().reshape(1, cfg.B * cfg.T, *x[n].shape[2:]) for n in ("q", "k", "v", "beta"))
    info = seq_info(cfg.B, cfg.T, device, x.get("cu_seqlens"), x.get("cu_seqlens_cpu"))  # varlen: its sequences
    _, w, u = wy.wy_fwd(k, v, beta, info, C)
    h0 = torch.randn(info.num_seqs, cfg.H, cfg.K, cfg.V, device=device,
                     generator=torch.Generator(device).manual_seed(1))
    return q, k, w, u, cfg.K ** -0.5, h0, info


def run_walk(transposed: bool, inputs, final: bool):
    chosen, state.TRANSPOSED_WALK = state.TRANSPOSED_WALK, transposed
    try:
        q, k, w, u, scale, h0, info = inputs
        return state.state_output_fwd(q, k, w, u, scale, h0, final, info, C)
    finally:
        state.TRANSPOSED_WALK = chosen


def compare(cfg: bench.Config, device, measure) -> None:
    inputs = walk_inputs(cfg, device)
    o_ref, s_ref = run_walk(False, inputs, True)
    o, s = run_walk(True, inputs, True)
    err_o, err_s = worst_difference(o, o_ref), worst_difference(s, s_ref)  # inf where not finite
    ok = err_o < 1e-2 and err_s < 1e-3
    print(f"\n{cfg.name}: S^T against S: o rel RMS {err_o:.1e}, final state {err_s:.1e}, state bitwise "
          f"{torch.equal(s, s_ref)}  {'OK' if ok else 'WRONG'}")
    for name, transposed in WALKS.items():
        print(f"  fused walk {name:<16} {measure(lambda: run_walk(transposed, inputs, False)):8.3f} ms", flush=True)


def offline(heads, dtype_name: str, batch_heads) -> None:
    """Both walks compiled for sm_90 (nothing run), one line each."""
    import offline_compile as oc  # it refuses the interpreter: imported only here (same folder: sys.path[0])

    compiled = []
    compile_one = oc.triton_compile

    def keep(*args, **kwargs):
        compiled.append(compile_one(*args, **kwargs))
        return compiled[-1]

    oc.triton_compile = keep
    B, H = batch_heads
    for D in heads:
        x = oc.inputs(B, 256, H, D, D, oc.DTYPES[dtype_name])
        info = seq_info(B, 256, torch.device("cpu"), None, None)
        for name, transposed in WALKS.items():
            compiled.clear()
            with oc.OfflineLaunches(["state_fwd_kernel"]) as launches:
                run_walk(transposed, (x["q"], x["k"], x["k"], x["v"], D ** -0.5, x["h0"], info), True)
            row = launches.rows[0]
            head = f"K=V={D} {dtype_name} BV={row['constexprs'].get('BV')} w{row['warps']}  {name:<16}"
            if "error" in row:
                print(f"{head} FAILED {row['error']}")
                continue
            ttgir = compiled[0].asm["ttgir"]
            dots = len(re.findall(r"ttng\.warp_group_dot ", ttgir))
            waits = collections.Counter(re.findall(r"warp_group_dot_wait .*?pendings = (\d+)", ttgir))
            print(f"{head} {oc.usage(row)}  products {dots} (+{row['mma']} mma.sync), waits by pendings "
                  f"{dict(waits)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["b8-t2048-h16-k128", "b4-t4096-h16-k128",
                                                        "b16-t2048-h8-k64"])
    parser.add_argument("--offline", action="store_true", help="compile for sm_90 instead of running")
    parser.add_argument("--heads", type=int, nargs="+", default=[64, 100, 128], help="--offline: K = V")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"), help="--offline")
    parser.add_argument("--batch-heads", type=int, nargs=2, default=[8, 16], metavar=("B", "H"),
                        help="--offline: B and H, which set the V-block (default: 8 x 16)")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny sizes")
    args = parser.parse_args()
    if args.offline:
        offline(args.heads, args.dtype, args.batch_heads)
        return 0
    if args.smoke:
        device, configs = torch.device("cpu"), [bench.dense(2, 80, 2, 32)]
    else:
        device = torch.device("cuda")
        known = {c.name: c for c in bench.CONFIGS}
        configs = [known[n] for n in args.configs]
    measure = timer(args.smoke)  # stage_times' do_bench settings (smoke: one wall-clock call)
    for cfg in configs:
        compare(cfg, device, measure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
