"""The memory of the benchmark's calls, on any machine: the peak of the tensors alive in a forward+backward (and in a
forward under no_grad) above its inputs, every deltatron kernel launch stubbed out, CPU tensors, the plan made as on a
named GPU (--gpu, default sm90: the H200's).

    python tools/memory_stub.py [--configs NAME ...] [--impls IMPL ...] [--gpu sm90] [--live] [--json FILE]

No kernel runs, but every tensor the call allocates is allocated as on the GPU (the same shapes and dtypes, released
at the same points), so the peak is the one torch.cuda.max_memory_allocated reads above the inputs there, less the
caching allocator's rounding (b8-t2048-h16-k128: 704 MiB here and on the H200; chunk_kda 1,508 against 1.47 GiB;
chunk_gated at qwen3next-b8-t4096 3,232 against 3.16 GiB). How: every torch operation is seen (TorchDispatchMode),
each new storage among its outputs counts from then until it is freed (a weak reference to it expires), and the
largest sum is kept with the operation that reached it. Per row: the inputs (MiB), each pass's peak above them (MiB)
and the line of deltatron that allocated the tensor which made the forward+backward's peak; --live lists the
tensors alive there, 1 % of the peak and up, with the line that allocated each; --json writes the rows in bytes.

--smoke: the benchmark's smoke configurations (tests/tools/test_memory_stub.py)."""
from __future__ import annotations

import json
import sys
import traceback
from typing import Dict, List, Optional, Tuple

# host_stub first: it sets Triton's interpreter up and puts the repository on sys.path
from host_stub import call_steps, stub_parser, stub_rows

import torch  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks import configs  # noqa: E402

MiB = 2 ** 20


def allocating_line() -> str:
    """The innermost line of deltatron's source on the stack (where the tensor being made was asked for)."""
    for frame in reversed(traceback.extract_stack()):
        if "/deltatron/" in frame.filename:
            return f"{frame.filename.split('/deltatron/')[-1]}:{frame.lineno} {frame.line}"
    return "(outside deltatron)"


class LiveStorages(TorchDispatchMode):
    """The storages alive, from the operation that made each until they are freed, and the peak of their sum."""

    def __init__(self, inputs: Dict[str, torch.Tensor]):
        super().__init__()
        self.live: Dict[int, Tuple[StorageWeakRef, int, str]] = {}
        for name, x in inputs.items():
            self.add(x, f"input {name}")
        self.inputs = self.alive()
        self.peak, self.peak_line, self.peak_live = self.inputs, "", []

    def add(self, x, label: str) -> None:
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self.live:  # (a view of a counted storage has its address)
                self.live[ptr] = (StorageWeakRef(storage), storage.nbytes(), label)

    def alive(self) -> int:
        self.live = {p: v for p, v in self.live.items() if not v[0].expired()}
        return sum(v[1] for v in self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.alive()  # freed ones first: a new storage may take a freed one's address
        out = func(*args, **(kwargs or {}))
        line = None
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in self.live:
                line = line or allocating_line()
                self.add(x, line)
        now = self.alive()
        if now > self.peak:
            self.peak, self.peak_line, self.peak_live = now, line or "", list(self.live.values())
        return out


def measure(impl: str, cfg: configs.Config) -> Dict[str, object]:
    x, steps = call_steps(impl, cfg)
    row: Dict[str, object] = {"impl": impl, "config": cfg.name}
    for name, step in steps:
        step()  # (first calls make plans and caches that later ones reuse)
        with LiveStorages(x) as seen:
            step()
        row["inputs"], row[name], row[f"{name}_line"], row[f"{name}_live"] = (
            seen.inputs, seen.peak - seen.inputs, seen.peak_line, seen.peak_live)
    return row


def table(rows: List[Dict[str, object]], live: bool) -> str:
    lines = [f"{'impl':24} {'config':28} {'inputs':>7} {'fwd':>7} {'fwd+bwd':>8}  the fwd+bwd's peak allocation"]
    for r in rows:
        lines.append(f"{r['impl']:24} {r['config']:28} {r['inputs'] / MiB:7.0f} {r['fwd'] / MiB:7.0f} "
                     f"{r['fwdbwd'] / MiB:8.0f}  {r['fwdbwd_line']}")
        if live:
            for _, nbytes, label in sorted(r["fwdbwd_live"], key=lambda v: -v[1]):
                if nbytes >= r["fwdbwd"] / 100:
                    lines.append(f"{'':51}{nbytes / MiB:10.3f}  {label}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = stub_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--live", action="store_true", help="list the tensors alive at each forward+backward's peak")
    parser.add_argument("--json", metavar="FILE", help="the rows in bytes, with the lines at the peaks")
    args = parser.parse_args(argv)
    caps, _, runs = stub_rows(parser, args)
    rows = [measure(impl, cfg) for impl, cfg in runs]
    print(f"MiB alive above the inputs, every launch stubbed, plan of {caps.name}, torch {torch.__version__}")
    print(table(rows, args.live))
    if args.json:
        keep = ("impl", "config", "inputs", "fwd", "fwd_line", "fwdbwd", "fwdbwd_line")
        with open(args.json, "w") as f:
            json.dump([{k: r[k] for k in keep} for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
