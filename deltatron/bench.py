"""`deltatron bench`: deltatron's forms against fla-core and FlashQLA on one GPU, with a roofline.

One process times the forward (under no_grad) and the forward+backward of every implementation on every
configuration of DESIGN.md §7, measures the matmul and copy ceilings in the same run, and reports per row
the fraction of the floor max(FLOPs / matmul ceiling, bytes / copy ceiling) achieved (benchmarks/NOTES.md
derives the counts). Files under --out: <name>.json (rewritten after every row, so a timeout keeps what
ran), <name>.md (the table) and, with --plot, <name>.png. Competitors are optional imports: one that is
missing gives rows with error "not installed". A row that fails (OOM included) records its error and the
run goes on.

    python benchmarks/run.py --out benchmarks/results --plot     # the H200 run (see below for its length)
    python benchmarks/run.py --smoke --out /tmp/bench            # CPU, tiny sizes, seconds: the CI guard
    python benchmarks/run.py --report benchmarks/results/X.json [Y.json ...]  # BENCHMARKS.md (and plot)

fla-core autotunes for 100-130 s on each new shape, so with it installed the whole table takes over 15
minutes: runs of a subset each (--configs) can be merged into one report, every configuration's rows taken
from one run (merge_runs).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import importlib.util
import inspect
import itertools
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import __version__, api

CHUNK = 64                    # C of the floor model (DESIGN.md §7)
ANCHOR_TFLOPS = 800.0         # DESIGN.md §7 ceilings, used when the run does not measure its own (smoke)
ANCHOR_TBPS = 4.27
L2_BYTES = 60 * 10**6         # H200; used when the device does not report its L2 size
L2_MULTIPLE = 4               # rotate input sets until one pass over them spans this many L2s
MAX_INPUT_SETS = 32
RECURRENT_MAX_T = 4096        # the token-serial form runs the short configurations only
DEFAULT_BUDGET_S = 480        # rows not started by then are recorded as not run (the device limit is 600 s)
GRAD_INPUTS = ("q", "k", "v", "beta")

# Also the run order: the head-to-head rows first, so that a run cut short by --budget-s keeps the
# comparisons and loses the slow forms (fused_chunk and fused_recurrent take most of a full run).
IMPLS = (
    "deltatron.chunk",
    "deltatron.chunk_save_states",  # chunk_delta_rule(save_states=True): the opt-in that keeps the forward's states
    "fla.chunk",
    "flash_qla.g0",           # chunk_gated_delta_rule with log-decay g = 0; K = V = 128 only
    "fla.fused_recurrent",    # decode rows only
    "deltatron.fused_recurrent",
    "deltatron.fused_chunk",
)
OURS = tuple(i for i in IMPLS if i.startswith("deltatron."))


@dataclass(frozen=True)
class Config:
    name: str
    B: int
    T: int
    H: int
    K: int
    V: int
    seqlens: Optional[Tuple[int, ...]] = None   # packed sequences: B = 1, T = sum(seqlens)
    decode: bool = False                        # one token per sequence, from a given fp32 state


def dense(B: int, T: int, H: int, K: int) -> Config:
    return Config(f"b{B}-t{T}-h{H}-k{K}", B, T, H, K, K)


def varlen(total: int, n: int, H: int, K: int, seed: int) -> Config:
    """n sequences of random lengths >= 1 summing to total, from random cut points (seeded)."""
    cuts = sorted(random.Random(seed).sample(range(1, total), n - 1))
    lengths = tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))
    return Config(f"varlen{n}-t{total}-h{H}-k{K}", 1, total, H, K, K, seqlens=lengths)


def decode(B: int, H: int, K: int) -> Config:
    return Config(f"decode-b{B}-h{H}-k{K}", B, 1, H, K, K, decode=True)


CONFIGS = (
    dense(8, 2048, 16, 128),
    dense(4, 4096, 16, 128),
    dense(2, 8192, 32, 128),
    dense(1, 32768, 16, 128),
    dense(1, 32768, 64, 128),
    dense(16, 2048, 8, 64),
    dense(4, 4096, 16, 256),
    varlen(32768, 20, 16, 128, seed=0),
    decode(64, 16, 128),
)
SMOKE_CONFIGS = (dense(2, 40, 1, 16), varlen(40, 3, 1, 16, seed=0), decode(2, 1, 16))


def applies(impl: str, cfg: Config) -> bool:
    """Which (implementation, configuration) pairs the run times; the others are not rows at all."""
    if cfg.decode:
        return impl in ("deltatron.fused_recurrent", "fla.fused_recurrent")
    if impl == "fla.fused_recurrent":
        return False
    if impl == "deltatron.fused_recurrent":
        return cfg.T <= RECURRENT_MAX_T
    if impl == "flash_qla.g0":
        return cfg.K == cfg.V == 128
    return True


# ---------------------------------------------------------------------------------------------------------
# Floor model (benchmarks/NOTES.md derives every count)
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Peaks:
    tflops: float
    tbps: float
    measured: bool


def work(cfg: Config) -> Dict[str, float]:
    """FLOPs and HBM bytes of one call: forward ('fwd') and forward+backward ('fwdbwd'); decode: one step."""
    n = cfg.B * cfg.T * cfg.H          # token-heads
    C, K, V = CHUNK, cfg.K, cfg.V
    if cfg.decode:                     # read and write the fp32 state; S^T k, k v'^T, S^T q
        return dict(flops_fwd=n * 6 * K * V, bytes_fwd=n * (8 * K * V + 2 * (2 * K + 2 * V)))
    fwd = 2 * (3 * C * K + 2 * C * V + 3 * K * V)
    bwd = 2 * (7 * C * K + 4 * C * V + 6 * K * V + 2 * C * C)
    return dict(flops_fwd=n * fwd, bytes_fwd=n * 2 * (2 * K + 2 * V),
                flops_fwdbwd=n * (fwd + bwd), bytes_fwdbwd=n * 2 * (6 * K + 5 * V))


def roofline(cfg: Config, times_ms: Dict[str, float], peaks: Peaks) -> Dict[str, float]:
    """The counts, the floor per phase, and for each timed phase the FLOP rate and % of the floor."""
    out = work(cfg)
    for phase in ("fwd", "fwdbwd"):
        if f"flops_{phase}" not in out:
            continue
        flops, nbytes = out[f"flops_{phase}"], out[f"bytes_{phase}"]
        floor_ms = 1e3 * max(flops / (peaks.tflops * 1e12), nbytes / (peaks.tbps * 1e12))
        out[f"floor_{phase}_ms"] = floor_ms
        ms = times_ms.get(phase)
        if ms:
            out[f"tflops_{phase}"] = flops / (ms * 1e-3) / 1e12
            out[f"pct_floor_{phase}"] = 100.0 * floor_ms / ms
    return out


# ---------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------

def make_inputs(cfg: Config, device: torch.device, seed: int) -> Dict[str, torch.Tensor]:
    """bf16 q, k (unit-norm), v; beta = sigmoid(randn); do for the backward; decode: an fp32 state h."""
    gen = torch.Generator(device=device).manual_seed(seed)
    B, T, H, K, V = cfg.B, cfg.T, cfg.H, cfg.K, cfg.V

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    bf16 = torch.bfloat16
    x = dict(q=randn(B, T, H, K).to(bf16), k=F.normalize(randn(B, T, H, K), dim=-1).to(bf16),
             v=randn(B, T, H, V).to(bf16), beta=randn(B, T, H).sigmoid().to(bf16))
    if cfg.decode:
        x["h"] = randn(B, H, K, V)
        return x
    for name in GRAD_INPUTS:
        x[name].requires_grad_()
    x["do"] = randn(B, T, H, V).to(bf16)
    x["g"] = torch.zeros(B, T, H, device=device)    # FlashQLA's log-decay: 0 is the plain delta rule
    if cfg.seqlens is not None:
        cu = torch.tensor([0, *cfg.seqlens]).cumsum(0)
        x["cu_seqlens_cpu"] = cu
        x["cu_seqlens"] = cu.to(device)                       # int64, as fla documents it
        x["cu_seqlens_i32"] = cu.to(device, torch.int32)      # what FlashQLA builds for itself
    return x


def input_sets(cfg: Config, device: torch.device, l2_bytes: int, limit: int) -> List[Dict[str, torch.Tensor]]:
    """Enough independent input sets (at most limit) that cycling through them streams several L2s of
    data per pass."""
    first = make_inputs(cfg, device, seed=0)
    # by device type: torch.device("cuda") != the "cuda:0" its tensors report
    on_device = [t for t in first.values() if t.device.type == torch.device(device).type]
    nbytes = sum(t.numel() * t.element_size() for t in on_device)
    count = max(1, min(limit, math.ceil(L2_MULTIPLE * l2_bytes / nbytes)))
    return [first] + [make_inputs(cfg, device, seed=i) for i in range(1, count)]


# ---------------------------------------------------------------------------------------------------------
# Implementations: each resolves to call(inputs) -> o, or raises Unavailable
# ---------------------------------------------------------------------------------------------------------

class Unavailable(Exception):
    """An implementation that cannot run in this process (not installed, needs CUDA, API differs)."""


# our implementations that are an entry point called with options: name -> (form, options)
VARIANTS = {"chunk_save_states": ("chunk", dict(save_states=True))}


def _ours(name: str) -> Callable:
    form, options = VARIANTS.get(name, (name, {}))
    fn = getattr(api, f"{form}_delta_rule")

    def call(x):
        if "h" in x:
            return fn(x["q"], x["k"], x["v"], x["beta"], initial_state=x["h"], inplace_final_state=True)[0]
        return fn(x["q"], x["k"], x["v"], x["beta"], cu_seqlens=x.get("cu_seqlens"),
                  cu_seqlens_cpu=x.get("cu_seqlens_cpu"), **options)[0]
    return call


def _fla(form: str) -> Callable:
    ops = importlib.import_module("fla.ops.delta_rule")
    fn = getattr(ops, f"{form}_delta_rule")

    def call(x):
        if "h" in x:    # fla has no in-place state: it allocates the new one
            return fn(x["q"], x["k"], x["v"], x["beta"], initial_state=x["h"], output_final_state=True)[0]
        varlen_args = {} if "cu_seqlens" not in x else dict(cu_seqlens=x["cu_seqlens"],
                                                            cu_seqlens_cpu=x["cu_seqlens_cpu"])
        return fn(x["q"], x["k"], x["v"], x["beta"], **varlen_args)[0]
    return call


def _flash_qla_entry() -> Callable:
    """FlashQLA 0.1.3 exports chunk_gated_delta_rule at the top level; older layouts kept it in ops."""
    for module_name in ("flash_qla", "flash_qla.ops.gated_delta_rule"):
        fn = getattr(importlib.import_module(module_name), "chunk_gated_delta_rule", None)
        if fn is not None:
            params = inspect.signature(fn).parameters
            if not {"q", "k", "v", "g", "beta", "cu_seqlens"} <= set(params):
                raise Unavailable(f"API differs: {module_name}.chunk_gated_delta_rule{inspect.signature(fn)}")
            return fn
    raise Unavailable("API differs: no chunk_gated_delta_rule in flash_qla or flash_qla.ops.gated_delta_rule")


def _flash_qla() -> Callable:
    fn = _flash_qla_entry()

    def call(x):
        return fn(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], cu_seqlens=x.get("cu_seqlens_i32"))[0]
    return call


def resolve(impl: str, smoke: bool) -> Callable:
    package, form = impl.split(".")
    if package == "deltatron":
        return _ours(form)
    if importlib.util.find_spec(package) is None:
        raise Unavailable("not installed")
    if smoke:
        raise Unavailable("needs CUDA: not run in smoke mode")
    return _flash_qla() if package == "flash_qla" else _fla(form)


# ---------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Options:
    mode: str                 # "full", "quick" or "smoke"
    warmup_ms: int
    rep_ms: int
    budget_s: float
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    l2_bytes: int = L2_BYTES

    @property
    def smoke(self) -> bool:
        return self.mode == "smoke"


SMOKE_REPS = 2
SMOKE_INPUT_SETS = 2


def sync(opts: Options) -> None:
    if not opts.smoke:
        torch.cuda.synchronize()


# Seconds of back-to-back calls before every GPU timing. After an idle spell (compiling, autotuning, another
# process starting) the first row timed ran slow, as if at lower clocks, and do_bench's 25 ms of warm-up did
# not cure it (H200, session 9: b8-t2048-h16-k128 forward 0.378 ms as a run's first row against 0.275 in the
# previous call's probe; fla's first row 0.733 against 0.520; the decode row 69.8 us against 44.2 as a
# process's first timing)
SETTLE_S = 0.3


def time_ms(fn: Callable[[], object], opts: Options) -> float:
    """Median time of fn in ms (fn already warm): triton's do_bench on the GPU (it flushes L2 before every
    timed call) after SETTLE_S of calls, a wall clock on the CPU in smoke mode."""
    if opts.smoke:
        times = []
        for _ in range(SMOKE_REPS):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)
    from triton.testing import do_bench

    settled = time.perf_counter() + SETTLE_S
    while time.perf_counter() < settled:
        fn()
        torch.cuda.synchronize()  # not queued far ahead: the loop ends SETTLE_S from now, not seconds later
    return do_bench(fn, warmup=opts.warmup_ms, rep=opts.rep_ms, return_mode="median")


def peak_memory(fn: Callable[[], object], opts: Options) -> Optional[int]:
    """Bytes allocated by one call at its peak, above what was held before it (inputs included)."""
    if opts.smoke:
        return None
    gc.collect()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - held


def cycling(sets: Sequence[dict], step: Callable[[dict], object]) -> Callable[[], object]:
    it = itertools.cycle(sets)
    return lambda: step(next(it))


def measure_peaks(opts: Options) -> Peaks:
    """The ceilings of this run: a bf16 8192^3 matmul on random data, and a 1 GiB device-to-device copy
    (read + write bytes)."""
    if opts.smoke:
        return Peaks(ANCHOR_TFLOPS, ANCHOR_TBPS, measured=False)
    tflops, tbps = matmul_tflops(opts), copy_tbps(opts)  # each frees its buffers on return
    torch.cuda.empty_cache()
    return Peaks(tflops, tbps, measured=True)


def matmul_tflops(opts: Options, n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device=opts.device, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    return 2 * n**3 / (time_ms(lambda: torch.mm(a, b, out=c), opts) * 1e-3) / 1e12


def copy_tbps(opts: Options, numel: int = 2**29) -> float:
    src = torch.randn(numel, device=opts.device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / (time_ms(lambda: dst.copy_(src), opts) * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------------

def identity(impl: str, cfg: Config) -> dict:
    row = dict(impl=impl, config=cfg.name, B=cfg.B, T=cfg.T, H=cfg.H, K=cfg.K, V=cfg.V)
    if cfg.seqlens is not None:
        row["seqlens"] = list(cfg.seqlens)
    if cfg.decode:
        row["decode"] = True
    return row


def bench_row(impl: str, call: Callable, cfg: Config, opts: Options, peaks: Peaks) -> dict:
    """Times one pair. A backward that fails keeps the forward's numbers and records its error."""
    row = identity(impl, cfg)
    sets = input_sets(cfg, opts.device, opts.l2_bytes, SMOKE_INPUT_SETS if opts.smoke else MAX_INPUT_SETS)

    def fwd(x):
        with torch.no_grad():
            call(x)

    def fwdbwd(x):
        with torch.enable_grad():
            o = call(x)
            torch.autograd.grad(o, [x[n] for n in GRAD_INPUTS], x["do"])

    times, heaviest, first_call_s = {}, fwd, 0.0
    for phase, step in [("fwd", fwd)] if cfg.decode else [("fwd", fwd), ("fwdbwd", fwdbwd)]:
        try:
            t0 = time.perf_counter()
            step(sets[0])            # compilation and autotuning, timed apart
            sync(opts)
            first_call_s += time.perf_counter() - t0
            times[phase] = time_ms(cycling(sets, step), opts)
        except Exception as e:
            if phase == "fwd":
                raise
            row["error"] = f"fwd+bwd: {describe(e)}"
            traceback.print_exc(limit=-8)
            break
        heaviest = step
    row["first_call_s"] = round(first_call_s, 3)
    row["fwd_ms"] = times["fwd"]
    if cfg.decode:
        row["step_us"] = 1e3 * times["fwd"]
    elif "fwdbwd" in times:
        row["fwdbwd_ms"] = times["fwdbwd"]
    row["peak_mem_bytes"] = peak_memory(lambda: heaviest(sets[0]), opts)
    row["input_sets"] = len(sets)
    row.update(roofline(cfg, times, peaks))
    return row


