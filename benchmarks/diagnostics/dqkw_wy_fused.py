"""The fused dQ/dK/dW + WY backward (chunk/dqkw_wy_bwd.py) against the pair it replaces (output_bwd.dqkw then
wy_bwd.wy_bwd), on the benchmark's inputs: the outputs compared (rel RMS against the pair), each timed, and
the whole forward+backward through the API with backward.FUSED_DQKW_WY off and on.

The stages' inputs are made as the backward makes them: wy_fwd (T~, W, U), the plain walk (h, V'), the
reverse state pass with the local dV' fused in (dh, dV' = dU).

    python benchmarks/diagnostics/dqkw_wy_fused.py [--configs b8-t2048-h16-k128 ...] [--out FILE.json]
                                                   [--launch BK BV STAGES]   # instead of dqkw_wy_launch's
    python benchmarks/diagnostics/dqkw_wy_fused.py --smoke     # CPU, interpreter, tiny sizes: does it run

Times: triton.testing.do_bench in ms (its default: the mean, L2 flushed before each call; smoke: one
wall-clock call). "fused agrees" is False where a rel RMS passes 4e-3 (bf16): then the times are not comparable."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["DELTATRON_BACKEND"] = "triton"

import torch  # noqa: E402

import deltatron  # noqa: E402
from deltatron import bench  # noqa: E402
from deltatron.kernels.chunk import dqkw_wy_bwd, output_bwd, state, state_bwd, wy, wy_bwd  # noqa: E402
from deltatron.kernels.utils import seq_info  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stage_times import timer  # noqa: E402

C = 64
DEFAULT_CONFIGS = ["b8-t2048-h16-k128", "b4-t4096-h16-k128", "b2-t8192-h32-k128", "b16-t2048-h8-k64",
                   "b4-t4096-h16-k256", "varlen20-t32768-h16-k128"]
backward_module = importlib.import_module("deltatron.kernels.chunk.backward")  # the package exports a function


def compare(cfg: bench.Config, device, measure) -> dict:
    x = bench.make_inputs(cfg, device, seed=0)
    q, k, v, beta, do = (x[n].detach() for n in ("q", "k", "v", "beta", "do"))
    B, T = q.shape[:2]
    q1, k1, v1, beta1, do1 = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, beta, do))
    cu, cu_cpu = x.get("cu_seqlens"), x.get("cu_seqlens_cpu")
    info = seq_info(1, B * T, device, cu, cu_cpu) if cu is not None else seq_info(B, T, device, None, None)
    scale = q.shape[-1] ** -0.5
    tinv, w, u = wy.wy_fwd(k1, v1, beta1, info, C)
    h, v_new, _ = state.state_fwd(k1, w, u, None, False, info, C)
    dh, du, _ = state_bwd.state_bwd(q1, k1, w, do1, None, None, scale, False, info, C)

    def pair():
        dq, dk_direct, dw = output_bwd.dqkw(q1, k1, v_new, h, dh, do1, du, scale, info, C)
        return (dq, *wy_bwd.wy_bwd(k1, v1, beta1, tinv, dw, du, dk_direct, info, C))

    def fused():
        return dqkw_wy_bwd.dqkw_wy_bwd(q1, k1, v1, beta1, tinv, v_new, h, dh, do1, du, scale, info, C)

    dq, dk_direct, dw = output_bwd.dqkw(q1, k1, v_new, h, dh, do1, du, scale, info, C)
    out = {f"rel RMS {name} (fused vs pair)": float((a.double() - b.double()).norm() / b.double().norm())
           for name, a, b in zip(("dq", "dk", "dv", "dbeta"), fused(), pair())}
    out["fused agrees (every rel RMS <= 4e-3)"] = all(e <= 4e-3 for e in out.values())  # NaN: False
    out["launch (BK, BV, stages)"] = list(dqkw_wy_bwd.dqkw_wy_launch(cfg.K, cfg.V))
    out["pair: dQ, dK, dW"] = measure(lambda: output_bwd.dqkw(q1, k1, v_new, h, dh, do1, du, scale, info, C))
    out["pair: WY backward"] = measure(lambda: wy_bwd.wy_bwd(k1, v1, beta1, tinv, dw, du, dk_direct, info, C))
    out["pair (both launches)"] = measure(pair)
    out["fused"] = measure(fused)
    del dq, dk_direct, dw, h, v_new, dh, du, w, u

    kwargs = dict(cu_seqlens=cu, cu_seqlens_cpu=cu_cpu) if cu is not None else {}
    grads_of = [x[n] for n in bench.GRAD_INPUTS]
    for switch in (False, True):
        backward_module.FUSED_DQKW_WY = switch
        out[f"forward+backward (API), FUSED_DQKW_WY={switch}"] = measure(lambda: torch.autograd.grad(
            deltatron.chunk_delta_rule(*grads_of, **kwargs)[0], grads_of, do))
    backward_module.FUSED_DQKW_WY = False
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny sizes")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--launch", type=int, nargs=3, metavar=("BK", "BV", "STAGES"),
                        help="the fused kernel's tiles and pipeline depth at every config")
    args = parser.parse_args()
    if args.launch:
        dqkw_wy_bwd.dqkw_wy_launch = lambda K, V: tuple(args.launch)
    if args.smoke:
        device, configs = torch.device("cpu"), [c for c in bench.SMOKE_CONFIGS if not c.decode]
    else:
        device = torch.device("cuda")
        known = {c.name: c for c in bench.CONFIGS}
        configs = [known[n] for n in args.configs]
    measure = timer(args.smoke)
    results = {}
    for cfg in configs:
        results[cfg.name] = compare(cfg, device, measure)
        print(cfg.name, flush=True)
        for name, value in results[cfg.name].items():
            print(f"  {name:<52} {value:.4g}" if isinstance(value, float) else f"  {name:<52} {value}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
