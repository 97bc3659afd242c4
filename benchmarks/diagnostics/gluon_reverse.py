"""The warp-specialized Gluon reverse state pass (kernels/chunk/gluon_reverse.py) against the Triton reverse
pass (state_bwd.state_bwd with dv_local=None, the backward's fused pass) at K = V = 128: agreement and times
on the GPU, or what triton 3.6 makes of it offline.

On the GPU, per config (transposed_walk.py's q, k, W, its random fp32 initial state as dht, a random dO),
for each V-block width of the Gluon pass (block_v 128: a program a sequence and head; 64: two): dh, dv, dh0
against the Triton pass's (relative RMS; both round dS_next, dV' and A^T to the input dtype at the same
points, so they differ by fp32 summation order), a second Gluon run bitwise equal to the first (no atomics: a
race between the partitions would show), the two widths against each other; then the Triton pass and both
widths timed as the backward runs them (dht and dh0 as with a final and an initial state), twice, interleaved;
last, the whole forward+backward through the API (the benchmark's inputs) with state_bwd's rule (GLUON_REVERSE
None) against the Gluon pass forced on (True): gradients compared, three interleaved readings each.

--offline compiles the kernel for sm_90 (per V-block width: bf16 with and without dht / dh0, fp16 with them) on
a machine without a GPU (put triton 3.6 first on PYTHONPATH) and prints ptxas's registers and spills, shared
memory, the setmaxnreg of each partition, the warp-specialize partitions of the TTGIR with their products and
waits, and the PTX barriers (gluon_walk.py's report).

    python benchmarks/diagnostics/gluon_reverse.py [--configs b8-t2048-h16-k128 b4-t4096-h16-k128]
    python benchmarks/diagnostics/gluon_reverse.py --offline [--dump DIR]
"""
from __future__ import annotations

import functools
import os
import sys

os.environ["DELTATRON_BACKEND"] = "triton"

import torch  # noqa: E402

from deltatron import bench  # noqa: E402
from deltatron.kernels.chunk import state_bwd  # noqa: E402
from deltatron.kernels.utils import num_sms, seq_info  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_walk import compiling_for_sm90, probe_main, report_compiled  # noqa: E402
from stage_configs import worst_difference as rel_rms  # noqa: E402
from switch_probe import api_fwd_bwd, fwd_bwd_agree_and_time, with_settings  # noqa: E402
from transposed_walk import walk_inputs  # noqa: E402

CONFIGS = ["b8-t2048-h16-k128", "b4-t4096-h16-k128", "b2-t8192-h32-k128", "b1-t32768-h64-k128",
           "b1-t32768-h16-k128"]


def reverse_inputs(cfg: bench.Config, device):
    """q, k, W (transposed_walk.py's forward inputs, packed), a random dO, dht (its random initial state),
    scale, info."""
    q, k, w, u, scale, dht, info = walk_inputs(cfg, device)
    do = torch.randn(u.shape, generator=torch.Generator(device).manual_seed(2), device=device).to(u.dtype)
    return q, k, w, do, dht, scale, info


