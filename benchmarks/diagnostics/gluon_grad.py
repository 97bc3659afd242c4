"""The warp-specialized Gluon chunk-gradient kernel (kernels/chunk/gluon_grad.py) against the pair it replaces
(output_bwd.dqkw + wy_bwd.wy_bwd) at K = V = 128: agreement and times on the GPU, or what triton 3.6 makes of it
offline.

On the GPU, per config (tests/gpu/test_gluon_grad_gpu.grad_inputs: the stage's inputs as the backward makes
them), bf16: dq, dk, dv, dbeta against the pair's (relative RMS; the kernel recomputes V' instead of reading
v_new, so they differ by roundings of the dtype), a second run bitwise equal to the first (a race between the
partitions would show); the pair and the kernel timed, twice, interleaved; then the whole forward+backward through
the API with backward.GLUON_GRAD off and on, twice, interleaved.

--offline compiles the kernel for sm_90 (bf16 and fp16) on a machine without a GPU (put triton 3.6 first on
PYTHONPATH) and prints ptxas's registers and spills, shared memory, the setmaxnreg of each partition, the
warp-specialize partitions of the TTGIR with their products and waits, and the PTX barriers (gluon_walk.py's
report).

    python benchmarks/diagnostics/gluon_grad.py [--configs b8-t2048-h16-k128 b1-t32768-h16-k128]
    python benchmarks/diagnostics/gluon_grad.py --offline [--dump DIR]
"""
from __future__ import annotations

import importlib
import os
import sys

os.environ["DELTATRON_BACKEND"] = "triton"

import torch  # noqa: E402

from deltatron import bench  # noqa: E402
from deltatron.kernels.utils import seq_info  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gluon_walk import compiling_for_sm90, probe_main, report_compiled  # noqa: E402
from stage_configs import worst_difference as rel_rms  # noqa: E402

CONFIGS = ["b8-t2048-h16-k128", "b4-t4096-h16-k128", "b2-t8192-h32-k128", "b1-t32768-h16-k128"]
backward = importlib.import_module("deltatron.kernels.chunk.backward")


def compare(cfg: bench.Config, measure) -> None:
    import deltatron
    from deltatron.kernels.chunk import gluon_grad
    from tests.gpu.test_gluon_grad_gpu import grad_inputs, pair

    x, info = grad_inputs(cfg.B, cfg.T, cfg.H, torch.bfloat16, "cuda")
    scale = cfg.K ** -0.5
    args = [x[n] for n in gluon_grad.INPUTS]
    ref = pair(x, scale, info)
    got = gluon_grad.gluon_grad(*args, scale, info, 64)
    again = gluon_grad.gluon_grad(*args, scale, info, 64)
    same = all(torch.equal(a, b) for a, b in zip(got, again))
    errs = {n: rel_rms(a, b) for n, a, b in zip(("dq", "dk", "dv", "dbeta"), got, ref)}
    ok = same and all(bool(torch.isfinite(a).all()) for a in got) and max(errs.values()) < 1e-2
    print(f"\n{cfg.name}: gluon grad against the pair: " + ", ".join(f"{n} rel RMS {e:.1e}" for n, e in errs.items())
          + f", rerun bitwise {same}  {'OK' if ok else 'WRONG'}")
    runs = {"pair (dqkw + wy_bwd)": lambda: pair(x, scale, info),
            "gluon grad": lambda: gluon_grad.gluon_grad(*args, scale, info, 64)}
    for _ in range(2):  # interleaved, against drift
        for name, fn in runs.items():
            print(f"  {name:<24} {measure(fn):8.3f} ms", flush=True)
    inputs = bench.make_inputs(cfg, torch.device("cuda"), seed=0)
    q, k, v, beta = (inputs[n].detach().requires_grad_() for n in ("q", "k", "v", "beta"))
    do = torch.randn_like(v)

    def fwd_bwd():
        o, _ = deltatron.chunk_delta_rule(q, k, v, beta, scale)
        torch.autograd.grad(o, (q, k, v, beta), do)

    try:
        for switch in (False, True) * 2:
            backward.GLUON_GRAD = switch
            print(f"  forward+backward, GLUON_GRAD {switch!s:<5} {measure(fwd_bwd):8.3f} ms", flush=True)
    finally:
        backward.GLUON_GRAD = False


def offline(dump) -> int:
    """Compiles the kernel for sm_90 (nothing runs) at 8 sequences x 16 heads, bf16 and fp16."""
    import triton

    import offline_compile as oc  # it refuses the interpreter: imported only here
    from deltatron.kernels.chunk import gluon_grad

    B, T, H, D, C = 8, 256, 16, 128, 64
    info = seq_info(B, T, torch.device("cpu"), None, None)
    NT = info.chunks(C).num_chunks
    variants = [("bf16", torch.bfloat16), ("fp16", torch.float16)]
    with compiling_for_sm90() as compiled:
        for _, dtype in variants:
            x = oc.inputs(B, T, H, D, D, dtype)
            q, k, v = (x[n].reshape(1, B * T, H, D) for n in ("q", "k", "v"))
            beta = x["beta"].reshape(1, B * T, H)
            h = torch.zeros(NT, H, D, D, dtype=dtype)
            tinv = torch.zeros(1, B * T, H, C)
            gluon_grad.gluon_grad(q, k, v, beta, tinv, h, h, v, q, D ** -0.5, info, C)
    assert len(compiled) == len(variants), f"{len(compiled)} kernels compiled for {len(variants)} launches"
    for (name, _), kernel in zip(variants, compiled):
        report_compiled(f"gluon_grad_kernel {name} K=V={D} C={C} (dQ/dK partition {gluon_grad.DQDK_WARPS} warps, "
                        f"setmaxnreg {gluon_grad.DQDK_REGS})", kernel, dump, f"gluon_grad_{name}")
    print(f"triton {triton.__version__}, target sm_90")
    return 0


def main() -> int:
    return probe_main(__doc__, CONFIGS, compare, offline)


if __name__ == "__main__":
    sys.exit(main())
