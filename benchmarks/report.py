"""The benchmark's output: the text and markdown tables, the speedup plot, one results file merged from several
runs, and BENCHMARKS.md (one section per GPU's results file, a hand-written Notes section kept across
regenerations, and how to reproduce)."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from benchmarks.configs import GATED, IMPLS, KDA, RECURRENT_MAX_T, VERIFY


def baseline_impl(competitor: str, row: dict) -> Optional[str]:
    """The row a ratio column compares with: the competitor's form of the same rule (a gated row's is the
    competitor's gated op with the same gate, a delta-rule row's fla's chunk or fused_recurrent, FlashQLA's with
    g = 0)."""
    if row["impl"] in KDA:  # FlashQLA has no KDA: no ratio against it
        return "fla.chunk_kda" if competitor == "fla" else None
    if row.get("verify"):  # no competitor's verify step is timed
        return None
    if row["impl"] in GATED:
        if competitor == "fla":
            return "fla.fused_recurrent_gated" if row.get("decode") else "fla.chunk_gated"
        return "flash_qla.gated"
    if competitor == "fla":
        return "fla.fused_recurrent" if row.get("decode") else "fla.chunk"
    return "flash_qla.g0"


def has_gated(rows: Sequence[dict]) -> bool:
    return any(r["impl"] in GATED for r in rows)


def speedup(rows: Sequence[dict], row: dict, competitor: str, phase: str) -> Optional[float]:
    """Competitor's time / this row's time on the same configuration (> 1: this row is faster)."""
    base = baseline_impl(competitor, row)
    if base is None:
        return None
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
                "TFLOP/s f / fb", "% floor f / fb", "host ms f / fb", "peak mem", "note")


def table_cells(rows: Sequence[dict]) -> List[Tuple[str, ...]]:
    out = []
    for r in rows:
        if "fwd_ms" not in r:
            out.append((r["impl"], r["config"], "", "", "", "", "", "", "", "", r["error"]))
            continue
        fwd = f"{r['step_us']:.1f} us" if r.get("decode") else f"{r['fwd_ms']:.3f}"
        fwdbwd = f"{r['fwdbwd_ms']:.3f}" if "fwdbwd_ms" in r else ""
        ratios = [_pair(speedup(rows, r, c, "fwd"), speedup(rows, r, c, "fwdbwd"), ".2f") for c in ("fla", "flash_qla")]
        note = r.get("error") or (f"verify: {r['T']} tokens per sequence, a state slot each" if r.get("verify") else
                                  "decode: one token per step" if r.get("decode") else "")
        if r.get("graph_error"):
            note += f"; eager time (no CUDA graph: {r['graph_error']})"
        elif r.get("eager_step_us") is not None:
            note += f"; eager step {r['eager_step_us']:.1f} us"
        out.append((r["impl"], r["config"], fwd, fwdbwd, *ratios,
                    _pair(r.get("tflops_fwd"), r.get("tflops_fwdbwd"), ".1f"),
                    _pair(r.get("pct_floor_fwd"), r.get("pct_floor_fwdbwd"), ".1f"),
                    _pair(r.get("host_fwd_ms"), r.get("host_fwdbwd_ms"), ".3f"),
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


def legend(meta: dict, rows: Sequence[dict] = ()) -> str:
    """The table's legend; with gated rows among rows, what their ratios compare and which rows they skip."""
    runs = meta.get("runs", [meta])  # merged runs: each row's floor uses its own run's ceilings
    peaks = ("measured in " + ("this run" if len(runs) == 1 else "each run") if meta.get("peaks_measured")
             else "H200 anchors, not measured")
    tflops = " / ".join(f"{m['peak_tflops']:.0f}" for m in runs)
    tbps = " / ".join(dict.fromkeys(f"{m['peak_tbps']:.2f}" for m in runs))
    text = (f"bf16. f = forward (no_grad), fb = forward+backward. vs X = X's time / this row's time (> 1: faster "
            f"than X; fla's decode baseline is its fused_recurrent, gated or not). Floor = max(FLOPs / {tflops} "
            f"TFLOP/s, bytes / {tbps} TB/s) ({peaks}; counts in docs/performance.md); % floor = "
            "floor / time. Host ms: the host's time of one call (back-to-back calls, benchmarks/timing.py host_ms); "
            "a row whose host time exceeds its GPU time is host-bound for eager callers. Decode and verify rows time "
            "the step's GPU work as a replayed CUDA graph, as engines run it; the note gives an eager call's step "
            "time. Peak mem: one forward+backward's (decode: one step's) allocation above its inputs. "
            f"fused_recurrent runs T <= {RECURRENT_MAX_T} only; FlashQLA K = V = 128 only.")
    if has_gated(rows):
        text += (" Gated rows (" + ", ".join(GATED) + "): the gated delta rule with Qwen3-Next's gate "
                 "g = -exp(A_log) softplus(a + dt_bias) (A_log = log(uniform(0, 16)), dt_bias = 1) computed "
                 "outside the op, q and k L2-normalized in it, gradients to q, k, v, g and beta; their vs fla and "
                 "vs FlashQLA compare with fla.chunk_gated (decode: fla.fused_recurrent_gated) and flash_qla.gated, "
                 "and their floor counts the fp32 gate's bytes. KDA rows (" + ", ".join(KDA) + "): a gate per key "
                 "channel as Kimi Linear makes it (configs.kimi_gate: its forget gate at its initialization, A_log = "
                 "log(uniform(1, 16)) per head, dt_bias the inverse softplus of dt log-uniform in [1e-3, 1e-1] per "
                 "head and channel, the projection's output randn), compared with fla.chunk_kda; ours runs the "
                 "chunkwise kernels on the Triton backend; tools/kernel_breakdown.py --strong-kda-gate times "
                 "Qwen3-Next's per-head gate drawn per channel instead (down to -64 a token: our per-channel stages' "
                 "exact path).")
    if any(r.get("verify") for r in rows):
        text += (" Verify rows (" + ", ".join(VERIFY) + "): a speculative-decoding verify step as vLLM and SGLang "
                 "call it, T draft tokens per sequence from the state slot num_accepted_tokens picks, the state "
                 "after every token written to its own slot of an fp32 pool (the floor: one state read a sequence "
                 "and one written a token); no competitor's verify step is timed.")
    if any("Hk" in r for r in rows):
        text += (" Configurations with fewer query/key heads (Hk) than value heads (H; qwen3next-*: 16 and 32) "
                 "have rows of the gated ops only: fla's and FlashQLA's ungated delta rule take one head count for "
                 "q, k and v.")
    return text


