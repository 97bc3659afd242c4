"""What the switch probes share (overlap_state_passes.py, seg_bwd.py, seq_split.py): a module setting flipped for
one call and restored, the readings of each setting interleaved against drift, and the configs by name.

Each probe times the same calls with its switch False and True (SETTINGS), READINGS rounds, and prints every
reading and the fastest of each setting."""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch

from stage_times import timer  # (same folder: sys.path[0] when a probe runs as a script)

from deltatron import bench
from deltatron.kernels.utils import SeqInfo, seq_info

READINGS = 3
SETTINGS = (False, True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; ||a - b|| where b is zero (e.g. dh of one-chunk sequences without dht)."""
    diff, norm = (a.double() - b.double()).norm(), b.double().norm()
    return float(diff / norm if norm > 0 else diff)


def with_settings(module, values: Dict[str, object], fn: Callable[[], object]):
    """fn() with module's attributes set to values, restored after (also when fn raises)."""
    chosen = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        return fn()
    finally:
        for name, value in chosen.items():
            setattr(module, name, value)


def interleaved(measure: Callable[[Callable[[], object]], float], switch: Callable[[bool, Callable], object],
                phases: Dict[str, Callable[[], object]], label: str) -> Dict[Tuple[bool, str], List[float]]:
    """Times each phase (name -> call) under each setting (switch(setting, fn): fn() with the switch so), READINGS
    rounds with the settings alternating; prints each round's line per setting and the fastest reading of each.
    Returns the readings in ms by (setting, phase)."""
    got = {(s, p): [] for s in SETTINGS for p in phases}
    for _ in range(READINGS):
        for s in SETTINGS:
            for p, fn in phases.items():
                got[(s, p)].append(switch(s, lambda: measure(fn)))
            print(f"  {label}={s!s:<5} " + "  ".join(f"{p} {got[(s, p)][-1]:8.3f} ms" for p in phases), flush=True)
    named = len(phases) > 1
    print("  fastest, False / True: " + ", ".join(
        (f"{p} " if named else "") + " / ".join(f"{min(got[(s, p)]):.3f}" for s in SETTINGS) for p in phases) + " ms")
    return got


def api_fwd_bwd(cfg: bench.Config, device: torch.device) -> Tuple[dict, Callable[[], tuple], SeqInfo]:
    """The benchmark's inputs for cfg (seed 0), a call of the forward+backward through the API (the gradients of
    bench.GRAD_INPUTS for the inputs' dO) and the batch's SeqInfo."""
    x = bench.make_inputs(cfg, device, seed=0)
    call = bench.resolve("deltatron.chunk", smoke=device.type == "cpu")

    def fwd_bwd():
        return torch.autograd.grad(call(x), [x[n] for n in bench.GRAD_INPUTS], x["do"])

    return x, fwd_bwd, seq_info(cfg.B, cfg.T, device, x.get("cu_seqlens"), x.get("cu_seqlens_cpu"))


def gradients_agree(grads: Dict[bool, Sequence[torch.Tensor]]) -> bool:
    """Prints each gradient with True against False (bitwise, or the relative difference) and OK / DIFFER;
    whether all are bitwise equal."""
    same = [torch.equal(a, b) for a, b in zip(grads[True], grads[False])]
    diff = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(grads[True], grads[False])]
    print("  gradients, True against False: "
          + ", ".join(f"d{n} {'bitwise' if s else f'rel {d:.1e}'}" for n, s, d in zip(bench.GRAD_INPUTS, same, diff))
          + ("  OK" if all(same) else "  DIFFER"))
    return all(same)


def fwd_bwd_agree_and_time(measure, switch: Callable[[bool, Callable], object], fwd_bwd: Callable[[], tuple],
                           label: str) -> bool:
    """The gradients of fwd_bwd with the switch True against False (gradients_agree), then its interleaved
    readings; whether the gradients agree bitwise."""
    agree = gradients_agree({s: switch(s, fwd_bwd) for s in SETTINGS})
    interleaved(measure, switch, {"forward+backward": fwd_bwd}, label)
    return agree


def run_configs(compare: Callable[[bench.Config, torch.device, Callable], bool], device: torch.device,
                configs: Sequence[bench.Config], smoke: bool) -> int:
    """compare(cfg, device, measure) on each config with stage_times' do_bench settings (smoke: one wall-clock
    call); the exit status: 0 where every config's results agreed."""
    measure = timer(smoke)
    return 0 if all([compare(cfg, device, measure) for cfg in configs]) else 1


def gpu_probe_main(doc: str, default_configs: Sequence[str],
                   compare: Callable[[bench.Config, torch.device, Callable], bool]) -> int:
    """main() of a GPU-only probe (no smoke mode): compare at each of --configs (bench.CONFIGS names, default
    default_configs) on the CUDA device; run_configs' exit status."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(default_configs), help="bench.CONFIGS names")
    args = parser.parse_args()
    device, configs = gpu_configs(args.configs)
    return run_configs(compare, device, configs, False)


def gpu_configs(names: Sequence[str]) -> Tuple[torch.device, List[bench.Config]]:
    """The CUDA device and bench.CONFIGS by name."""
    known = {c.name: c for c in bench.CONFIGS}
    return torch.device("cuda"), [known[n] for n in names]
