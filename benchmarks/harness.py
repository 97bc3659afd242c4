"""deltatron's forms against fla-core and FlashQLA on one GPU, with a roofline.

One process times the forward (under no_grad) and the forward+backward of every implementation (the delta rule's,
and the gated delta rule's with a real gate: configs.GATED) on every configuration (configs.CONFIGS) it applies to
(configs.skip_reason; --list names the pairs skipped and why), measures the matmul and copy ceilings in the same
run, and reports per row the fraction of the floor max(FLOPs / matmul ceiling, bytes / copy ceiling) achieved
(docs/performance.md derives the counts). Files: <name>.json (rewritten after every row, so a timeout keeps what
ran), <name>.md (the table) and, with --plot, <name>.png; on a GPU by default benchmarks/results/<gpu>.json etc.,
the one results set per GPU (h200 on an H200; git keeps the earlier ones). Competitors are optional imports: one
that is missing gives rows with error "not installed". A row that fails (OOM included) records its error and the run
goes on.

    python benchmarks/run.py --plot                          # a GPU run: benchmarks/results/<gpu>.json/.md/.png
    python benchmarks/run.py --smoke --out out/bench         # CPU, tiny sizes, seconds: the CI guard
    python benchmarks/run.py --report benchmarks/results/h200.json     # BENCHMARKS.md and h200.md/.png from it
    python benchmarks/run.py --merge benchmarks/results/h200.json a.json b.json    # runs of subsets as one

fla-core autotunes for 80-130 s on each new shape, so with it installed the whole table takes over 15 minutes
without its cache: runs of a subset each (--configs, --impls) can be merged into one results file (--merge; the
gated rows of a later run join a configuration's delta-rule rows of an earlier one).
`deltatron bench` in a checkout calls main() here with its arguments.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import sys
import time
import traceback
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # loaded by file (deltatron bench): the benchmarks package is the checkout's
    sys.path.append(str(ROOT))

import torch  # noqa: E402

from benchmarks.configs import (CONFIGS, GATED, IMPLS, KDA, L2_BYTES, MAX_INPUT_SETS, SMOKE_CONFIGS,  # noqa: E402
                                Config, Peaks, applies, grad_inputs, input_sets, roofline, skip_reason)
from benchmarks.report import (describe_meta, kept_notes, legend, merge_runs, plot, render_benchmarks,  # noqa: E402
                               results_markdown, text_table, write_json)
from benchmarks.timing import (SETTLE_S, SMOKE_INPUT_SETS, SMOKE_REPS, Options, cycling, free_memory,  # noqa: E402
                               graph_time_ms, host_ms, measure_peaks, peak_memory, sync, time_ms)
from deltatron import __version__, api  # noqa: E402

DEFAULT_BUDGET_S = 480        # rows not started by then are recorded as not run: a run ends within a time limit
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS_MD = ROOT / "benchmarks" / "BENCHMARKS.md"


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


def _flash_qla_entry(needs=("q", "k", "v", "g", "beta", "cu_seqlens")) -> Callable:
    """FlashQLA 0.1.3 exports chunk_gated_delta_rule at the top level; older layouts kept it in ops."""
    for module_name in ("flash_qla", "flash_qla.ops.gated_delta_rule"):
        fn = getattr(importlib.import_module(module_name), "chunk_gated_delta_rule", None)
        if fn is not None:
            params = inspect.signature(fn).parameters
            if not set(needs) <= set(params):
                raise Unavailable(f"API differs: {module_name}.chunk_gated_delta_rule{inspect.signature(fn)}")
            return fn
    raise Unavailable("API differs: no chunk_gated_delta_rule in flash_qla or flash_qla.ops.gated_delta_rule")


def _flash_qla() -> Callable:
    fn = _flash_qla_entry()

    def call(x):
        return fn(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], cu_seqlens=x.get("cu_seqlens_i32"))[0]
    return call


# The gated rows call every op as Qwen3-Next's layer does: g the log decay computed outside (configs.gate), beta
# already through its sigmoid, q and k L2-normalized inside the op (use_qk_l2norm_in_kernel=True, so the
# normalization and its backward are timed, the same work for the three), grouped value heads as they come.
GATED_OPTIONS = dict(use_qk_l2norm_in_kernel=True)


def _ours_gated() -> Callable:
    def call(x):
        return api.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=x.get("cu_seqlens"),
                                          cu_seqlens_cpu=x.get("cu_seqlens_cpu"), **GATED_OPTIONS)[0]
    return call


def _fla_gated() -> Callable:
    # fla-core 0.6 hands chunk_gated_delta_rule to FlashQLA when that package is installed (its FLA_FLASH_QLA backend,
    # on by default and read once per process): off, so that this row times fla's own Triton kernels
    os.environ["FLA_FLASH_QLA"] = "0"
    fn = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule

    def call(x):
        varlen_args = {} if "cu_seqlens" not in x else dict(cu_seqlens=x["cu_seqlens"],
                                                            cu_seqlens_cpu=x["cu_seqlens_cpu"])
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], **varlen_args, **GATED_OPTIONS)[0]
    return call


def _flash_qla_gated() -> Callable:
    fn = _flash_qla_entry(needs=("q", "k", "v", "g", "beta", "cu_seqlens", *GATED_OPTIONS))

    def call(x):
        return fn(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], cu_seqlens=x.get("cu_seqlens_i32"),
                  **GATED_OPTIONS)[0]
    return call


def _ours_gated_decode(v_first: bool) -> Callable:
    def call(x):
        return api.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                    initial_state=x["h_v_first" if v_first else "h"],
                                                    inplace_final_state=True, state_v_first=v_first,
                                                    **GATED_OPTIONS)[0]
    return call


def _ours_gated_verify() -> Callable:
    def call(x):
        return api.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["pool"],
                                                    inplace_final_state=True, ssm_state_indices=x["slots"],
                                                    num_accepted_tokens=x["accepted"], **GATED_OPTIONS)[0]
    return call


def _fla_gated_decode() -> Callable:
    fn = importlib.import_module("fla.ops.gated_delta_rule").fused_recurrent_gated_delta_rule

    def call(x):  # fla's returns the new state rather than writing it in place
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h"], output_final_state=True,
                  **GATED_OPTIONS)[0]
    return call


def _kda(fn) -> Callable:
    """chunk_kda (ours or fla's) called as the gated rows call theirs."""
    def call(x):
        varlen_args = {} if "cu_seqlens" not in x else dict(cu_seqlens=x["cu_seqlens"],
                                                            cu_seqlens_cpu=x["cu_seqlens_cpu"])
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], **varlen_args, **GATED_OPTIONS)[0]
    return call