def describe(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def free_memory(opts: Options) -> None:
    gc.collect()
    if not opts.smoke:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------
# Derived numbers and output
# ---------------------------------------------------------------------------------------------------------

def baseline_impl(competitor: str, row: dict) -> str:
    if competitor == "fla":
        return "fla.fused_recurrent" if row.get("decode") else "fla.chunk"
    return "flash_qla.g0"


def speedup(rows: Sequence[dict], row: dict, competitor: str, phase: str) -> Optional[float]:
    """Competitor's time / this row's time on the same configuration (> 1: this row is faster)."""
    base = baseline_impl(competitor, row)
    for other in rows:
        if other["impl"] == base and other["config"] == row["config"]:
            a, b = other.get(f"{phase}_ms"), row.get(f"{phase}_ms")
            return a / b if a and b else None
    return None


def _pair(a: Optional[float], b: Optional[float], fmt: str) -> str:
    if a is None and b is None:
        return ""
    return " / ".join("-" if x is None else format(x, fmt) for x in (a, b))


def _memory(n: Optional[int]) -> str:
    if n is None:
        return ""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


TABLE_HEADER = ("impl", "config", "fwd ms", "fwd+bwd ms", "vs fla f / fb", "vs FlashQLA f / fb",
                "TFLOP/s f / fb", "% floor f / fb", "peak mem", "note")


def table_cells(rows: Sequence[dict]) -> List[Tuple[str, ...]]:
    out = []
    for r in rows:
        if "fwd_ms" not in r:
            out.append((r["impl"], r["config"], "", "", "", "", "", "", "", r["error"]))
            continue
        fwd = f"{r['step_us']:.1f} us" if r.get("decode") else f"{r['fwd_ms']:.3f}"
        fwdbwd = f"{r['fwdbwd_ms']:.3f}" if "fwdbwd_ms" in r else ""
        ratios = [_pair(speedup(rows, r, c, "fwd"), speedup(rows, r, c, "fwdbwd"), ".2f") for c in ("fla", "flash_qla")]
        note = r.get("error") or ("decode: one token per step" if r.get("decode") else "")
        out.append((r["impl"], r["config"], fwd, fwdbwd, *ratios,
                    _pair(r.get("tflops_fwd"), r.get("tflops_fwdbwd"), ".1f"),
                    _pair(r.get("pct_floor_fwd"), r.get("pct_floor_fwdbwd"), ".1f"),
                    _memory(r.get("peak_mem_bytes")), note))
    return out


def text_table(rows: Sequence[dict]) -> str:
    cells = [TABLE_HEADER] + table_cells(rows)
    widths = [max(len(c[i]) for c in cells) for i in range(len(TABLE_HEADER) - 1)]
    lines = []
    for c in cells:
        left = [c[0].ljust(widths[0]), c[1].ljust(widths[1])]
        right = [c[i].rjust(widths[i]) for i in range(2, len(widths))]
        lines.append("  ".join(left + right + [c[-1]]).rstrip())
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict]) -> str:
    cells = [TABLE_HEADER] + table_cells(rows)
    lines = ["| " + " | ".join(x.replace("|", "\\|") for x in c) + " |" for c in cells]
    lines.insert(1, "|" + "|".join("---" if i < 2 else "---:" for i in range(len(TABLE_HEADER) - 1)) + "|---|")
    return "\n".join(lines)


