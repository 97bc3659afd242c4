"""Where the time of chunk_delta_rule and of the decode step goes: each stage timed apart.

Chunk (bf16, the benchmark's inputs): the forward's wy_fwd (A, Tinv, W, U) and both walks after it, the
fused one (the state pass with the output in it) and the plain pair (the state pass writing h and V', the
output), of which the sums count the one the forward chooses (its plan: chunk.plan_call); the backward's stages
(the state pass again, with W, U computed on chip where plan.wy_on_chip, else recompute W, U and the state
pass reading them; the reverse state pass with the local dV' fused in; dQ/dK/dW; the WY backward) and, as
"unfused:" and not in the sums, the alternatives the backward does not run (the other recompute; the local
dV' and the reverse state pass reading it, which the fused reverse pass replaced). Each stage runs on inputs
prepared by the stages before it, beside the whole forward (under no_grad, and with autograd's node) and
forward+backward through the public API. The sum of the stages against the whole call is the host and
allocation overhead (host_time.py times the host apart).

Decode (B=64, H=16, K=V=128, one token, in-place fp32 state): the public API call, the form's forward
without the API's validation and dispatch, and the API call replayed from a CUDA graph (launch cost gone).

    python tools/stage_times.py [--configs b8-t2048-h16-k128 ...] [--out FILE.json]
    python tools/stage_times.py --smoke     # CPU, interpreter, tiny sizes: does it run

Times: triton.testing.do_bench medians in ms (smoke: one wall-clock call)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["DELTATRON_BACKEND"] = "triton"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: deltatron and benchmarks

import deltatron  # noqa: E402
from benchmarks import configs as bench  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from deltatron.kernels import fused_recurrent  # noqa: E402
from deltatron.kernels.chunk import plan, plan_call  # noqa: E402
from deltatron.kernels.chunk.portable import grads, output, reverse, walk, wy, wy_bwd  # noqa: E402
from deltatron.kernels.utils import seq_info  # noqa: E402

C = 64


def timer(smoke: bool):
    """A function timing a call in ms: do_bench's median on a GPU (as the benchmark), one wall-clock call in smoke
    mode."""
    if smoke:
        def wall_ms(fn):
            fn()
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return wall_ms
    import triton

    return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def stage_calls(cfg: bench.Config, device):
    """({stage name: a call running that stage alone}, the benchmark's inputs), each stage on inputs
    prepared by the stages before it."""
    x = bench.make_inputs(cfg, device, seed=0)
    q, k, v, beta, do = (x[n].detach() for n in ("q", "k", "v", "beta", "do"))
    B, T = q.shape[:2]
    packed = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, beta, do)]
    q1, k1, v1, beta1, do1 = packed
    cu, cu_cpu = x.get("cu_seqlens"), x.get("cu_seqlens_cpu")
    info = seq_info(1, B * T, device, cu, cu_cpu) if cu is not None else seq_info(B, T, device, None, None)
    scale = q.shape[-1] ** -0.5

    tinv, w, u = wy.wy_fwd(k1, v1, beta1, info, C)
    h, v_new, _ = walk.state_fwd(k1, w, u, None, False, info, C)
    dv_local = grads.dv_local(q1, k1, do1, scale, info, C)
    dh, dv, _ = reverse.state_bwd(q1, k1, w, do1, dv_local, None, scale, False, info, C)
    _, dk_direct, dw, _ = grads.dqkw(q1, k1, v_new, h, dh, do1, dv, scale, info, C)
    on_chip = plan.wy_on_chip(k1.shape[3], v1.shape[3], info.num_seqs * k1.shape[2], k1.element_size())
    on_chip_prefix, pair_prefix = ("bwd: ", "unfused: ") if on_chip else ("unfused: ", "bwd: ")
    stages = {
        "fwd: wy_fwd (A, Tinv, W, U)": lambda: wy.wy_fwd(k1, v1, beta1, info, C),
        "fwd, fused walk: state pass + output": lambda: walk.state_output_fwd(q1, k1, w, u, scale, None, False,
                                                                              info, C),
        "fwd, plain walk: state pass (h, V')": lambda: walk.state_fwd(k1, w, u, None, False, info, C),
        "fwd, plain walk: output": lambda: output.output_fwd(q1, k1, v_new, h, scale, info, C),
        # the backward's recompute: one walk computing W, U on chip where state.wy_on_chip, else the pair
        # (the one it does not run is listed as "unfused:", out of the sums)
        f"{on_chip_prefix}state pass again, W, U on chip": lambda: walk.state_wy_fwd(k1, v1, beta1, tinv, None,
                                                                                   False, info, C),
        f"{pair_prefix}recompute W, U": lambda: wy.recompute_w_u(k1, v1, beta1, tinv, info, C),
        f"{pair_prefix}state pass again": lambda: walk.state_fwd(k1, w, u, None, False, info, C),
        "bwd: reverse state pass + local dV' (fused)": lambda: reverse.state_bwd(q1, k1, w, do1, None, None,
                                                                                  scale, False, info, C),
        "unfused: local dV'": lambda: grads.dv_local(q1, k1, do1, scale, info, C),
        "unfused: reverse state pass": lambda: reverse.state_bwd(q1, k1, w, do1, dv_local, None, scale, False,
                                                                   info, C),
        "bwd: dQ, dK, dW": lambda: grads.dqkw(q1, k1, v_new, h, dh, do1, dv, scale, info, C),
        "bwd: WY backward": lambda: wy_bwd.wy_bwd(k1, v1, beta1, tinv, dw, dv, dk_direct, info, C),
    }
    # the forward's choice (the Hopper walk, where the plan takes it, is timed by its own tools, not here)
    chosen = "fused" if plan_call(q1, k1, v1, info, needs_backward=False).walk == "portable_fused" else "plain"
    return stages, chosen, x


def api_calls(x: dict) -> dict:
    """{name: a call of the public API on the benchmark's inputs x (bench.make_inputs)}: the whole forward under
    no_grad (inference), the forward with autograd's node (training's forward: Tinv kept for the backward) and
    the whole forward+backward through torch.autograd.grad."""
    q, k, v, beta, do = (x[n].detach() for n in ("q", "k", "v", "beta", "do"))
    cu, cu_cpu = x.get("cu_seqlens"), x.get("cu_seqlens_cpu")
    kwargs = dict(cu_seqlens=cu, cu_seqlens_cpu=cu_cpu) if cu is not None else {}
    grads_of = [x[n] for n in bench.GRAD_INPUTS]

    def forward():
        with torch.no_grad():
            return deltatron.chunk_delta_rule(q, k, v, beta, **kwargs)

    return {
        "whole forward (API, no_grad)": forward,
        "whole forward (API, autograd node)": lambda: deltatron.chunk_delta_rule(*grads_of, **kwargs),
        "whole forward+backward (API)": lambda: torch.autograd.grad(
            deltatron.chunk_delta_rule(*grads_of, **kwargs)[0], grads_of, do),
    }


def stage_sums(times: dict, walk: str) -> dict:
    """The sums of a {stage name: time} dict over the stages the forward runs (its walk: stage_calls' second
    result) and over those the forward and backward run (not the "unfused:" ones)."""
    forward = ("fwd:", f"fwd, {walk} walk")
    return {"sum of forward stages": sum(t for n, t in times.items() if n.startswith(forward)),
            "sum of all stages": sum(t for n, t in times.items() if n.startswith((*forward, "bwd:")))}


def chunk_stages(cfg: bench.Config, device, measure) -> dict:
    stages, walk, x = stage_calls(cfg, device)
    times = {name: measure(fn) for name, fn in stages.items()}
    times.update({name: measure(fn) for name, fn in api_calls(x).items()})
    times.update(stage_sums(times, walk))
    return times


def decode_step(cfg: bench.Config, device, measure, smoke: bool) -> dict:
    x = bench.make_inputs(cfg, device, seed=0)
    q, k, v, beta, h = (x[n] for n in ("q", "k", "v", "beta", "h"))
    info = seq_info(cfg.B, 1, device, None, None)

    def api():
        return deltatron.fused_recurrent_delta_rule(q, k, v, beta, initial_state=h, inplace_final_state=True)

    def form():
        return fused_recurrent.forward(q, k, v, beta, cfg.K ** -0.5, h, True, info, needs_backward=False,
                                       inplace_final_state=True)

    with torch.no_grad():
        times = {"API call": measure(api), "form forward (no API)": measure(form)}
        if not smoke:
            api()  # compiled and warm before capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                api()
            times["API call replayed from a CUDA graph"] = measure(graph.replay)
    state_bytes = 8 * cfg.B * cfg.H * cfg.K * cfg.V
    times["state read+write at the benchmark's copy anchor (4.27 TB/s)"] = state_bytes / 4.27e12 * 1e3
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["b8-t2048-h16-k128", "b2-t8192-h32-k128",
                                                        "b1-t32768-h16-k128", "decode-b64-h16-k128"])
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny sizes")
    parser.add_argument("--out", help="JSON of the times")
    args = parser.parse_args()
    if args.smoke:
        # the delta rule's: grouped value heads (Hk < H) are the gated rows'
        device, configs = torch.device("cpu"), [c for c in bench.SMOKE_CONFIGS if c.Hk == c.H]
    else:
        device = torch.device("cuda")
        known = {c.name: c for c in bench.CONFIGS}
        configs = [known[n] for n in args.configs]
    measure = timer(args.smoke)
    results = {}
    for cfg in configs:
        results[cfg.name] = (decode_step(cfg, device, measure, args.smoke) if cfg.decode
                             else chunk_stages(cfg, device, measure))
        print(f"\n{cfg.name}")
        for name, ms in results[cfg.name].items():
            print(f"  {name:<62} {ms * 1e3:10.1f} us" if cfg.decode else f"  {name:<62} {ms:10.3f} ms")
    if args.out:
        write_json(Path(args.out), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
