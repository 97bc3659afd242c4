"""The host's own work in the benchmark's calls, on any machine: every deltatron kernel launch stubbed out, CPU
tensors, the plan made as on a named GPU (--gpu, default sm90: the H200's choices, Hopper stages included).

    python tools/host_stub.py [--configs NAME ...] [--impls IMPL ...] [--gpu sm90] [--calls 100] [--repeats 5]

Each row is a benchmark call (benchmarks/harness.resolve on benchmarks/configs.make_inputs, the configuration's real
shapes) with deltatron's launches replaced by a counter: no kernel runs, so what is timed is what the host does around
them (validation, the plan, allocations, descriptors, autograd). That is the Python part of the host time a call costs
(tools/host_time.py measures the whole of it on a GPU, the launcher's driver calls and CUDA's allocator included), so a
change to it can be weighed without a GPU; absolute figures depend on the CPU. Per row: the forward (under no_grad) and
the forward+backward (torch.autograd.grad), each the best of --repeats means over --calls calls, in µs; the launches and
the torch operations (allocations, on a GPU each a call of the caching allocator or a kernel of torch's) one call makes.
The process runs with glibc's allocator set to keep and reuse freed memory (CACHING_MALLOC), as CUDA's caching allocator
does. A call the stubs cannot stand in for (one that needs CUDA streams, which the plan of a GPU may use and the CPU
lacks) is reported with its error.

--smoke: the benchmark's smoke configurations, few calls (tests/tools/test_host_stub.py)."""
from __future__ import annotations

import argparse
import collections
import importlib
import os
import pkgutil
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

# glibc's allocator keeping freed memory for reuse, as CUDA's caching allocator does: by default it maps and unmaps
# every large block, several µs a tensor of these sizes, which no GPU call pays. Read at process start: re-executed
CACHING_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2 ** 40)}
if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in CACHING_MALLOC.items()):
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **CACHING_MALLOC})

# the Triton backend on CPU tensors (its kernels never run here): set before deltatron is imported
os.environ["TRITON_INTERPRET"] = "1"
os.environ["DELTATRON_BACKEND"] = "triton"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deltatron.kernels  # noqa: E402
from benchmarks import configs, harness  # noqa: E402
from deltatron.kernels.chunk import plan  # noqa: E402
from deltatron.kernels.launch import launch  # noqa: E402

DEFAULT_CONFIGS = ("b8-t2048-h16-k128", "varlen20-t32768-h16-k128", "qwen3next-b8-t4096")
DEFAULT_IMPLS = ("deltatron.chunk", "deltatron.chunk_gated", "deltatron.chunk_kda")


class Launches:
    """Stands in for deltatron.kernels.launch.launch in every module of deltatron.kernels that holds it, counting."""

    def __init__(self):
        self.count = 0
        for info in pkgutil.walk_packages(deltatron.kernels.__path__, deltatron.kernels.__name__ + "."):
            module = importlib.import_module(info.name)
            for name, value in list(vars(module).items()):
                if value is launch:
                    setattr(module, name, self)

    def __call__(self, kernel, grid, *args, **kwargs):
        self.count += 1


class TorchOps(TorchDispatchMode):
    """Counts the torch operations run inside it."""

    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func)] += 1
        return func(*args, **(kwargs or {}))


def best_mean_us(step: Callable[[], None], calls: int, repeats: int) -> float:
    step()
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        means.append((time.perf_counter() - start) / calls * 1e6)
    return min(means)


def call_steps(impl: str, cfg: configs.Config) -> Tuple[Dict[str, torch.Tensor], List[Tuple[str, Callable]]]:
    """A benchmark row's inputs on the CPU and its two steps: ("fwd", the forward under no_grad), ("fwdbwd", the
    forward+backward through torch.autograd.grad)."""
    call = harness.resolve(impl, smoke=False)
    x = configs.make_inputs(cfg, torch.device("cpu"), seed=0, gated=impl in configs.GATED,
                            per_channel=impl in configs.KDA)
    wrt = [x[n] for n in configs.grad_inputs(impl)]

    def fwd():
        with torch.no_grad():
            call(x)

    def fwdbwd():
        torch.autograd.grad(call(x), wrt, x["do"])

    return x, [("fwd", fwd), ("fwdbwd", fwdbwd)]