def legend(meta: dict) -> str:
    runs = meta.get("runs", [meta])  # merged runs: each row's floor uses its own run's ceilings
    peaks = ("measured in " + ("this run" if len(runs) == 1 else "each run") if meta.get("peaks_measured")
             else "DESIGN.md §7 anchors, not measured")
    tflops = " / ".join(f"{m['peak_tflops']:.0f}" for m in runs)
    tbps = " / ".join(dict.fromkeys(f"{m['peak_tbps']:.2f}" for m in runs))
    return (f"bf16. f = forward (no_grad), fb = forward+backward. vs X = X's time / this row's time (> 1: faster "
            f"than X; fla's decode baseline is its fused_recurrent). Floor = max(FLOPs / {tflops} "
            f"TFLOP/s, bytes / {tbps} TB/s) ({peaks}; counts in benchmarks/NOTES.md); % floor = "
            "floor / time. Peak mem: one forward+backward's (decode: one step's) allocation above its inputs. fused_recurrent runs "
            f"T <= {RECURRENT_MAX_T} only; FlashQLA K = V = 128 only.")


def describe_meta(meta: dict) -> str:
    return (f"{meta['date']}  {meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  deltatron "
            f"{meta['deltatron']}  fla-core {meta['fla_core'] or 'not installed'}  flash-qla "
            f"{meta['flash_qla'] or 'not installed'}  ceilings {meta['peak_tflops']:.0f} TFLOP/s, "
            f"{meta['peak_tbps']:.2f} TB/s ({'measured' if meta['peaks_measured'] else 'anchors'})  mode {meta['mode']}")


