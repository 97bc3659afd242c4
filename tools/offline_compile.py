"""Every Triton launch of the four forms (forward and backward), compiled for the H200 (sm_90) on a machine
without a GPU: catches compile errors and shared-memory overflows before a device call, and shows what
each kernel costs in registers, spills and shared memory and whether its dots became Hopper's wgmma.

The forms' host code runs on CPU tensors; each kernel launch is intercepted and compiled (not run) with
the same specialization a GPU launch would get, by whatever triton is importable (the H200 has 3.6: put a
`pip install --target DIR triton==3.6.0` first on PYTHONPATH to compile with it). Results are garbage
(nothing runs), so a host step that reads them is not meaningful; the kernels are what is looked at.

    python tools/offline_compile.py [--dtype bf16] [--heads 64 128 256] [--forms chunk ...]
        [--kernels wy_kernel ...] [--gated | --kda] [--hopper] [--sass-lines N]

--kda compiles KDA's per-channel gate (g [B, T, H, K]) instead of the per-head one: the chunk form's USE_GK stages,
forward and backward, and the fused_recurrent kernels' USE_GK.

--hopper plans the chunk form with the Hopper Gluon walk and reverse pass forced (16-bit, K = V = 128; --gated and
--key-heads for their variants of both) and compiles those kernels too, from their Gluon source: with the
GPU's triton 3.6 first on PYTHONPATH (the Gluon API differs in other versions).

--traceback prints a failed compile's whole traceback (the table keeps its first line, which for an error inside a
nested jit function names only the outermost call).

--sass-lines N also lists, per compiled kernel, the N source lines with the most SASS instructions (nvdisasm's
line table) and their commonest opcodes. A kernel without loops over chunks or tiles (the WY forward) runs each
instruction about once a program, so the count is close to the work a program issues: for the WY forward it shows the
products' operand conversions and the inverse's masks and block reshapes there, not the products themselves.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("offline_compile.py compiles real kernels: run it without TRITON_INTERPRET=1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

try:  # the Gluon kernels (hopper/) compile from their own AST source
    from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
except ImportError:
    GluonASTSource = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's deltatron

from deltatron.kernels import chunk, fused_chunk, fused_recurrent, parallel  # noqa: E402
from deltatron.kernels.chunk import plan  # noqa: E402
from deltatron.kernels.utils import seq_info  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
H200_SMS = 132
SHARED_LIMIT = 232448  # bytes of shared memory a block may use on sm_90
SM_REGISTERS, SM_SHARED, SM_WARPS, SM_BLOCKS = 65536, 233472, 64, 32  # an sm_90 SM's resources
FORMS = {"chunk": chunk, "fused_chunk": fused_chunk, "fused_recurrent": fused_recurrent, "parallel": parallel}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def install_stand_in_driver(launch, fill_tma_descriptor, stream: int = 0) -> None:
    """Makes triton's active driver answer as device 0 of an H200 on a machine without a GPU (target sm_90,
    SHARED_LIMIT, H200_SMS, the given stream), so that kernels compile for sm_90 and every Python step of a
    launch runs as on the GPU host; only the generated launcher's C `launch` and the driver's
    `fill_tma_descriptor` are replaced, by the callables given (tests/kernels/test_launch.py records their
    arguments, host_bwd_cpu.py counts the launches). For triton 3.6's CUDA driver."""
    from triton.backends.nvidia import driver as nvidia_driver
    from triton.runtime import driver

    class StandIn:
        launcher_cls = nvidia_driver.CudaLauncher

        def __init__(self):
            self.utils = types.SimpleNamespace(
                load_binary=lambda name, kernel, shared, device: (1, 2, 0, 0, 1024),
                get_device_properties=lambda device: dict(max_shared_mem=SHARED_LIMIT,
                                                          multiprocessor_count=H200_SMS),
                fill_tma_descriptor=fill_tma_descriptor)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return stream

        def get_current_target(self):
            return H200

    nvidia_driver.compile_module_from_src = lambda **kw: types.SimpleNamespace(launch=launch)
    nvidia_driver.library_dirs = lambda: []  # (it looks for libcuda)
    driver.set_active(StandIn())


