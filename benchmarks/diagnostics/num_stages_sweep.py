"""Which software-pipelining depths (num_stages) give correct results for each Triton form on this GPU.

Every Triton launch of a form is forced to one num_stages; forward + backward at a small shape are compared
with the PyTorch backend in fp32 on the same inputs. Each case runs in its own process (an illegal memory
access poisons the CUDA context). Prints a table: form, K, dtype, then per depth the worst relative RMS
error over o, final state and the five gradients, or the exception.

    python benchmarks/diagnostics/num_stages_sweep.py [--jobs 14]
"""
import argparse
import itertools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

FORMS = ["chunk", "fused_chunk", "fused_recurrent", "parallel"]
HEAD_SIZES = [64, 128, 256]
DTYPES = ["bfloat16", "float32"]
STAGES = [1, 2, 3, 0]  # 0: the code's own choice


def one_case(form: str, K: int, dtype_name: str, stages: int) -> str:
    import torch
    import triton

    import deltatron

    if stages:
        run = triton.runtime.jit.JITFunction.run

        def forced(self, *args, **kwargs):
            kwargs["num_stages"] = stages
            return run(self, *args, **kwargs)

        triton.runtime.jit.JITFunction.run = forced
    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device="cuda").manual_seed(K)
    B, T, H = 2, 1000, 4
    q = torch.randn(B, T, H, K, device="cuda", generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1)
    v = torch.randn(B, T, H, K, device="cuda", generator=g)
    beta = torch.rand(B, T, H, device="cuda", generator=g)
    h0 = torch.randn(B, H, K, K, device="cuda", generator=g)
    do = torch.randn(B, T, H, K, device="cuda", generator=g)
    dht = torch.randn(B, H, K, K, device="cuda", generator=g)
    fn = getattr(deltatron, f"{form}_delta_rule")

    def run_form(backend, dt):
        os.environ["DELTATRON_BACKEND"] = backend
        xs = [x.to(dt).requires_grad_() for x in (q, k, v, beta)] + [h0.clone().requires_grad_()]
        o, s = fn(*xs[:4], initial_state=xs[4], output_final_state=True)[:2]
        grads = torch.autograd.grad((o.float() * do).sum() + (s * dht).sum(), xs)
        return [o, s, *grads]

    got = run_form("triton", dtype)
    ref = run_form("torch", dtype)  # same rounded inputs, fp32 arithmetic
    errs = [float((a.double() - b.double()).norm() / b.double().norm()) for a, b in zip(got, ref)]
    return f"{max(errs):.1e}" if all(e == e for e in errs) else "nan"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        form, K, dt, st = sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
        try:
            print("RESULT", one_case(form, K, dt, st))
        except Exception as e:  # reported in the table
            print("RESULT", type(e).__name__ + ": " + str(e).splitlines()[0][:60])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=14)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cases = list(itertools.product(FORMS, HEAD_SIZES, DTYPES, STAGES))

    def launch(case):
        form, K, dt, st = case
        try:
            p = subprocess.run([sys.executable, __file__, "--case", form, str(K), dt, str(st)], capture_output=True,
                               text=True, timeout=400)
            lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
            return case, lines[-1][7:] if lines else f"crash rc={p.returncode} {p.stderr.strip()[-80:]}"
        except subprocess.TimeoutExpired:
            return case, "timeout"

    with ThreadPoolExecutor(args.jobs) as pool:
        results = dict(pool.map(launch, cases))
    print(f"{'form':<16}{'K':>4} {'dtype':<9}" + "".join(f"{'stages=' + (str(s) if s else 'own'):<26}" for s in STAGES))
    for form, K, dt in itertools.product(FORMS, HEAD_SIZES, DTYPES):
        print(f"{form:<16}{K:>4} {dt:<9}" + "".join(f"{results[(form, K, dt, s)][:25]:<26}" for s in STAGES))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"|".join(map(str, k)): v for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
