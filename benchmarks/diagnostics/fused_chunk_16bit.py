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

from isolated import run_cases, save, serve_case, worst_error_vs_torch

# name: (dtype, K, chunk size, {module attribute of deltatron.kernels.fused_chunk: value})
VARIANTS = {
    "bf16 as shipped": ("bfloat16", 128, 64, {}),
    "fp16 as shipped": ("float16", 128, 64, {}),
    "bf16 K=64": ("bfloat16", 64, 64, {}),
    "bf16 C=32": ("bfloat16", 128, 32, {}),
    "bf16 f32 dots in bf16": ("bfloat16", 128, 64, {"_f32_dot_dtype": "bf16"}),
    "bf16 tf32 dots": ("bfloat16", 128, 64, {"_precision": "tf32"}),
    "bf16 tf32 dots K=64": ("bfloat16", 64, 64, {"_precision": "tf32"}),
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
    for attr, value in knobs.items():
        if attr == "_f32_dot_dtype":
            value = {"bf16": lambda dt: tl.bfloat16}[value]
        elif attr == "_precision":
            value = (lambda p: lambda dt: p)(value)
        setattr(fused_chunk, attr, value)
    return worst_error_vs_torch(deltatron.fused_chunk_delta_rule, K, getattr(torch, dtype_name),
                                backward=stage == "bwd", chunk_size=chunk_size)


def main():
    if serve_case(one_case):
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = run_cases(__file__, [(name, stage) for name in VARIANTS for stage in ("fwd", "bwd")], args.jobs,
                        timeout_s=300)
    print(f"{'variant':<26}{'forward':<40}forward+backward")
    for name in VARIANTS:
        print(f"{name:<26}{results[(name, 'fwd')][:38]:<40}{results[(name, 'bwd')][:60]}")
    save(results, args.out)


if __name__ == "__main__":
    main()
