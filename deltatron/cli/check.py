"""`deltatron check`: every implementation and backend on this device against the float64 recurrence.

For each entry point, backend, dtype and shape: relative RMS error (DESIGN.md §6) of o, the final state and
the five gradients against the float64 recurrent oracle run on the same rounded inputs, and the time of one
forward+backward (the first call of its kind: Triton's compilation is included, so this is no benchmark).
The exit code is 1 if any error exceeds its bound or is not finite, 2 on a bad option.

Without a CUDA device the Triton kernels run in Triton's interpreter on small shapes: unless TRITON_INTERPRET
is set, this command sets TRITON_INTERPRET=1 before the kernels are first imported."""
from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .. import api
from ..reference import recurrent_delta_rule
from . import fail, parse_device

BOUNDS = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
ENTRY_POINTS = {
    "chunk": api.chunk_delta_rule,
    "fused_chunk": api.fused_chunk_delta_rule,
    "fused_recurrent": api.fused_recurrent_delta_rule,
    "parallel": api.parallel_delta_rule,
}
QUANTITIES = ("o", "state", "dq", "dk", "dv", "dbeta", "dh0")
# The default matrix on a GPU, where Triton compiles every form and dtype on first use (fp32 forms take about
# a minute each to compile): two forms in 16-bit on one fixed-length and one packed case. --full runs it all.
QUICK_FORMS = ("chunk", "fused_recurrent")
QUICK_GPU_DTYPES = (torch.float16, torch.bfloat16)
INTERPRETER_NOTE = "no CUDA device: the Triton kernels run in Triton's interpreter on small shapes"


@dataclass
class Case:
    B: int
    H: int
    K: int
    V: int
    lengths: Optional[List[int]] = None  # packed sequences (B = 1) when given
    T: int = 0
    dtypes: Optional[Tuple[torch.dtype, ...]] = None  # only these dtypes (None: every one asked for)

    def __post_init__(self):
        if self.lengths is not None:
            self.T = sum(self.lengths)

    def describe(self) -> str:
        seqs = f"varlen{self.lengths}" if self.lengths is not None else f"B={self.B} T={self.T}"
        return f"{seqs} H={self.H} K={self.K} V={self.V}"


def cases_for(device: torch.device, interpret: bool, full: bool = True) -> List[Case]:
    if device.type == "cuda":
        # Most of the time on a GPU is Triton compiling each form on first use (on the H200, 30-80 s per form
        # in fp32), once per head size: the fixed-length and the packed case share theirs. 16-wide heads
        # (deltatron train's CPU preset, where the fused WY kernel once went wrong in bf16) in 16-bit only,
        # to spare fp32's compilations. The quick matrix takes the first two.
        cases = [Case(2, 4, 128, 64, T=1000), Case(1, 4, 128, 64, lengths=[0, 1, 63, 65, 700, 300]),
                 Case(4, 4, 16, 16, T=300, dtypes=(torch.float16, torch.bfloat16))]
        return cases if full else cases[:2]
    if interpret:  # the interpreter is slow: tiny shapes
        return [Case(1, 2, 16, 24, T=40), Case(1, 2, 16, 16, lengths=[0, 1, 17, 22])]
    return [Case(2, 2, 32, 24, T=100), Case(1, 2, 32, 32, lengths=[0, 1, 63, 65, 30])]


def _inputs(case: Case, dtype, device, gen):
    B, T, H, K, V = case.B, case.T, case.H, case.K, case.V
    N = B if case.lengths is None else len(case.lengths)
    k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    x = dict(
        q=torch.randn(B, T, H, K, generator=gen, dtype=torch.float64),
        k=k / k.norm(dim=-1, keepdim=True),
        v=torch.randn(B, T, H, V, generator=gen, dtype=torch.float64),
        beta=torch.rand(B, T, H, generator=gen, dtype=torch.float64),
        initial_state=torch.randn(N, H, K, V, generator=gen, dtype=torch.float64),
    )
    ours = {n: t.to(device, torch.float32 if n == "initial_state" else dtype).requires_grad_() for n, t in x.items()}
    oracle = {n: t.detach().to("cpu", torch.float64).requires_grad_() for n, t in ours.items()}
    weights = dict(o=torch.randn(B, T, H, V, generator=gen, dtype=torch.float64),
                   state=torch.randn(N, H, K, V, generator=gen, dtype=torch.float64))
    return ours, oracle, weights