def resolve(impl: str, smoke: bool) -> Callable:
    package, form = impl.split(".")
    if impl == "deltatron.chunk_gated":
        return _ours_gated()
    if impl in ("deltatron.fused_recurrent_gated", "deltatron.fused_recurrent_gated_v_first"):
        return _ours_gated_decode(impl.endswith("v_first"))
    if impl == "deltatron.verify_gated":
        return _ours_gated_verify()
    if impl == "deltatron.chunk_kda":
        return _kda(api.chunk_kda)
    if package == "deltatron":
        return _ours(form)
    if importlib.util.find_spec(package) is None:
        raise Unavailable("not installed")
    if smoke:
        raise Unavailable("needs CUDA: not run in smoke mode")
    if impl == "fla.chunk_gated":
        return _fla_gated()
    if impl == "fla.fused_recurrent_gated":
        return _fla_gated_decode()
    if impl == "fla.chunk_kda":
        return _kda(importlib.import_module("fla.ops.kda").chunk_kda)
    if impl == "flash_qla.gated":
        return _flash_qla_gated()
    return _flash_qla() if package == "flash_qla" else _fla(form)


# ---------------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------------

def identity(impl: str, cfg: Config) -> dict:
    row = dict(impl=impl, config=cfg.name, B=cfg.B, T=cfg.T, H=cfg.H, K=cfg.K, V=cfg.V)
    if cfg.Hk != cfg.H:                 # grouped value heads: H is the value heads
        row["Hk"] = cfg.Hk
    if cfg.seqlens is not None:
        row["seqlens"] = list(cfg.seqlens)
    if cfg.decode:
        row["decode"] = True
    if cfg.verify:
        row["verify"] = True
    return row


def bench_row(impl: str, call: Callable, cfg: Config, opts: Options, peaks: Peaks) -> dict:
    """Times one pair. A backward that fails keeps the forward's numbers and records its error."""
    row = identity(impl, cfg)
    gated, per_channel = impl in GATED, impl in KDA
    sets = input_sets(cfg, opts.device, opts.l2_bytes, SMOKE_INPUT_SETS if opts.smoke else MAX_INPUT_SETS, gated,
                      per_channel)
    wrt = grad_inputs(impl)

    def fwd(x):
        with torch.no_grad():
            call(x)

    def fwdbwd(x):
        with torch.enable_grad():
            o = call(x)
            torch.autograd.grad(o, [x[n] for n in wrt], x["do"])

    times, heaviest, first_call_s = {}, fwd, 0.0
    for phase, step in [("fwd", fwd)] if cfg.decode else [("fwd", fwd), ("fwdbwd", fwdbwd)]:
        try:
            t0 = time.perf_counter()
            step(sets[0])            # compilation and autotuning, timed apart
            sync(opts)
            first_call_s += time.perf_counter() - t0
            if cfg.decode:  # the GPU's time under graph replay; an eager caller's step time beside it
                eager = time_ms(cycling(sets, step), opts)
                row["eager_step_us"] = 1e3 * eager
                try:
                    times[phase] = graph_time_ms(step, sets, opts)
                except RuntimeError as e:  # a step that cannot be captured is timed eagerly, and says so
                    row["graph_error"] = describe(e)
                    times[phase] = eager
            else:
                times[phase] = time_ms(cycling(sets, step), opts)
            row[f"host_{phase}_ms"] = host_ms(cycling(sets, step), opts)
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
    row.update(roofline(cfg, times, peaks, gated, per_channel))
    return row