def measure(impl: str, cfg: configs.Config, launches: Launches, calls: int, repeats: int) -> Dict[str, object]:
    _, steps = call_steps(impl, cfg)
    row: Dict[str, object] = {"impl": impl, "config": cfg.name}
    for name, step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 (reported: a path the stubs cannot stand in for)
            row[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
            continue
        launches.count = 0
        with TorchOps() as ops:
            step()
        row[f"{name}_launches"], row[f"{name}_ops"] = launches.count, sum(ops.count.values())
        row[f"{name}_us"] = best_mean_us(step, calls, repeats)
    return row


def table(rows: List[Dict[str, object]]) -> str:
    lines = [f"{'impl':24} {'config':28} {'fwd µs':>8} {'launches':>8} {'ops':>5} {'fwd+bwd µs':>11} "
             f"{'launches':>8} {'ops':>5}"]
    for r in rows:
        cells = []
        for name in ("fwd", "fwdbwd"):
            if f"{name}_us" in r:
                cells.append(f"{r[name + '_us']:{8 if name == 'fwd' else 11}.1f} {r[name + '_launches']:>8} "
                             f"{r[name + '_ops']:>5}")
            else:
                cells.append(str(r.get(name, "-")))
        lines.append(f"{r['impl']:24} {r['config']:28} {' '.join(cells)}")
    return "\n".join(lines)


def stub_parser(description: str) -> argparse.ArgumentParser:
    """The options host_stub and memory_stub share: --configs, --impls, --gpu, --smoke."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--configs", nargs="+", help=f"benchmark configurations (default: {' '.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--impls", nargs="+", default=list(DEFAULT_IMPLS), help="deltatron's benchmark rows")
    parser.add_argument("--gpu", default="sm90", help="the GPU whose plan the calls take (plan.NAMED_GPUS)")
    parser.add_argument("--smoke", action="store_true")
    return parser


def stub_rows(parser: argparse.ArgumentParser, args
              ) -> Tuple[plan.Capabilities, Launches, List[Tuple[str, configs.Config]]]:
    """stub_parser's options read: every chunk call from now on plans as on --gpu, with deltatron's launches stubbed;
    (that GPU's capabilities, the stubs' counter, the (row, configuration) pairs to run). Bad options end in
    parser.error."""
    for impl in args.impls:
        if not impl.startswith("deltatron.") or impl not in configs.IMPLS:
            parser.error(f"--impls: {impl} is not one of deltatron's benchmark rows")
    caps = plan.named_capabilities(args.gpu)  # (raises for an unknown name)
    plan.device_capabilities = lambda device: caps
    plan._CALL_PLANS.clear()
    try:
        cfgs = configs.by_name(args.configs, smoke=args.smoke) if args.configs else (
            list(configs.SMOKE_CONFIGS) if args.smoke else configs.by_name(DEFAULT_CONFIGS))
    except KeyError as e:
        parser.error(str(e))
    runs = [(impl, cfg) for cfg in cfgs for impl in args.impls if configs.applies(impl, cfg) and not cfg.decode]
    return caps, Launches(), runs


def main(argv=None) -> int:
    parser = stub_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if min(args.calls, args.repeats) < 1:
        parser.error("--calls and --repeats must be positive")
    caps, launches, runs = stub_rows(parser, args)
    calls, repeats = (2, 1) if args.smoke else (args.calls, args.repeats)
    rows = [measure(impl, cfg, launches, calls, repeats) for impl, cfg in runs]
    print(f"host work per call with every launch stubbed, plan of {caps.name}, torch {torch.__version__}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