def _loss_and_grads(o, s, weights, inputs):
    loss = (o.double() * weights["o"].to(o.device)).sum() + (s.double() * weights["state"].to(s.device)).sum()
    names = ("q", "k", "v", "beta", "initial_state")
    grads = torch.autograd.grad(loss, [inputs[n] for n in names])
    return dict(o=o, state=s, **{q: g for q, g in zip(QUANTITIES[2:], grads)})


def _rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def run_checks(device: torch.device, backend_names, dtypes, seed: int = 0, printer=print, forms=None,
               full: bool = True) -> bool:
    """Prints a table of errors, one row per entry point, backend, dtype and case; True if every row passes.
    forms: names of ENTRY_POINTS to run (default all); full: every case (else the quick ones)."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    forms = list(ENTRY_POINTS) if forms is None else list(forms)
    gen = torch.Generator().manual_seed(seed)
    header = f"{'implementation':<16}{'backend':<8}{'dtype':<6}{'shape':<50}" + "".join(
        f"{q:>9}" for q in QUANTITIES) + f"{'1st ms':>9}  result"
    printer(header)
    printer("-" * len(header))
    ok = True
    compiled = set()  # (form, dtype) already run by the Triton backend on the GPU
    for case in cases_for(device, interpret, full):
        for dtype in (d for d in dtypes if case.dtypes is None or d in case.dtypes):
            ours, oracle, weights = _inputs(case, dtype, device, gen)
            cu = None
            if case.lengths is not None:
                cu = torch.tensor([0, *case.lengths]).cumsum(0)
            scale = case.K ** -0.5
            o_ref, s_ref = recurrent_delta_rule(oracle["q"], oracle["k"], oracle["v"], oracle["beta"], scale,
                                                oracle["initial_state"], True, cu_seqlens=cu)
            ref = _loss_and_grads(o_ref, s_ref, weights, oracle)
            for backend in backend_names:
                os.environ["DELTATRON_BACKEND"] = backend
                for name in forms:
                    fn = ENTRY_POINTS[name]
                    if backend == "triton" and device.type == "cuda" and (name, dtype) not in compiled:
                        compiled.add((name, dtype))
                        printer(f"compiling {name} {DTYPE_NAMES[dtype]} (first use)...")
                    line = f"{name:<16}{backend:<8}{DTYPE_NAMES[dtype]:<6}{case.describe():<50}"
                    try:
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        o, s = fn(**ours, output_final_state=True,
                                  cu_seqlens=None if cu is None else cu.to(device))[:2]
                        got = _loss_and_grads(o, s, weights, ours)
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        ms = (time.perf_counter() - t0) * 1e3
                    except Exception as e:  # a broken row fails the check without hiding the others
                        ok = False
                        printer(line + f"  FAIL: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                        continue
                    errs = [_rel_rms(got[q], ref[q]) for q in QUANTITIES]
                    passed = all(e <= BOUNDS[dtype] for e in errs)  # inf/nan never pass
                    ok &= passed
                    printer(line + "".join(f"{e:>9.1e}" for e in errs) + f"{ms:>9.1f}  "
                            + ("ok" if passed else f"FAIL (bound {BOUNDS[dtype]:.0e})"))
    return ok


def matrix(device: torch.device, full: bool, dtype: Optional[str] = None) -> Tuple[Tuple[str, ...], List[torch.dtype]]:
    """(forms, dtypes) to check: on a GPU without --full the quick matrix (QUICK_FORMS in QUICK_GPU_DTYPES),
    else every form and dtype; --dtype (fp32, fp16, bf16 or all) replaces the dtypes."""
    quick = device.type == "cuda" and not full
    if dtype is not None:
        dtypes = [d for d, n in DTYPE_NAMES.items() if dtype in (n, "all")]
    else:
        dtypes = list(QUICK_GPU_DTYPES) if quick else list(DTYPE_NAMES)
    return (QUICK_FORMS if quick else tuple(ENTRY_POINTS)), dtypes


def use_interpreter_without_cuda(environ=os.environ) -> bool:
    """Sets TRITON_INTERPRET=1 when there is no CUDA device, Triton is installed, the variable is unset and no
    kernel module is loaded yet (deltatron.kernels reads it once, on import). True if it set it."""
    if torch.cuda.is_available() or "TRITON_INTERPRET" in environ or importlib.util.find_spec("triton") is None:
        return False
    if any(m == "deltatron.kernels" or m.startswith("deltatron.kernels.") for m in sys.modules):
        return False
    environ["TRITON_INTERPRET"] = "1"
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="deltatron check", description=__doc__.splitlines()[0],
        epilog="Default matrix: on a GPU the chunk and fused_recurrent forms in fp16 and bf16 on one fixed-length "
               "and one packed case (about a minute with an empty Triton cache); on the CPU every form and dtype "
               "on two small cases. --full: every form, dtype and case (on a GPU several minutes of compilation "
               "with an empty cache: fp32 forms compile for about a minute each).")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument("--backend", choices=["torch", "triton", "all"], default="all",
                        help="which backends to run (default: every one available on the device)")
    parser.add_argument("--dtype", choices=["fp32", "fp16", "bf16", "all"], default=None,
                        help="input dtype to check (default: the matrix's; all: fp32, fp16 and bf16)")
    parser.add_argument("--full", action="store_true",
                        help="every form, dtype and case, not the quick matrix (matters on a GPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    args = parser.parse_args(argv)

    try:
        device = parse_device(args.device)
    except ValueError as e:
        return fail("check", str(e))
    if device.type == "cpu" and args.backend != "torch" and use_interpreter_without_cuda():
        print(INTERPRETER_NOTE)
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    triton_ok = importlib.util.find_spec("triton") is not None and (device.type == "cuda" or interpret)
    names = ["torch", "triton"] if args.backend == "all" else [args.backend]
    if "triton" in names and not triton_ok:
        if args.backend == "triton":
            return fail("check", "--backend triton needs triton installed and a CUDA device, or TRITON_INTERPRET=1 "
                                 "to run the kernels in Triton's interpreter on the CPU")
        names.remove("triton")
    forms, dtypes = matrix(device, args.full, args.dtype)
    quick_gpu = device.type == "cuda" and not args.full
    saved = os.environ.get("DELTATRON_BACKEND")
    try:
        on = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        if interpret and device.type == "cpu" and "triton" in names:
            on += " (Triton interpreter)"
        quick = " (the quick matrix; --full runs every form, dtype and case)" if quick_gpu else ""
        bounds = ", ".join(f"{DTYPE_NAMES[d]} {b:.0e}" for d, b in BOUNDS.items() if d in dtypes)
        print(f"deltatron check on {on}; backends: {', '.join(names)}; forms: {', '.join(forms)}{quick}; "
              f"relative RMS error vs the float64 recurrence; bounds {bounds}"
              "; 1st ms: the first forward+backward, compilation included", flush=True)
        ok = run_checks(device, names, dtypes, seed=args.seed, printer=functools.partial(print, flush=True),
                        forms=forms, full=not quick_gpu)
    finally:
        if saved is None:
            os.environ.pop("DELTATRON_BACKEND", None)
        else:
            os.environ["DELTATRON_BACKEND"] = saved
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1
