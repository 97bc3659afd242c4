"""Which software-pipelining depths (num_stages) give correct results for each Triton form on this GPU.

Every Triton launch of a form is forced to one num_stages; forward + backward at a small shape are compared
with the PyTorch backend in fp32 on the same inputs. Each case runs in its own process (an illegal memory
access poisons the CUDA context). Prints a table: form, K, dtype, then per depth the worst relative RMS
error over o, final state and the five gradients, or the exception.

    python benchmarks/diagnostics/num_stages_sweep.py [--jobs 14] [--out FILE]
"""
import argparse
import itertools

from isolated import forced_launch, run_cases, save, serve_case, worst_error_vs_torch

FORMS = ["chunk", "fused_chunk", "fused_recurrent", "parallel"]
HEAD_SIZES = [64, 128, 256]
DTYPES = ["bfloat16", "float32"]
STAGES = [1, 2, 3, 0]  # 0: the code's own choice


def one_case(form: str, K: str, dtype_name: str, stages: str) -> str:
    import torch

    import deltatron

    with forced_launch(num_stages=int(stages) or None):
        return worst_error_vs_torch(getattr(deltatron, f"{form}_delta_rule"), int(K), getattr(torch, dtype_name))


def main():
    if serve_case(one_case):
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=14)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cases = [tuple(map(str, c)) for c in itertools.product(FORMS, HEAD_SIZES, DTYPES, STAGES)]
    results = run_cases(__file__, cases, args.jobs)
    print(f"{'form':<16}{'K':>4} {'dtype':<9}" + "".join(f"{'stages=' + (str(s) if s else 'own'):<26}" for s in STAGES))
    for form, K, dt in itertools.product(FORMS, HEAD_SIZES, DTYPES):
        print(f"{form:<16}{K:>4} {dt:<9}" + "".join(f"{results[(form, str(K), dt, str(s))][:25]:<26}" for s in STAGES))
    save(results, args.out)


if __name__ == "__main__":
    main()