class OfflineLaunches:
    """While active, a Triton launch compiles its kernel for sm_90 instead of running it; one row per
    distinct compilation."""

    def __init__(self, kernels=None, sass_lines=0, traceback=False):
        self.backend = make_backend(H200)
        self.kernels = kernels  # names of the kernels to compile (None: all)
        self.sass_lines = sass_lines  # source lines to list by SASS instructions (0: none)
        self.traceback = traceback  # print a failed compile's traceback
        self.rows, self.seen = [], set()

    def __enter__(self):
        self.run = JITFunction.run
        offline = self

        def compile_instead(fn, *args, grid, warmup, **kwargs):
            offline.compile(fn, args, kwargs)

        JITFunction.run = compile_instead
        return self

    def __exit__(self, *exc):
        JITFunction.run = self.run

    def compile(self, fn: JITFunction, args, kwargs):
        if self.kernels is not None and fn.__name__ not in self.kernels:
            return
        binder = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound, specialization, options)
        key = (fn.__name__, repr(sorted(signature.items())), repr(sorted(constexprs.items(), key=str)),
               options.num_warps, options.num_stages, options.maxnreg)
        if key in self.seen:
            return
        self.seen.add(key)
        named = {fn.arg_names[path[0]]: value for path, value in constexprs.items()
                 if len(path) == 1 and isinstance(value, (int, str)) and not isinstance(value, bool)}
        row = dict(kernel=fn.__name__, constexprs=named, warps=options.num_warps, stages=options.num_stages,
                   maxnreg=options.maxnreg)
        start = time.perf_counter()
        try:
            gluon = GluonASTSource is not None and getattr(fn, "is_gluon", lambda: False)()
            source = (GluonASTSource if gluon else triton.compiler.ASTSource)(fn, signature, constexprs, attrs)
            compiled = triton_compile(source, target=H200, options=options.__dict__)
        except Exception as e:  # reported: a compile failure is what this tool is for
            row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            if self.traceback:
                traceback.print_exc()
        else:
            ptx = compiled.asm["ptx"]
            md = compiled.metadata
            row.update(**ptxas_usage(ptx), shared=md.shared, wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                       mma=len(re.findall(r"\bmma\.sync", ptx)))
            row["blocks"] = blocks_per_sm(row["regs"], md.shared, options.num_warps)
            if self.sass_lines:
                row["sass"] = sass_by_line(compiled.asm["cubin"])
            if md.shared > SHARED_LIMIT:
                row.update(error=f"shared memory {md.shared} > {SHARED_LIMIT}")
        row["seconds"] = time.perf_counter() - start
        self.rows.append(row)


def ptxas_usage(ptx: str) -> dict:
    """Registers per thread and spilled bytes of the kernel, from `ptxas -v` (the first of triton's own
    ptxas binaries that accepts this PTX version)."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        for name in ("ptxas", "ptxas-blackwell"):
            out = subprocess.run([os.path.join(bin_dir, name), "-v", "--gpu-name", "sm_90a", f.name, "-o",
                                  os.devnull], capture_output=True, text=True).stderr
            regs = re.search(r"Used (\d+) registers", out)
            if regs:
                spills = re.search(r"(\d+) bytes spill stores", out)
                return dict(regs=int(regs.group(1)), spills=int(spills.group(1)) if spills else 0)
    return dict(regs=-1, spills=-1)


def sass_by_line(cubin: bytes) -> dict:
    """{(file, line): Counter of opcodes} of the kernel's SASS, from nvdisasm's line table (triton's own nvdisasm;
    triton compiles with line info unless TRITON_DISABLE_LINE_INFO is set)."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", "-g", f.name], capture_output=True, text=True, check=True).stdout
    lines, where = collections.defaultdict(collections.Counter), ("?", 0)
    for text in sass.splitlines():
        source = re.search(r'//## File "([^"]+)", line (\d+)', text)
        if source:
            where = (os.path.basename(source.group(1)), int(source.group(2)))
            continue
        op = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", text)
        if op:
            lines[where][op.group(1)] += 1
    return lines


def print_sass_lines(lines: dict, top: int) -> None:
    total = sum(sum(ops.values()) for ops in lines.values())
    print(f"    {total} SASS instructions; the {top} source lines with the most:")
    for (name, line), ops in sorted(lines.items(), key=lambda kv: -sum(kv[1].values()))[:top]:
        mix = " ".join(f"{op} {n}" for op, n in ops.most_common(5))
        print(f"    {sum(ops.values()):>6}  {name}:{line:<5} {mix}")