def compare(cfg: bench.Config, measure) -> None:
    from deltatron.kernels.chunk import gluon_reverse, gluon_walk

    state_bwd.GLUON_REVERSE = False  # state_bwd as the Triton pass, the reference
    q, k, w, do, dht, scale, info = reverse_inputs(cfg, torch.device("cuda"))
    ref = state_bwd.state_bwd(q, k, w, do, None, dht, scale, True, info, 64)
    widths = sorted(gluon_reverse.REVERSE_CONFIGS, reverse=True)
    print(f"\n{cfg.name}: split_v chooses block_v {gluon_walk.split_v(info.num_seqs * cfg.H, num_sms(q.device))}; "
          f"state_bwd runs {'Gluon' if gluon_reverse_default(q, k, w, do, info) else 'Triton'} by default")
    results = {}
    for block_v in widths:
        out = gluon_reverse.gluon_state_bwd(q, k, w, do, dht, scale, True, info, block_v=block_v)
        again = gluon_reverse.gluon_state_bwd(q, k, w, do, dht, scale, True, info, block_v=block_v)
        same = all(torch.equal(a, b) for a, b in zip(out, again))
        errs = {n: rel_rms(a, b) for n, a, b in zip(("dh", "dv", "dh0"), out, ref)}
        finite = all(bool(torch.isfinite(a).all()) for a in out)
        ok = finite and same and max(errs.values()) < 1e-2
        print(f"  gluon reverse block_v {block_v} against the Triton pass: "
              + ", ".join(f"{n} rel RMS {e:.1e}" for n, e in errs.items())
              + f", rerun bitwise {same}  {'OK' if ok else 'WRONG'}")
        results[block_v] = out
    a, b = results[widths[0]], results[widths[-1]]
    print(f"  block_v {widths[-1]} against {widths[0]}: "
          + ", ".join(f"{n} bitwise {torch.equal(x, y)}" for n, x, y in zip(("dh", "dv", "dh0"), a, b)))
    runs = {"Triton reverse (state_bwd)": lambda: state_bwd.state_bwd(q, k, w, do, None, dht, scale, True, info, 64)}
    for block_v in widths:
        runs[f"gluon reverse, block_v {block_v}"] = functools.partial(
            gluon_reverse.gluon_state_bwd, q, k, w, do, dht, scale, True, info, block_v=block_v)
    for _ in range(2):  # interleaved, against drift
        for name, fn in runs.items():
            print(f"  {name:<32} {measure(fn):8.3f} ms", flush=True)
    # the pass alone leaves out its launch's host cost, which decided the rule's length threshold: the whole call
    print("  whole forward+backward, False: the rule (GLUON_REVERSE None), True: the Gluon pass forced")
    _, fwd_bwd, _ = api_fwd_bwd(cfg, q.device)
    fwd_bwd_agree_and_time(measure, lambda forced, fn: with_settings(
        state_bwd, dict(GLUON_REVERSE=True if forced else None), fn), fwd_bwd, "forced")


def gluon_reverse_default(q, k, w, do, info) -> bool:
    """Whether state_bwd would run the Gluon pass here with GLUON_REVERSE at its default (None)."""
    chosen, state_bwd.GLUON_REVERSE = state_bwd.GLUON_REVERSE, None
    try:
        return state_bwd.gluon_reverse_pays(q, k, w, do, None, info, 64)
    finally:
        state_bwd.GLUON_REVERSE = chosen


def offline(dump) -> int:
    """Compiles the kernel for sm_90 (nothing runs) at 8 sequences x 16 heads, per V-block width: bf16 with and
    without dht and dh0, fp16 with them, and bf16 storing dh0 alone (the reverse split's pass 1)."""
    import triton

    import offline_compile as oc  # it refuses the interpreter: imported only here
    from deltatron.kernels.chunk import gluon_reverse

    B, T, H, D = 8, 256, 16, gluon_reverse.D_WALK
    info = seq_info(B, T, torch.device("cpu"), None, None)
    # the last: the output-free pass (dh0 alone) of the backward's reverse split (reverse_split.py)
    variants = [(name, dtype, states, outputs, block_v)
                for block_v in sorted(gluon_reverse.REVERSE_CONFIGS, reverse=True)
                for name, dtype, states, outputs in [("bf16", torch.bfloat16, False, True),
                                                     ("bf16", torch.bfloat16, True, True),
                                                     ("fp16", torch.float16, True, True),
                                                     ("bf16", torch.bfloat16, True, False)]]
    with compiling_for_sm90() as compiled:
        for _, dtype, states, outputs, block_v in variants:
            x = oc.inputs(B, T, H, D, D, dtype)
            q, k = (x[n].reshape(1, B * T, H, D) for n in ("q", "k"))
            gluon_reverse.gluon_state_bwd(q, k, k, q, x["h0"] if states else None, D ** -0.5, states, info,
                                          block_v=block_v, store_outputs=outputs)
    assert len(compiled) == len(variants), f"{len(compiled)} kernels compiled for {len(variants)} launches"
    for (name, _, states, outputs, block_v), kernel in zip(variants, compiled):
        report_compiled(f"gluon_reverse_kernel {name} K=V={D} C={gluon_reverse.C_WALK} BV={block_v} "
                        f"({gluon_reverse.REVERSE_CONFIGS[block_v]}), dht/dh0 {states}"
                        f"{'' if outputs else ', dh0 alone (no dh, dv)'}", kernel, dump,
                        f"gluon_reverse_bv{block_v}_{name}_states{int(states)}{'' if outputs else '_dh0only'}")
    print(f"triton {triton.__version__}, target sm_90")
    return 0


def main() -> int:
    return probe_main(__doc__, CONFIGS, compare, offline)


if __name__ == "__main__":
    sys.exit(main())