def describe(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


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


def gpu_stem(device_name: str) -> str:
    """The results file's name for a GPU: its device name in lower case without the vendor, runs of other
    characters than letters and digits as one '-' ("NVIDIA H200" -> "h200")."""
    words = "".join(ch if ch.isalnum() else " " for ch in device_name.lower()).split()
    return "-".join(w for w in words if w not in ("nvidia", "amd", "geforce")) or "gpu"


def command_line(argv: Sequence[str]) -> str:
    """The run's command for its meta, with --out as a path relative to the checkout (or its last part when it
    lies elsewhere): a results file names no folder of the machine it ran on."""
    shown, it = [], iter(argv)
    for arg in it:
        if arg == "--out" or arg.startswith("--out="):
            value = arg.partition("=")[2] or next(it, "")
            path = Path(value).resolve()
            value = os.path.relpath(path, ROOT) if path.is_relative_to(ROOT) else path.name
            shown += ["--out", value]
        else:
            shown.append(arg)
    return " ".join(["deltatron bench", *shown])


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
        floor_chunk_size=64, l2_bytes=opts.l2_bytes, command=command_line(argv),
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


def write_report(paths: Sequence[Path], md: Path) -> List[Path]:
    """BENCHMARKS.md at md from one results file per GPU (its Notes section kept), and each file's <name>.md and
    <name>.png beside it (the plot only with matplotlib); the files written."""
    files = [(p, json.loads(p.read_text())) for p in paths]
    written = []
    for path, results in files:
        path.with_suffix(".md").write_text(results_markdown(results))
        written.append(path.with_suffix(".md"))
        png = plot(results, path.with_suffix(".png"))
        if png is not None:
            written.append(png)
    md.write_text(render_benchmarks(files, md, kept_notes(md)))
    return [md, *written]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="deltatron bench", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--out", type=Path, help="folder for <name>.json/.md/.png (default: benchmarks/results on a "
                                                 "GPU; with --smoke, print only)")
    parser.add_argument("--name", help="file stem (default: the GPU's short name, e.g. h200)")
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
                        help="write BENCHMARKS.md from results files (one per GPU), and each one's .md and .png "
                             "beside it; no run")
    parser.add_argument("--md", type=Path, default=BENCHMARKS_MD,
                        help="where --report writes (default benchmarks/BENCHMARKS.md; its Notes section is kept)")
    parser.add_argument("--merge", type=Path, nargs="+", metavar=("OUT", "RUN"),
                        help="write OUT.json from the runs that follow, each configuration's rows from the last "
                             "run that timed it (the delta rule's and the gated rule's apart); no run")
    args = parser.parse_args(argv)

    table = SMOKE_CONFIGS if args.smoke else CONFIGS
    if args.list:
        for c in table:
            print(f"{c.name:<24} B={c.B} T={c.T} H={c.H} K={c.K} V={c.V}" + (f" Hk={c.Hk}" if c.Hk != c.H else "")
                  + (f" seqlens={list(c.seqlens)}" if c.seqlens else "")
                  + (" verify" if c.verify else " decode" if c.decode else ""))
        print("implementations: " + ", ".join(IMPLS))
        reasons: Dict[str, List[str]] = {}
        for impl in IMPLS:
            for c in table:
                reason = skip_reason(impl, c)
                if reason is not None:
                    reasons.setdefault(f"{impl}: {reason}", []).append(c.name)
        print("not timed:")
        for what, names in reasons.items():
            print(f"  {what} ({', '.join(names)})")
        return 0
    if args.merge is not None:
        if len(args.merge) < 2:
            parser.error("--merge needs the file to write and at least one run")
        target, *sources = args.merge
        write_json(target, merge_runs([json.loads(p.read_text()) for p in sources]))
        print(f"wrote {target}")
        return 0
    if args.report is not None:
        print("wrote " + ", ".join(map(str, write_report(args.report, args.md))))
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
    name = args.name or ("cpu-smoke" if args.smoke else gpu_stem(torch.cuda.get_device_name(opts.device)))
    out = args.out if args.out is not None or args.smoke else RESULTS
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)

    if args.smoke:
        with _torch_backend():
            results = run(impls, configs, opts, out, name, argv)
    else:
        results = run(impls, configs, opts, out, name, argv)

    written = []
    if out is not None:
        md = out / f"{name}.md"
        md.write_text(results_markdown(results))
        written += [out / f"{name}.json", md]
        if args.plot:
            png = plot(results, out / f"{name}.png")
            written.append(png if png else "no plot: matplotlib not installed")
    print()
    print(describe_meta(results["meta"]))
    print(text_table(results["rows"]))
    print(legend(results["meta"], results["rows"]))
    if written:
        print("wrote " + ", ".join(str(w) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