def blocks_per_sm(regs: int, shared: int, warps: int) -> int:
    """Blocks of one kernel an sm_90 SM holds at once, by registers (allocated per warp, a thread's
    rounded up to 8), shared memory (1 KiB of it reserved per block) and warps."""
    warps_by_regs = SM_REGISTERS // (32 * -(-regs // 8) * 8)
    return min(warps_by_regs // warps, SM_SHARED // (shared + 1024), SM_WARPS // warps, SM_BLOCKS)


def usage(row: dict) -> str:
    return (f"regs {row['regs']:>3}  spills {row['spills']:>5}  shared {row['shared']:>6}  "
            f"blocks/SM {row['blocks']}")


def pretend_h200_plans(gluon: bool = False) -> None:
    """The chunk form plans its calls as on the H200 (sm_90, H200_SMS SMs: the launches' V-blocks depend on the SM
    count), with the Hopper Gluon stages only where gluon is set: every module of deltatron.kernels.chunk that took
    plan.device_capabilities answers so."""
    caps = plan.Capabilities("sm_90 (offline compile)", cuda=True, interpret=False, sm=(9, 0), num_sms=H200_SMS,
                             gluon=gluon, shared_memory=plan.NAMED_GPUS["sm90"][2])
    for name, module in list(sys.modules.items()):
        if name.startswith(chunk.__name__) and getattr(module, "device_capabilities", None) is not None:
            module.device_capabilities = lambda device: caps


def inputs(B, T, H, K, V, dtype, key_heads=None):
    g = torch.Generator().manual_seed(0)
    Hk = key_heads or H
    x = {n: torch.randn(*shape, generator=g).to(dtype) for n, shape in
         dict(q=(B, T, Hk, K), k=(B, T, Hk, K), v=(B, T, H, V), do=(B, T, H, V)).items()}
    x["beta"] = torch.rand(B, T, H, generator=g).to(dtype)
    x["h0"] = torch.randn(B, H, K, V, generator=g)
    x["g"] = -torch.nn.functional.softplus(torch.randn(B, T, H, generator=g))  # the gated rule's log decays
    x["gk"] = -torch.nn.functional.softplus(torch.randn(B, T, H, K, generator=g))  # KDA's, per key channel
    return x


def run_form(form, x, info, gated=False, kda=False):
    """The form's forward (saving for the backward) and backward on x, gated by x's g where asked (kda: by its
    per-channel gk); every launch goes to OfflineLaunches."""
    args = (x["q"], x["k"], x["v"], x["beta"], x["q"].shape[-1] ** -0.5, x["h0"])
    gate = dict(g=x["gk"]) if kda else dict(g=x["g"]) if gated else {}
    o, final, saved, _ = form.forward(*args, True, info, needs_backward=True, **gate)
    form.backward(*args, saved, x["do"], torch.randn_like(final), info, **gate)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--heads", type=int, nargs="+", default=[128], help="head sizes K = V")
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    parser.add_argument("--kernels", nargs="+", help="compile only these kernels (e.g. state_bwd_kernel)")
    parser.add_argument("--batch-heads", type=int, nargs=2, default=[8, 16], metavar=("B", "H"),
                        help="B and H: they set the V-blocks of the state passes (default: the benchmark's 8 x 16)")
    parser.add_argument("--gated", action="store_true", help="the gated rule (chunk and fused_recurrent forms)")
    parser.add_argument("--kda", action="store_true",
                        help="KDA's per-channel gate (chunk and fused_recurrent forms)")
    parser.add_argument("--key-heads", type=int, help="heads of q and k (grouped value heads: fewer than H)")
    parser.add_argument("--hopper", action="store_true",
                        help="the chunk form on the Hopper Gluon walk and reverse pass (16-bit, K = V = 128)")
    parser.add_argument("--traceback", action="store_true", help="print a failed compile's whole traceback")
    parser.add_argument("--sass-lines", type=int, default=0, metavar="N",
                        help="also list each kernel's N source lines with the most SASS instructions")
    args = parser.parse_args()
    if args.kda and (args.gated or args.hopper):
        parser.error("--kda: the per-channel gate runs on the portable stages, alone (not with --gated or --hopper)")
    fused_recurrent.num_sms = lambda device: H200_SMS  # its V-blocks depend on the SM count
    pretend_h200_plans(gluon=args.hopper)
    if args.hopper:
        from deltatron.kernels.chunk.hopper import reverse, walk
        walk.num_sms = reverse.num_sms = lambda device: H200_SMS
    B, H = args.batch_heads
    failed = False
    forced = plan.overrides(hopper_walk=True, hopper_reverse=True) if args.hopper else contextlib.nullcontext()
    for D in args.heads:
        x = inputs(B, 128, H, D, D, DTYPES[args.dtype], args.key_heads)
        info = seq_info(B, 128, torch.device("cpu"), None, None)
        for name in args.forms:
            with OfflineLaunches(args.kernels, args.sass_lines, args.traceback) as offline, forced:
                run_form(FORMS[name], x, info, args.gated, args.kda)
            for r in offline.rows:
                shape = " ".join(f"{k}={v}" for k, v in r["constexprs"].items() if k in
                                 ("K", "V", "C", "BT", "BK", "BW", "BV", "BD", "SEG"))
                head = f"{name:<16}{r['kernel']:<30}{shape:<32}w{r['warps']} s{r['stages']}"
                if "error" in r:
                    failed = True
                    print(f"{head}  FAILED {r['error']}")
                else:
                    print(f"{head}  {usage(r)}  wgmma {r['wgmma']:>3}  mma.sync {r['mma']:>3}  "
                          f"({r['seconds']:.0f} s)", flush=True)
                    if "sass" in r:
                        print_sass_lines(r["sass"], args.sass_lines)
    variant = ((", gated" if args.gated else ", KDA" if args.kda else "")
               + (f", {args.key_heads} key heads" if args.key_heads else ""))
    print(f"triton {triton.__version__}, target sm_90, {args.dtype}{variant}{', Hopper' if args.hopper else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
