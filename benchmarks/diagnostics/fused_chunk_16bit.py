"""Which compile-time choice breaks fused_chunk's 16-bit kernels on this GPU.

fused_chunk in bf16 gave illegal memory accesses or garbage on the H200 (triton 3.6) while the interpreter
ran it right, and shipped refusing 16-bit GPU inputs until this diagnostic found the cause: tf32 precision
of its fp32 x fp32 dots (it now runs them in ieee for bf16). Each variant changes one knob of the launch
(operand dtype of the fp32 x fp32 dots, their precision, warps, pipelining depth, chunk size, head size)
and runs forward, then forward + backward, against the PyTorch backend on the same rounded inputs. Each
variant runs in its own process (an illegal memory access poisons the CUDA context).

    python benchmarks/diagnostics/fused_chunk_16bit.py [--jobs 4] [--out FILE]
"""
import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

# name: (dtype, K, chunk size, {module attribute of deltatron.kernels.fused_chunk: value})
VARIANTS = {
    "bf16 as shipped": ("bfloat16", 128, 64, {}),
    "fp16 as shipped": ("float16", 128, 64, {}),
    "bf16 K=64": ("bfloat16", 64, 64, {}),
    "bf16 C=32": ("bfloat16", 128, 32, {}),
    "bf16 f32 dots in bf16": ("bfloat16", 128, 64, {"_f32_dot_dtype": "bf16"}),
    "bf16 tf32 dots": ("bfloat16", 128, 64, {"_precisions": ("tf32", "ieee")}),
    "bf16 tf32 dots K=64": ("bfloat16", 64, 64, {"_precisions": ("tf32", "ieee")}),
    "bf16 4 warps": ("bfloat16", 128, 64, {"NUM_WARPS": 4}),
    "bf16 1 stage": ("bfloat16", 128, 64, {"PIPELINE_STAGES": 1}),
    "bf16 3 stages": ("bfloat16", 128, 64, {"PIPELINE_STAGES": 3}),
    "fp32 as shipped": ("float32", 128, 64, {}),
}


def one_case(name: str, stage: str) -> str:
    import torch
    import triton.language as tl

    import deltatron
    from deltatron.kernels import fused_chunk

    dtype_name, K, chunk_size, knobs = VARIANTS[name]
    dtype = getattr(torch, dtype_name)
    for attr, value in knobs.items():
        if attr == "_f32_dot_dtype":
            value = {"bf16": lambda dt: tl.bfloat16}[value]
        elif attr == "_precisions":
            value = (lambda p: lambda dt: p)(value)
        setattr(fused_chunk, attr, value)
    g = torch.Generator(device="cuda").manual_seed(K)
    B, T, H = 2, 1000, 4
    q = torch.randn(B, T, H, K, device="cuda", generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1)
    v = torch.randn(B, T, H, K, device="cuda", generator=g)
    beta = torch.rand(B, T, H, device="cuda", generator=g)
    h0 = torch.randn(B, H, K, K, device="cuda", generator=g)
    do = torch.randn(B, T, H, K, device="cuda", generator=g)
    dht = torch.randn(B, H, K, K, device="cuda", generator=g)

    def run_form(backend):
        os.environ["DELTATRON_BACKEND"] = backend
        xs = [x.to(dtype).requires_grad_(stage == "bwd") for x in (q, k, v, beta)]
        xs.append(h0.clone().requires_grad_(stage == "bwd"))
        o, s = deltatron.fused_chunk_delta_rule(*xs[:4], initial_state=xs[4], output_final_state=True,
                                                chunk_size=chunk_size)
        if stage == "fwd":
            return [o, s]
        return [o, s, *torch.autograd.grad((o.float() * do).sum() + (s * dht).sum(), xs)]

    got = run_form("triton")
    torch.cuda.synchronize()
    ref = run_form("torch")
    errs = [float((a.double() - b.double()).norm() / b.double().norm()) for a, b in zip(got, ref)]
    return f"{max(errs):.1e}" if all(e == e for e in errs) else "nan"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        try:
            print("RESULT", one_case(sys.argv[2], sys.argv[3]))
        except Exception as e:  # reported in the table
            print("RESULT", type(e).__name__ + ": " + str(e).splitlines()[0][:70])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cases = [(name, stage) for name in VARIANTS for stage in ("fwd", "bwd")]

    def launch(case):
        try:
            p = subprocess.run([sys.executable, __file__, "--case", *case], capture_output=True, text=True,
                               timeout=300)
            lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
            return case, lines[-1][7:] if lines else f"crash rc={p.returncode} {p.stderr.strip()[-80:]}"
        except subprocess.TimeoutExpired:
            return case, "timeout"

    with ThreadPoolExecutor(args.jobs) as pool:
        results = dict(pool.map(launch, cases))
    print(f"{'variant':<26}{'forward':<40}forward+backward")
    for name in VARIANTS:
        print(f"{name:<26}{results[(name, 'fwd')][:38]:<40}{results[(name, 'bwd')][:60]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"|".join(k): v for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
