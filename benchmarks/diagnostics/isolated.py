"""Shared by the diagnostics: one case per process (an illegal memory access poisons the CUDA context, and
a later case must not inherit it), the worst error of a form's Triton run against the PyTorch backend on the
same rounded inputs, and launches forced to one warp count / pipelining depth / register cap / argument."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Dict, Sequence, Tuple

Case = Tuple[str, ...]


@contextmanager
def forced_launch(num_warps=None, num_stages=None, maxnreg=None, **arguments):
    """Every Triton launch inside runs with these num_warps / num_stages / maxnreg (None: as the code says;
    maxnreg 0: no register cap, even where the code sets one) and, in kernels that have them, these
    arguments by name (constexpr tile widths, say). The interpreter has no launch options: there only the
    arguments are forced."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    options = {name: value for name, value in
               dict(num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg).items() if value is not None}
    runs = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def forced(run):
        def launch(self, *args, **kwargs):
            args = list(args)
            for name, value in arguments.items():
                if name in self.arg_names:
                    i = self.arg_names.index(name)
                    if i < len(args):
                        args[i] = value
                    else:
                        kwargs[name] = value
            launch_options = {**kwargs, **options}
            if launch_options.get("maxnreg") == 0:
                del launch_options["maxnreg"]
            return run(self, *args, **launch_options)
        return launch

    for cls, run in runs.items():
        cls.run = forced(run)
    try:
        yield
    finally:
        for cls, run in runs.items():
            cls.run = run


def worst_error_vs_torch(fn: Callable, K: int, dtype, backward: bool = True, **kwargs) -> str:
    """fn(q, k, v, beta, initial_state=..., output_final_state=True, **kwargs) at B=2, T=1000, H=4, K=V,
    on the Triton backend against the PyTorch backend: the worst relative RMS error over o, the final state
    and (backward) the five gradients, formatted, or "nan"."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(K)
    B, T, H = 2, 1000, 4

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    q, k, v = randn(B, T, H, K), torch.nn.functional.normalize(randn(B, T, H, K), dim=-1), randn(B, T, H, K)
    beta = torch.rand(B, T, H, device="cuda", generator=g)
    h0, do, dht = randn(B, H, K, K), randn(B, T, H, K), randn(B, H, K, K)

    def run(backend):
        os.environ["DELTATRON_BACKEND"] = backend
        xs = [x.to(dtype).requires_grad_(backward) for x in (q, k, v, beta)] + [h0.clone().requires_grad_(backward)]
        o, s = fn(*xs[:4], initial_state=xs[4], output_final_state=True, **kwargs)[:2]
        if not backward:
            return [o, s]
        return [o, s, *torch.autograd.grad((o.float() * do).sum() + (s * dht).sum(), xs)]

    got = run("triton")
    torch.cuda.synchronize()  # an asynchronous kernel fault surfaces here, as the case's error
    ref = run("torch")
    errs = [float((a.double() - b.double()).norm() / b.double().norm()) for a, b in zip(got, ref)]
    return f"{max(errs):.1e}" if all(e == e for e in errs) else "nan"


def serve_case(one_case: Callable[..., str]) -> bool:
    """In a case's process (argv: script --case ARG...): prints "RESULT <outcome>" and returns True."""
    if len(sys.argv) < 2 or sys.argv[1] != "--case":
        return False
    try:
        print("RESULT", one_case(*sys.argv[2:]))
    except Exception as e:  # the outcome of the case, reported in the table
        print("RESULT", type(e).__name__ + ": " + str(e).splitlines()[0][:70])
    return True


def run_cases(script: str, cases: Sequence[Case], jobs: int, timeout_s: int = 400) -> Dict[Case, str]:
    """Runs `python script --case *case` for every case, jobs at a time: {case: outcome}."""
    def launch(case):
        try:
            p = subprocess.run([sys.executable, script, "--case", *case], capture_output=True, text=True,
                               timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return case, "timeout"
        lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT")]
        return case, lines[-1][7:] if lines else f"crash rc={p.returncode} {p.stderr.strip()[-80:]}"

    with ThreadPoolExecutor(jobs) as pool:
        return dict(pool.map(launch, cases))


def save(results: Dict[Case, str], path) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"|".join(case): outcome for case, outcome in results.items()}, f, indent=1)