def write_json(path: Path, results: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, path)


def plot(results: dict, path: Path) -> Optional[Path]:
    """Speedup over fla per configuration, forward and forward+backward panels; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in results["rows"] if "fwd_ms" in r]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    impls = [i for i in IMPLS if not i.startswith("fla.") and any(r["impl"] == i for r in rows)]
    if not configs or not impls:
        return None
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 1.2 * len(configs)), 7.5), sharex=True)
    width = 0.8 / len(impls)
    for ax, phase, title in zip(axes, ("fwd", "fwdbwd"), ("forward", "forward+backward")):
        for j, impl in enumerate(impls):
            by_config = {r["config"]: speedup(rows, r, "fla", phase) for r in rows if r["impl"] == impl}
            ys = [by_config.get(c) or math.nan for c in configs]
            ax.bar([i + (j - (len(impls) - 1) / 2) * width for i in range(len(configs))], ys, width, label=impl)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(f"speedup vs fla, {title}")
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_xticks(range(len(configs)))
    axes[1].set_xticklabels(configs, rotation=30, ha="right")
    axes[0].legend(fontsize=8)
    meta = results["meta"]
    fig.suptitle(f"{meta['gpu']}, bf16: time of fla-core {meta['fla_core']} / time of each (> 1 is faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


REPRODUCE = """\
## How to reproduce