def describe_meta(meta: dict) -> str:
    return (f"{meta['date']}  {meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  deltatron "
            f"{meta['deltatron']}  fla-core {meta['fla_core'] or 'not installed'}  flash-qla "
            f"{meta['flash_qla'] or 'not installed'}  ceilings {meta['peak_tflops']:.0f} TFLOP/s, "
            f"{meta['peak_tbps']:.2f} TB/s ({'measured' if meta['peaks_measured'] else 'anchors'})  mode {meta['mode']}")


def write_json(path: Path, results: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, path)


def results_markdown(results: dict) -> str:
    """<name>.md beside a results file: what ran, the table and its legend."""
    return (f"{describe_meta(results['meta'])}\n\n{markdown_table(results['rows'])}\n\n"
            f"{legend(results['meta'], results['rows'])}\n")


def plot(results: dict, path: Path) -> Optional[Path]:
    """Speedup over fla per configuration (a gated row's over fla's gated op), forward and forward+backward
    panels; None without matplotlib."""
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
            label = f"{impl} (vs {baseline_impl('fla', dict(impl=impl))})" if impl in GATED else impl
            ax.bar([i + (j - (len(impls) - 1) / 2) * width for i in range(len(configs))], ys, width, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(f"speedup vs fla, {title}")
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_xticks(range(len(configs)))
    axes[1].set_xticklabels(configs, rotation=30, ha="right")
    axes[0].legend(fontsize=8)
    meta = results["meta"]
    fig.suptitle(f"{meta['gpu']}, bf16: time of fla-core {meta['fla_core']} / time of each (> 1 is faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})  # no version stamp: the same data, the same file
    plt.close(fig)
    return path


def merge_runs(runs: Sequence[dict]) -> dict:
    """One results set from runs that timed different configurations (a run split over several processes, or one
    that adds configurations or the gated rows to an earlier one). Every configuration's rows of one family (the
    delta rule's, the gated rule's: the rows a ratio compares) come from one run, the last that timed them, so each
    row's ratios compare implementations timed in the same process; rows that were not run are left out when
    another run has them. Rows are in IMPLS order, each implementation's in the order of the runs. meta is the
    first run's, with every run's meta under "runs"."""
    def key(r):
        return r["config"], r["impl"] in GATED

    source = {}  # (config, gated) -> index of the run its rows come from: the last that timed them, else the last
    for timed_only in (False, True):
        for i, run in enumerate(runs):
            for r in run["rows"]:
                if not timed_only or "fwd_ms" in r:
                    source[key(r)] = i
    rows = [r for i, run in enumerate(runs) for r in run["rows"] if source[key(r)] == i]
    order = {impl: j for j, impl in enumerate(IMPLS)}
    rows.sort(key=lambda r: order.get(r["impl"], len(order)))
    metas = []  # every run's meta once, in order, none nested (a file merged before brings its own runs')
    for m in (m for run in runs for m in flat_runs(run["meta"])):
        if m not in metas:
            metas.append(m)
    return dict(meta=dict(metas[0], runs=metas), rows=rows)


def flat_runs(meta: dict) -> List[dict]:
    """The metas of the runs behind a results file's meta, without their "runs": [meta] for one run's file."""
    own = {k: v for k, v in meta.items() if k != "runs"}
    return [own] if "runs" not in meta else [m for r in meta["runs"] for m in flat_runs(r)]


NOTES_START = "<!-- notes: written by hand; `--report` keeps this section as it is -->"
NOTES_END = "<!-- end of notes -->"
NO_NOTES = "None yet."


def kept_notes(md_path: Path) -> str:
    """The hand-written Notes section of an existing BENCHMARKS.md (between NOTES_START and NOTES_END), else
    NO_NOTES."""
    if not md_path.exists():
        return NO_NOTES
    found = re.search(re.escape(NOTES_START) + r"\n(.*?)\n?" + re.escape(NOTES_END), md_path.read_text(), re.S)
    return found.group(1).strip() if found else NO_NOTES


def render_benchmarks(results_files: Sequence[Tuple[Path, dict]], md_path: Path, notes: str) -> str:
    """BENCHMARKS.md at md_path: a section per GPU's results file (what ran, the table, the legend and the plot
    where <name>.png exists beside it), the Notes section (notes, written by hand), and how to reproduce."""
    rel = lambda p: os.path.relpath(p, md_path.parent)  # noqa: E731
    gated = any(has_gated(results["rows"]) for _, results in results_files)
    parts = ["# Benchmarks\n",
             "deltatron's chunk, fused_chunk and fused_recurrent delta rule against fla-core's chunk_delta_rule "
             "and FlashQLA's chunk_gated_delta_rule with g = 0"
             + (", and the gated delta rule (chunk_gated_delta_rule with a real gate) against fla-core's and "
                "FlashQLA's" if gated else "")
             + ", forward and forward+backward, bf16, with the "
             "fraction of the roofline floor each reaches. Method and floor model: "
             f"[docs/performance.md]({rel(md_path.parents[1] / 'docs' / 'performance.md')}). Generated from "
             "each GPU's results file by `python benchmarks/run.py --report "
             + " ".join(os.path.relpath(p, md_path.parents[1]) for p, _ in results_files)
             + "`; only the Notes section is written by hand.\n"]
    if not results_files:
        parts.append("No GPU run is committed yet; the steps below produce one.\n")
    for path, results in results_files:
        meta = results["meta"]
        parts.append(f"## {meta['gpu']}\n")
        parts.append(f"Raw numbers: [{path.name}]({rel(path)}). {describe_meta(meta)}.\n")
        parts.append(markdown_table(results["rows"]) + "\n")
        parts.append(legend(meta, results["rows"]) + "\n")
        png = path.with_suffix(".png")
        if png.exists():
            parts.append(f"![speedup over fla on {meta['gpu']}]({rel(png)})\n")
    parts.append(f"## Notes\n\n{NOTES_START}\n{notes.strip()}\n{NOTES_END}\n")
    parts.append(REPRODUCE)
    return "\n".join(parts)


REPRODUCE = """\
## How to reproduce

The run needs one CUDA GPU (FlashQLA needs Hopper or newer), torch, triton and matplotlib, and the competitors
as optional imports: a competitor that is not importable gives rows "not installed".

1. On the GPU machine, install the fla-core and FlashQLA (with tilelang) wheels and put them on PYTHONPATH
   (`pip install fla-core==0.6.0 flash-qla==0.1.3` where the machine has a package index). TileLang loads z3's
   library (the z3-solver wheel) on import. Without TileLang, fla-core 0.6.0 refuses its gated backward on Hopper
   with Triton 3.4 to 3.7.0 (it names a Triton bug, its issue #640), so fla.chunk_gated's forward+backward then
   reads as an error.
2. From the checkout: `python benchmarks/run.py --plot` (in a checkout `deltatron bench --plot` is the same). It
   writes `benchmarks/results/<gpu>.json`, `.md` and `.png` (`h200` on an H200), the one results set of that GPU
   (git keeps the earlier ones), or under `--out DIR` / `--name NAME`. `bash benchmarks/gpu_call.sh bench`
   runs it in one call of a device with a time limit, with `BENCH_ARGS` and `BENCH_BUDGET_S`, writing under
   `$OUT` (default `./out`).
   fla-core autotunes for 80-130 s on each new shape and FlashQLA compiles its TileLang kernels on first use,
   1-3 minutes a shape: rows not started after `--budget-s` (default 480 s) are recorded as not run, but a row
   that starts runs to its end. A table that does not fit one call can be run in subsets (`--configs`) and
   merged: `python benchmarks/run.py --merge benchmarks/results/<gpu>.json first.json second.json` (each
   configuration's rows from the last run that timed it). Run with nothing else on the host: the host-bound rows
   (b1-t32768-h16's split forward, the packed sequences) read the host's time where it exceeds the GPU's
   (`python tools/host_time.py` times the two apart).
3. Commit the results files and regenerate this page and the results' `.md` and `.png`:
   `python benchmarks/run.py --report benchmarks/results/<gpu>.json [other GPUs' files]`.

Options: `--configs NAME ...`, `--impls NAME ...`, `--quick` (fewer iterations), `--smoke` (CPU, tiny sizes:
the CI guard in tests/benchmarks/test_harness.py), `--list`.
"""