The run needs one H200 (any CUDA GPU works; FlashQLA needs Hopper or newer), torch and triton, and the
competitors as optional imports. Through the team's device tool, from the checkout root:

1. Here, once: `bash /work/shared/tools/competitor-wheels` (downloads the wheels into `.whl-fla`, `.whl-tl`;
   git ignores both), then install them for the device's Python into one folder and pack it (53 MB, under a
   call's 64 MiB): `pip install --no-deps --no-compile --target /tmp/allsite --python-version 3.12
   --only-binary=:all: --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
   --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
   .whl-fla/*.whl .whl-tl/*.whl`, `mkdir -p .whl-all && tar cJf .whl-all/allsite.tar.xz -C /tmp allsite`
   (ignore `.whl-all/` in `.git/info/exclude`).
2. One device call, carry `[".whl-all"]`, timeout 600: `tar xJf .whl-all/allsite.tar.xz -C /tmp && export
   PYTHONPATH=/tmp/allsite && BENCH_BUDGET_S=420 BENCH_ARGS="--impls ..." bash benchmarks/device_session.sh bench`
   (it runs `benchmarks/run.py --out $OUT --plot`). FlashQLA compiles its TileLang kernels on first use, 1-3
   minutes a shape, and fla-core autotunes 80-130 s on each new shape, unless their caches apply: the bench
   step restores both from `benchmarks/device_cache/` (made in session 14 with torch 2.11, triton 3.6,
   fla-core 0.6.0 and TileLang 0.1.15 on the H200) and returns the grown autotuning cache as
   `$OUT/triton-autotune.tar.gz`. Rows not started after `--budget-s`, default 480 s, are recorded as not
   run, but a row that starts runs to its end. Every configuration with six implementations took 307 s in one
   call in session 20 (FlashQLA's b1-t32768-h64 kernels, not in the cache, compiled for 122 s of it). Run with
   nothing else on the host: the host-bound rows (b1-t32768-h16's split forward, the packed sequences) read the
   host's time where it exceeds the GPU's (benchmarks/diagnostics/host_bound_forward.py).
3. Copy the returned `<gpu>-<date>.json` / `.png` into `benchmarks/results/`, commit them, and regenerate
   this page: `python benchmarks/run.py --report benchmarks/results/<gpu>-<date>.json [<more runs>.json]`
   (several runs are merged, each configuration's rows from one run).

Elsewhere: `pip install fla-core==0.6.0 flash-qla==0.1.3 matplotlib`, then
`deltatron bench --out benchmarks/results --plot` (the same as `python benchmarks/run.py`). Options:
`--configs NAME ...`, `--impls NAME ...`, `--quick` (fewer iterations), `--smoke` (CPU, tiny sizes, the CI
guard in tests/test_benchmarks_smoke.py), `--list`.
"""


def merge_runs(runs: Sequence[dict]) -> dict:
    """One table from runs that timed different configurations (a run split over device calls, or one that
    adds configurations to an earlier one). Every configuration's rows come from one run, the last that timed
    it, so each row's ratios compare implementations timed in the same process; rows that were not run are left
    out when another run has the configuration. meta is the first run's, with every run's meta under "runs"."""
    source = {}  # config -> index of the run its rows come from: the last that timed it, else the last with it
    for timed_only in (False, True):
        for i, run in enumerate(runs):
            for r in run["rows"]:
                if not timed_only or "fwd_ms" in r:
                    source[r["config"]] = i
    rows = [r for i, run in enumerate(runs) for r in run["rows"] if source[r["config"]] == i]
    return dict(meta=dict(runs[0]["meta"], runs=[run["meta"] for run in runs]), rows=rows)


def render_report(results: Optional[dict], json_path: Optional[Path], png_path: Optional[Path], md_path: Path,
                  more_json: Sequence[Path] = ()) -> str:
    """BENCHMARKS.md: the committed run's table and plot, the hand-written notes of each run (<results>.notes.md
    beside its JSON, if any; the last run's first), and how to reproduce it. more_json: further runs merged into
    the table (merge_runs)."""
    parts = ["# Benchmarks\n",
             "deltatron's chunk, fused_chunk and fused_recurrent delta rule against fla-core's chunk_delta_rule "
             "and FlashQLA's chunk_gated_delta_rule with g = 0, forward and forward+backward, bf16, with the "
             "fraction of the roofline floor each reaches. Method and floor model: [NOTES.md](NOTES.md). "
             "Generated by `python benchmarks/run.py --report <results json> [more runs]`.\n"]
    if results is None:
        parts.append("No GPU run is committed yet; the steps below produce one.\n")
    else:
        rel = lambda p: os.path.relpath(p, md_path.parent)  # noqa: E731
        meta = results["meta"]
        parts.append(f"## Run of {meta['date']}\n")
        for path, run_meta in zip([json_path, *more_json], meta.get("runs", [meta])):
            parts.append(f"Raw numbers: [{path.name}]({rel(path)}). {describe_meta(run_meta)}.\n")
        parts.append(markdown_table(results["rows"]) + "\n")
        parts.append(legend(meta) + "\n")
        if png_path is not None:
            parts.append(f"![speedup over fla]({rel(png_path)})\n")
        # what the numbers alone do not say, written by hand beside each run's JSON; the last run first (its rows
        # replace the earlier runs' where both timed a configuration)
        for path in reversed([json_path, *more_json]):
            notes = path.with_suffix(".notes.md")
            if notes.exists():
                parts.append(f"### About run {path.stem} ([{notes.name}]({rel(notes)}))\n")
                parts.append(notes.read_text().strip() + "\n")
    parts.append(REPRODUCE)
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------

def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@contextmanager
def _torch_backend():
    """Smoke mode runs deltatron's PyTorch backend whatever DELTATRON_BACKEND says (fast, no kernels)."""
    saved = os.environ.get("DELTATRON_BACKEND")
    os.environ["DELTATRON_BACKEND"] = "torch"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("DELTATRON_BACKEND", None)
        else:
            os.environ["DELTATRON_BACKEND"] = saved


def _resolve_or_reason(impl: str, smoke: bool):
    """The implementation's call, or the Unavailable that says why it cannot run."""
    try:
        return resolve(impl, smoke)
    except Unavailable as e:
        return e
    except Exception as e:   # an import that fails inside the package (a missing dependency)
        traceback.print_exc(limit=-8)
        return Unavailable(describe(e))


def _row_or_error(impl: str, target, cfg: Config, opts: Options, peaks: Peaks) -> dict:
    if isinstance(target, Unavailable):
        return dict(identity(impl, cfg), error=str(target))
    try:
        return bench_row(impl, target, cfg, opts, peaks)
    except Exception as e:   # one row's failure (OOM included) must not end the run
        traceback.print_exc(limit=-8)
        return dict(identity(impl, cfg), error=describe(e))


def _select(names: Optional[List[str]], table: Sequence, key, what: str, parser) -> list:
    if not names:
        return list(table)
    wanted = [n for arg in names for n in arg.split(",") if n]
    known = {key(x): x for x in table}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        parser.error(f"unknown {what} {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[n] for n in wanted]


def run(impls: Sequence[str], configs: Sequence[Config], opts: Options, out: Optional[Path], name: str,
        argv: Sequence[str], log=print) -> dict:
    """Times every applicable (impl, config) pair; returns {"meta": ..., "rows": [...]}, and keeps
    <out>/<name>.json current after every row."""
    start = time.perf_counter()
    peaks = measure_peaks(opts)
    meta = dict(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        gpu="cpu (smoke)" if opts.smoke else torch.cuda.get_device_name(opts.device),
        torch=torch.__version__, triton=_version("triton"), fla_core=_version("fla-core"),
        flash_qla=_version("flash-qla"), deltatron=__version__, python=platform.python_version(),
        peak_tflops=peaks.tflops, peak_tbps=peaks.tbps, peaks_measured=peaks.measured,
        mode=opts.mode, dtype="bf16",
        timing=(f"wall clock, median of {SMOKE_REPS} (smoke)" if opts.smoke else
                f"triton do_bench median after {SETTLE_S} s of calls, warmup {opts.warmup_ms} ms, "
                f"rep {opts.rep_ms} ms, L2 flushed per call"),
        floor_chunk_size=CHUNK, l2_bytes=opts.l2_bytes, command=" ".join(["deltatron bench", *argv]),
    )
    results = dict(meta=meta, rows=[])
    json_path = None if out is None else out / f"{name}.json"
    log(f"# {describe_meta(meta)}", flush=True)
    resolved: Dict[str, object] = {}
    for impl in impls:
        for cfg in (c for c in configs if applies(impl, c)):
            if impl not in resolved:  # resolved even past the budget: a missing package says so
                resolved[impl] = _resolve_or_reason(impl, opts.smoke)
            if time.perf_counter() - start > opts.budget_s and not isinstance(resolved[impl], Unavailable):
                row = dict(identity(impl, cfg), error=f"not run: time budget of {opts.budget_s:.0f} s spent")
            else:
                row = _row_or_error(impl, resolved[impl], cfg, opts, peaks)
                free_memory(opts)
            results["rows"].append(row)
            if json_path is not None:
                write_json(json_path, results)
            status = "  ".join(f"{label} {row[key]:.3f} ms" for label, key in
                               (("fwd", "fwd_ms"), ("fwd+bwd", "fwdbwd_ms")) if key in row)
            status = "  ".join(x for x in (status, row.get("error", "")) if x)
            log(f"[{time.perf_counter() - start:6.1f} s] {impl:<26} {cfg.name:<22} {status}", flush=True)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="deltatron bench", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--out", type=Path, help="folder for <name>.json/.md/.png (default: print only)")
    parser.add_argument("--name", help="file stem (default: <gpu>-<UTC date and time>)")
    parser.add_argument("--configs", nargs="+", metavar="NAME", help="subset of configurations (see --list)")
    parser.add_argument("--impls", nargs="+", metavar="NAME", help="subset of implementations (see --list)")
    parser.add_argument("--quick", action="store_true", help="few iterations (do_bench warmup 5 ms, rep 20 ms)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU only, tiny configurations, PyTorch backend, no CUDA calls: seconds")
    parser.add_argument("--plot", action="store_true", help="also write <name>.png (needs matplotlib)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"rows not started after this many seconds are recorded as not run "
                             f"(default {DEFAULT_BUDGET_S})")
    parser.add_argument("--list", action="store_true", help="print the configurations and implementations")
    parser.add_argument("--report", type=Path, nargs="+", metavar="JSON",
                        help="write BENCHMARKS.md (and the plot, with matplotlib) from results files, merged "
                             "when several (each configuration from the last run that timed it); no run")
    parser.add_argument("--md", type=Path, default=Path(__file__).resolve().parents[1] / "benchmarks" / "BENCHMARKS.md",
                        help="where --report writes (default benchmarks/BENCHMARKS.md)")
    args = parser.parse_args(argv)

    table = SMOKE_CONFIGS if args.smoke else CONFIGS
    if args.list:
        for c in table:
            print(f"{c.name:<24} B={c.B} T={c.T} H={c.H} K={c.K} V={c.V}"
                  + (f" seqlens={list(c.seqlens)}" if c.seqlens else "") + (" decode" if c.decode else ""))
        print("implementations: " + ", ".join(IMPLS))
        return 0
    if args.report is not None:
        first, *more = args.report
        runs = [json.loads(p.read_text()) for p in args.report]
        results = merge_runs(runs) if more else runs[0]
        png = plot(results, first.with_suffix(".png"))
        if png is None and first.with_suffix(".png").exists():
            png = first.with_suffix(".png")
        args.md.write_text(render_report(results, first, png, args.md, more))
        print(f"wrote {args.md}" + (f" and {png}" if png else " (no plot: matplotlib not installed)"))
        return 0

    configs = _select(args.configs, table, lambda c: c.name, "configuration", parser)
    impls = _select(args.impls, IMPLS, lambda i: i, "implementation", parser)
    if args.smoke:
        opts = Options(mode="smoke", warmup_ms=0, rep_ms=0, budget_s=args.budget_s)
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: the benchmark needs a GPU (use --smoke for the CPU check)")
        device = torch.device("cuda", torch.cuda.current_device())
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or L2_BYTES
        opts = Options(mode="quick" if args.quick else "full", warmup_ms=5 if args.quick else 25,
                       rep_ms=20 if args.quick else 100,
                       budget_s=args.budget_s, device=device, l2_bytes=l2)
    gpu = "cpu-smoke" if args.smoke else torch.cuda.get_device_name(opts.device)
    name = args.name or "{}-{:%Y%m%d-%H%M%S}".format(
        "".join(ch if ch.isalnum() else "-" for ch in gpu.lower()).strip("-"), datetime.now(timezone.utc))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)

    if args.smoke:
        with _torch_backend():
            results = run(impls, configs, opts, args.out, name, argv)
    else:
        results = run(impls, configs, opts, args.out, name, argv)

    written = []
    if args.out is not None:
        md = args.out / f"{name}.md"
        md.write_text(f"{describe_meta(results['meta'])}\n\n{markdown_table(results['rows'])}\n\n"
                      f"{legend(results['meta'])}\n")
        written += [args.out / f"{name}.json", md]
        if args.plot:
            png = plot(results, args.out / f"{name}.png")
            written.append(png if png else "no plot: matplotlib not installed")
    print()
    print(describe_meta(results["meta"]))
    print(text_table(results["rows"]))
    print(legend(results["meta"]))
    if written:
        print("wrote " + ", ".join(str(w) for w in written))
    return 0
