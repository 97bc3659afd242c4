"""The benchmark harness (benchmarks/harness.py) cannot rot: its smoke mode (CPU, tiny sizes, PyTorch backend) runs
here and in CI and must produce the JSON the GPU run produces, with rows for every form of ours; BENCHMARKS.md and
the results' tables are generated from the committed results files."""
import importlib.machinery
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from benchmarks import configs, harness, report
from benchmarks.timing import Options

ROOT = Path(__file__).resolve().parents[2]
META_KEYS = {"date", "gpu", "torch", "triton", "fla_core", "flash_qla", "peak_tflops", "peak_tbps"}
IDENTITY_KEYS = {"impl", "config", "B", "T", "H", "K", "V"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    backend_before = os.environ.get("DELTATRON_BACKEND")
    assert harness.main(["--smoke", "--out", str(out), "--name", "smoke"]) == 0
    assert os.environ.get("DELTATRON_BACKEND") == backend_before, "smoke mode must restore DELTATRON_BACKEND"
    return out, json.loads((out / "smoke.json").read_text())


def _expected_pairs(impls):
    return {(i, c.name) for i in impls for c in configs.SMOKE_CONFIGS if configs.applies(i, c)}


def test_meta(smoke):
    _, results = smoke
    meta = results["meta"]
    assert META_KEYS <= set(meta)
    assert meta["mode"] == "smoke" and meta["peaks_measured"] is False
    assert (meta["peak_tflops"], meta["peak_tbps"]) == (configs.ANCHOR_TFLOPS, configs.ANCHOR_TBPS)


def test_one_row_per_applicable_pair(smoke):
    _, results = smoke
    pairs = [(r["impl"], r["config"]) for r in results["rows"]]
    assert len(pairs) == len(set(pairs))
    assert set(pairs) == _expected_pairs(configs.IMPLS)
    for row in results["rows"]:
        assert IDENTITY_KEYS <= set(row)
        assert row["impl"] in configs.IMPLS


def test_our_rows_are_timed_with_roofline(smoke):
    _, results = smoke
    ours = [r for r in results["rows"] if r["impl"] in configs.OURS]
    assert {(r["impl"], r["config"]) for r in ours} == _expected_pairs(configs.OURS)
    for row in ours:
        assert "error" not in row, row
        phases = ("fwd",) if row.get("decode") else ("fwd", "fwdbwd")
        for phase in phases:
            ms = row[f"{phase}_ms"]
            assert math.isfinite(ms) and ms > 0
            assert row[f"flops_{phase}"] > 0 and row[f"bytes_{phase}"] > 0
            assert row[f"pct_floor_{phase}"] == pytest.approx(100 * row[f"floor_{phase}_ms"] / ms)
            assert row[f"tflops_{phase}"] == pytest.approx(row[f"flops_{phase}"] / (ms * 1e-3) / 1e12)
        assert "peak_mem_bytes" in row and row["input_sets"] >= 1


def test_varlen_and_decode_rows(smoke):
    _, results = smoke
    rows = {(r["impl"], r["config"]): r for r in results["rows"]}
    for cfg in configs.SMOKE_CONFIGS:
        if not configs.applies("deltatron.fused_recurrent", cfg):
            continue
        row = rows[("deltatron.fused_recurrent", cfg.name)]
        if cfg.seqlens is not None:
            assert row["seqlens"] == list(cfg.seqlens) and sum(row["seqlens"]) == row["T"]
            assert len(row["seqlens"]) >= 2 and min(row["seqlens"]) >= 1
        if cfg.decode:
            assert row["decode"] is True and row["T"] == 1 and "fwdbwd_ms" not in row
            assert row["step_us"] == pytest.approx(1e3 * row["fwd_ms"])


def test_competitors_are_reported_not_run(smoke):
    _, results = smoke
    for row in results["rows"]:
        if row["impl"] not in configs.OURS:
            assert row["error"] in ("not installed", "needs CUDA: not run in smoke mode")
            assert "fwd_ms" not in row


def test_table_and_report(smoke, tmp_path):
    """The run's table names every row; --report writes BENCHMARKS.md with the table, and the results' .md and
    (with matplotlib) .png beside the JSON."""
    out, results = smoke
    table = (out / "smoke.md").read_text()
    for row in results["rows"]:
        assert f"| {row['impl']} | {row['config']} |" in table
    (out / "smoke.md").unlink()
    md = tmp_path / "BENCHMARKS.md"
    assert harness.main(["--report", str(out / "smoke.json"), "--md", str(md)]) == 0
    text = md.read_text()
    assert "| deltatron.chunk |" in text and "## How to reproduce" in text and "## Notes" in text
    assert report.NO_NOTES in text
    assert (out / "smoke.md").read_text() == table


def test_report_keeps_the_hand_written_notes(smoke, tmp_path):
    """Regenerating BENCHMARKS.md replaces the tables and keeps the Notes section as it was written."""
    out, _ = smoke
    md = tmp_path / "BENCHMARKS.md"
    assert harness.main(["--report", str(out / "smoke.json"), "--md", str(md)]) == 0
    notes = "- a note written by hand,\n  on two lines."
    md.write_text(md.read_text().replace(report.NO_NOTES, notes).replace("| deltatron.chunk |", "| edited |"))
    assert harness.main(["--report", str(out / "smoke.json"), "--md", str(md)]) == 0
    text = md.read_text()
    assert notes in text and report.NO_NOTES not in text and "| edited |" not in text


def test_committed_benchmarks_page_is_generated_from_the_results():
    """benchmarks/BENCHMARKS.md and each results file's .md are what --report makes of benchmarks/results/*.json
    (with the page's own notes): a results file changed without regenerating them fails here."""
    md = ROOT / "benchmarks" / "BENCHMARKS.md"
    files = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert files, "no committed results"
    loaded = [(p, json.loads(p.read_text())) for p in files]
    assert md.read_text() == report.render_benchmarks(loaded, md, report.kept_notes(md))
    for path, results in loaded:
        assert path.with_suffix(".md").read_text() == report.results_markdown(results)


def test_results_folder_holds_one_set_per_gpu():
    """benchmarks/results: at most 8 files, each <gpu>.json with its .md and .png, no machine's path in them."""
    files = sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir())
    assert 0 < len(files) <= 8
    stems = {name.split(".")[0] for name in files}
    assert set(files) == {f"{s}.{ext}" for s in stems for ext in ("json", "md", "png")}
    for stem in stems:
        meta = json.loads((ROOT / "benchmarks" / "results" / f"{stem}.json").read_text())["meta"]
        assert harness.gpu_stem(meta["gpu"]) == stem
        assert not any(part.startswith("/") for part in meta["command"].split()), meta["command"]


def test_gpu_names_and_the_recorded_command():
    assert harness.gpu_stem("NVIDIA H200") == "h200"
    assert harness.gpu_stem("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    inside = str(ROOT / "out" / "x")
    assert harness.command_line(["--out", inside, "--plot"]) == "deltatron bench --out out/x --plot"
    assert harness.command_line(["--out=/elsewhere/run1"]) == "deltatron bench --out run1"


def test_merge_takes_each_configuration_from_one_run(smoke, tmp_path):
    """Runs of subsets merge into one results file; a configuration timed by two runs comes wholly from the
    later one (its ratios compare rows of one process), and a not-run row of a configuration timed elsewhere
    goes."""
    _, results = smoke
    cfg_a, cfg_b = configs.SMOKE_CONFIGS[0].name, configs.SMOKE_CONFIGS[1].name
    first = dict(meta=dict(results["meta"], date="first"),
                 rows=[dict(r, fwd_ms=1.0) for r in results["rows"] if r["config"] in (cfg_a, cfg_b)
                       and "fwd_ms" in r])
    second = dict(meta=dict(results["meta"], date="second"),
                  rows=[dict(r, fwd_ms=2.0) for r in results["rows"] if r["config"] == cfg_b and "fwd_ms" in r]
                  + [dict(impl="deltatron.chunk", config=cfg_a, error="not run: time budget of 1 s spent")])
    paths = []
    for name, run in (("first", first), ("second", second)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(run))
    target = tmp_path / "merged.json"
    assert harness.main(["--merge", str(target), *map(str, paths)]) == 0
    merged = json.loads(target.read_text())
    assert merged == report.merge_runs([first, second])
    assert [m["date"] for m in merged["meta"]["runs"]] == ["first", "second"]
    # a merged file merged again with a later run: every run's meta once, in order, none nested
    third = dict(meta=dict(results["meta"], date="third"), rows=second["rows"][:1])
    again = report.merge_runs([merged, third])
    assert [m["date"] for m in again["meta"]["runs"]] == ["first", "second", "third"]
    assert not any("runs" in m for m in again["meta"]["runs"]) and again["meta"]["date"] == "first"
    by_config = {}
    for r in merged["rows"]:
        by_config.setdefault(r["config"], set()).add(r.get("fwd_ms"))
    assert by_config == {cfg_a: {1.0}, cfg_b: {2.0}}
    md = tmp_path / "BENCHMARKS.md"
    assert harness.main(["--report", str(target), "--md", str(md)]) == 0
    assert "time budget of 1 s" not in md.read_text() and "[merged.json]" in md.read_text()


def test_floor_model_matches_the_h200_anchors():
    """The floor model's anchors: 180 kFLOP and 1 KiB per token-head forward at K = V = 128; floor 0.063 ms at
    B=8, T=2048, H=16; a decode step reads and writes the state in 31.4 us."""
    peaks = configs.Peaks(configs.ANCHOR_TFLOPS, configs.ANCHOR_TBPS, measured=False)
    cfg = configs.dense(8, 2048, 16, 128)
    w = configs.work(cfg)
    assert w["flops_fwd"] / (8 * 2048 * 16) == 180224 and w["bytes_fwd"] / (8 * 2048 * 16) == 1024
    assert configs.roofline(cfg, {}, peaks)["floor_fwd_ms"] == pytest.approx(0.063, abs=5e-4)
    assert w["flops_fwdbwd"] > 3 * w["flops_fwd"] and w["bytes_fwdbwd"] > 2.5 * w["bytes_fwd"]
    floor_us = 1e3 * configs.roofline(configs.decode(64, 16, 128), {}, peaks)["floor_fwd_ms"]
    assert floor_us == pytest.approx(31.4, abs=0.5)


def test_failing_rows_are_recorded_and_the_run_goes_on(monkeypatch):
    real_resolve = harness.resolve

    def resolve(impl, smoke):
        real = real_resolve(impl, smoke)
        if impl == "deltatron.fused_chunk":     # the forward raises
            def call(x):
                raise RuntimeError("boom\nsecond line")
            return call
        if impl == "deltatron.chunk":           # the forward works, the backward cannot
            return lambda x: real(x).detach()
        return real

    monkeypatch.setattr(harness, "resolve", resolve)
    opts = Options(mode="smoke", warmup_ms=0, rep_ms=0, budget_s=60)
    with harness._torch_backend():
        results = harness.run(["deltatron.fused_chunk", "deltatron.chunk", "deltatron.fused_recurrent"],
                            configs.SMOKE_CONFIGS[:1], opts, None, "x", [], log=lambda *a, **k: None)
    no_forward, no_backward, fine = results["rows"]
    assert no_forward["error"] == "RuntimeError: boom" and "fwd_ms" not in no_forward
    assert no_backward["error"].startswith("fwd+bwd: RuntimeError")
    assert no_backward["fwd_ms"] > 0 and "fwdbwd_ms" not in no_backward and "pct_floor_fwd" in no_backward
    assert "error" not in fine and fine["fwdbwd_ms"] > 0
    table = report.text_table(results["rows"])
    assert "RuntimeError: boom" in table and "fwd+bwd: RuntimeError" in table


def test_time_budget_records_rows_as_not_run():
    opts = Options(mode="smoke", warmup_ms=0, rep_ms=0, budget_s=-1)
    results = harness.run(["deltatron.chunk"], configs.SMOKE_CONFIGS[:2], opts, None, "x", [], log=lambda *a, **k: None)
    assert [r["error"] for r in results["rows"]] == ["not run: time budget of -1 s spent"] * 2


def test_past_the_budget_a_missing_competitor_still_says_why(monkeypatch):
    def missing(impl, smoke):
        raise harness.Unavailable("not installed: No module named 'tilelang'")

    monkeypatch.setattr(harness, "resolve", missing)
    opts = Options(mode="smoke", warmup_ms=0, rep_ms=0, budget_s=-1)
    results = harness.run(["flash_qla.g0"], [configs.dense(1, 64, 1, 128)], opts, None, "x", [], log=lambda *a, **k: None)
    assert [r["error"] for r in results["rows"]] == ["not installed: No module named 'tilelang'"]


def test_script_runs_as_a_subprocess(tmp_path):
    """benchmarks/run.py finds the package from a checkout, writes where --out says, and prints the table last."""
    env = dict(os.environ, DELTATRON_BACKEND="triton")   # smoke mode must override it
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--smoke", "--configs", "decode-b2-h1-k16",
           "--impls", "deltatron.fused_recurrent,fla.fused_recurrent", "--out", str(tmp_path), "--name", "s"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [r["impl"] for r in rows] == ["deltatron.fused_recurrent", "fla.fused_recurrent"]
    assert "error" not in rows[0] and rows[0]["decode"] is True
    tail = proc.stdout.strip().splitlines()
    assert tail[-1].startswith("wrote ") and any(line.startswith("deltatron.fused_recurrent") for line in tail[-6:])


def test_unknown_names_are_refused():
    with pytest.raises(SystemExit):
        harness.main(["--smoke", "--configs", "no-such-config"])


# ---------------------------------------------------------------------------------------------------------
# The gated delta rule's rows
# ---------------------------------------------------------------------------------------------------------

GVA_SMOKE = next(c for c in configs.SMOKE_CONFIGS if c.Hk != c.H)


def test_gated_rows_run_on_every_smoke_configuration_but_decode(smoke):
    """deltatron.chunk_gated is timed (PyTorch backend) on the dense, packed and grouped-value-head smoke
    configurations; the grouped one has no row of the ungated ops, and its rows record Hk."""
    _, results = smoke
    rows = {(r["impl"], r["config"]): r for r in results["rows"]}
    for cfg in configs.SMOKE_CONFIGS:
        row = rows.get(("deltatron.chunk_gated", cfg.name))
        if cfg.decode:
            assert row is None
            continue
        assert "error" not in row and row["fwd_ms"] > 0 and row["fwdbwd_ms"] > 0, row
        ungated = rows.get(("deltatron.chunk", cfg.name))
        # the floor counts the gate's fp32 bytes, and q, k at Hk heads
        n = cfg.B * cfg.T * cfg.H
        assert row["bytes_fwd"] == configs.work(cfg)["bytes_fwd"] + 4 * n
        assert row["bytes_fwdbwd"] == configs.work(cfg)["bytes_fwdbwd"] + 12 * n
        if cfg is GVA_SMOKE:
            assert ungated is None and row["Hk"] == cfg.Hk < row["H"] == cfg.H
        else:
            assert ungated is not None and "Hk" not in row and row["flops_fwd"] == ungated["flops_fwd"]
    assert {impl for impl, config in rows if config == GVA_SMOKE.name} == set(configs.GATED) & {
        i for i in configs.IMPLS if configs.applies(i, GVA_SMOKE)}


def test_gate_is_qwen3nexts():
    """The gated inputs: the ungated ones unchanged (same seed), q and k with Hk heads, and g the fp32 log decay
    -exp(A_log) softplus(a + dt_bias) <= 0 per value head, finite, a leaf taking a gradient like q, k, v, beta."""
    cfg = configs.grouped(2, 300, 2, 4, 16)
    plain, gated = (configs.make_inputs(cfg, torch.device("cpu"), seed=3, gated=g) for g in (False, True))
    assert gated["q"].shape == gated["k"].shape == (2, 300, 2, 16) and gated["v"].shape == (2, 300, 4, 16)
    for name in ("q", "k", "v", "beta", "do"):
        assert torch.equal(plain[name], gated[name]), name
    g = gated["g"]
    assert g.shape == (2, 300, 4) and g.dtype == torch.float32 and g.is_leaf and g.requires_grad
    assert torch.isfinite(g).all() and (g <= 0).all() and g.min() < -1 and g.max() > -1
    assert not plain["g"].requires_grad and not plain["g"].any()
    takes_grad = {n for n, t in gated.items() if t.requires_grad}
    assert takes_grad == set(configs.GATED_GRAD_INPUTS) == {*configs.GRAD_INPUTS, "g"}
    # one A = exp(A_log) per value head: g / softplus(a + 1) is constant over tokens within a head
    gen = torch.Generator().manual_seed(0)
    g = configs.gate(1, 500, 3, gen, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(1, 500, 3, generator=gen)
    A = -g / torch.nn.functional.softplus(a + 1)
    assert torch.allclose(A, A[:, :1].expand_as(A), rtol=1e-5) and ((A >= 0) & (A < 16)).all()


def test_grouped_configurations_time_only_the_gated_ops():
    """Qwen3-Next's shapes (16 query/key heads, 32 value heads, K = V = 128) have rows of the three gated ops and
    no other, each skip with its reason; the gated ops run on every dense and packed configuration too."""
    for name in ("qwen3next-b8-t4096", "qwen3next-b1-t32768"):
        cfg, = configs.by_name([name])
        assert (cfg.Hk, cfg.H, cfg.K, cfg.V) == (16, 32, 128, 128)
        assert [i for i in configs.IMPLS if configs.applies(i, cfg)] == list(configs.GATED_CHUNK)
        assert "grouped value heads" in configs.skip_reason("deltatron.chunk", cfg)
    for cfg in configs.CONFIGS:
        if cfg.verify:  # deltatron's verify step only
            assert [i for i in configs.IMPLS if configs.applies(i, cfg)] == list(configs.VERIFY)
        elif cfg.decode:  # the gated decode step's rows, on grouped heads too
            assert not any(configs.applies(i, cfg) for i in configs.GATED_CHUNK + configs.VERIFY)
            assert all(configs.applies(i, cfg) for i in configs.GATED_DECODE)
        else:
            assert configs.applies("deltatron.chunk_gated", cfg) and configs.applies("fla.chunk_gated", cfg)
            assert configs.applies("flash_qla.gated", cfg) == (cfg.K == cfg.V == 128)
            assert configs.skip_reason("fla.fused_recurrent_gated", cfg) == (
                "fla.fused_recurrent_gated times the decode rows only")
            # KDA: ungrouped heads; ours chunkwise to K, V = 128, token-serial (up to RECURRENT_MAX_T tokens) above
            assert configs.applies("fla.chunk_kda", cfg) == (cfg.Hk == cfg.H)
            short = cfg.T <= configs.RECURRENT_MAX_T or max(cfg.K, cfg.V) <= 128
            assert configs.applies("deltatron.chunk_kda", cfg) == (cfg.Hk == cfg.H and short)
    assert configs.skip_reason("flash_qla.gated", configs.dense(1, 64, 1, 64)) == (
        "FlashQLA's kernels take K = V = 128 only")
    with pytest.raises(ValueError, match="multiple of Hk"):
        configs.grouped(1, 64, 3, 4, 16)


def test_gated_impls_follow_the_head_to_head_rows():
    """A run cut short by its budget keeps the comparisons: the gated head-to-head rows come right after the
    delta rule's, before the slow token-serial and fused_chunk forms."""
    order = list(configs.IMPLS)
    assert order[order.index("flash_qla.g0") + 1:][:3] == list(configs.GATED_CHUNK)
    assert all(order.index(g) < order.index(slow) for g in configs.GATED_CHUNK
               for slow in ("fla.fused_recurrent", "deltatron.fused_recurrent", "deltatron.fused_chunk"))


def test_existing_configuration_names_are_kept():
    """The committed results key rows by configuration name: every one of them is still a configuration."""
    results = json.loads((ROOT / "benchmarks" / "results" / "h200.json").read_text())
    known = {c.name: c for c in configs.CONFIGS}
    for row in results["rows"]:
        cfg = known[row["config"]]
        assert (cfg.B, cfg.T, cfg.H, cfg.Hk, cfg.K, cfg.V) == (row["B"], row["T"], row["H"], row.get("Hk", row["H"]),
                                                               row["K"], row["V"])


def _fake_module(monkeypatch, name, **attrs):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_gated_competitors_get_the_same_inputs(monkeypatch):
    """What the gated rows pass: fla's chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu,
    use_qk_l2norm_in_kernel=True), FlashQLA's with keywords, int32 cu_seqlens and the same flag, ours as fla's;
    the same tensors (grouped heads as they come, the precomputed gate) for the three."""
    seen = {}

    def recorder(key):
        def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
            seen[key] = dict(q=q, k=k, v=v, g=g, beta=beta, l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                             cu_seqlens_cpu=cu_seqlens_cpu, kwargs=kwargs)
            return v.clone(), None
        return chunk_gated_delta_rule

    _fake_module(monkeypatch, "fla")
    _fake_module(monkeypatch, "fla.ops")
    _fake_module(monkeypatch, "fla.ops.gated_delta_rule", chunk_gated_delta_rule=recorder("fla"))

    def flash_qla_op(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, head_first=False):
        return recorder("flash_qla")(q=q, k=k, v=v, g=g, beta=beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                     cu_seqlens=cu_seqlens)

    _fake_module(monkeypatch, "flash_qla", chunk_gated_delta_rule=flash_qla_op)
    monkeypatch.setattr(harness.api, "chunk_gated_delta_rule", recorder("deltatron"))
    for cfg in (GVA_SMOKE, configs.varlen(40, 3, 2, 16, seed=0)):
        x = configs.make_inputs(cfg, torch.device("cpu"), seed=0, gated=True)
        for impl in configs.GATED_CHUNK:
            harness.resolve(impl, smoke=False)(x)
        for key, call in seen.items():
            assert all(call[n] is x[n] for n in ("q", "k", "v", "g", "beta")), key
            assert call["l2norm"] is True and call["kwargs"] == {}, key
        if cfg.seqlens is None:
            assert all(call["cu_seqlens"] is None for call in seen.values())
        else:
            assert seen["fla"]["cu_seqlens"] is x["cu_seqlens"] and seen["fla"]["cu_seqlens_cpu"] is x["cu_seqlens_cpu"]
            assert seen["deltatron"]["cu_seqlens"] is x["cu_seqlens"]
            assert seen["flash_qla"]["cu_seqlens"].dtype == torch.int32
        seen.clear()


def test_gated_competitor_that_is_missing_says_why():
    opts = Options(mode="smoke", warmup_ms=0, rep_ms=0, budget_s=60)
    cfg = configs.grouped(1, 64, 1, 2, 128)
    results = harness.run(["flash_qla.gated", "fla.chunk_gated"], [cfg], opts, None, "x", [],
                          log=lambda *a, **k: None)
    for row in results["rows"]:
        assert row["error"] in ("not installed", "needs CUDA: not run in smoke mode") and row["Hk"] == 1


def test_report_compares_gated_rows_with_the_gated_competitors():
    """A gated row's vs fla / vs FlashQLA are fla.chunk_gated's and flash_qla.gated's times over its own, on the
    same configuration; delta-rule rows keep fla.chunk and flash_qla.g0; the legend explains the gated rows only
    where there are some."""
    def row(impl, config, fwd, fwdbwd, **extra):
        return dict(impl=impl, config=config, fwd_ms=fwd, fwdbwd_ms=fwdbwd, **extra)

    rows = [row("deltatron.chunk", "b8", 1.0, 4.0), row("fla.chunk", "b8", 2.0, 6.0),
            row("flash_qla.g0", "b8", 1.5, 5.0),
            row("deltatron.chunk_gated", "b8", 1.0, 4.0), row("fla.chunk_gated", "b8", 3.0, 8.0),
            row("flash_qla.gated", "b8", 0.5, 2.0),
            row("deltatron.chunk_gated", "qwen", 2.0, 5.0, Hk=16), row("fla.chunk_gated", "qwen", 4.0, 10.0, Hk=16),
            dict(impl="flash_qla.gated", config="qwen", Hk=16, error="not installed")]
    assert report.speedup(rows, rows[0], "fla", "fwd") == 2.0
    assert report.speedup(rows, rows[0], "flash_qla", "fwdbwd") == 1.25
    assert report.speedup(rows, rows[3], "fla", "fwd") == 3.0 and report.speedup(rows, rows[3], "fla", "fwdbwd") == 2.0
    assert report.speedup(rows, rows[3], "flash_qla", "fwd") == 0.5
    assert report.speedup(rows, rows[6], "fla", "fwdbwd") == 2.0
    assert report.speedup(rows, rows[6], "flash_qla", "fwd") is None   # FlashQLA's row failed
    cells = {(c[0], c[1]): c for c in report.table_cells(rows)}
    assert cells[("deltatron.chunk_gated", "b8")][4:6] == ("3.00 / 2.00", "0.50 / 0.50")
    assert cells[("deltatron.chunk_gated", "qwen")][4:6] == ("2.00 / 2.00", "")
    assert cells[("flash_qla.gated", "qwen")][-1] == "not installed"
    meta = dict(peak_tflops=800.0, peak_tbps=4.27, peaks_measured=False)
    assert "fla.chunk_gated" in report.legend(meta, rows) and "query/key heads" in report.legend(meta, rows)
    assert report.legend(meta, rows[:3]) == report.legend(meta)
    assert "fla.chunk_gated" not in report.legend(meta, rows[:3])


def test_floor_model_counts_the_gate_and_grouped_heads():
    """Gated: + 4 bytes (fp32 g read) a value token-head forward, + 12 forward+backward (g read twice, dg
    written); grouped value heads: q, k and their gradients at Hk heads, the FLOPs per value head."""
    dense, grouped = configs.dense(1, 4096, 32, 128), configs.qwen3next(1, 4096)
    n, nk = 4096 * 32, 4096 * 16
    plain, gated = configs.work(dense), configs.work(dense, gated=True)
    assert gated["bytes_fwd"] - plain["bytes_fwd"] == 4 * n and gated["bytes_fwdbwd"] - plain["bytes_fwdbwd"] == 12 * n
    assert gated["flops_fwd"] == plain["flops_fwd"] and gated["flops_fwdbwd"] == plain["flops_fwdbwd"]
    gva = configs.work(grouped, gated=True)
    assert gva["flops_fwd"] == gated["flops_fwd"]
    assert gated["bytes_fwd"] - gva["bytes_fwd"] == (n - nk) * 2 * 2 * 128       # q and k read at Hk heads
    assert gated["bytes_fwdbwd"] - gva["bytes_fwdbwd"] == (n - nk) * 2 * 6 * 128  # q, k, dq, dk; read twice


def test_merge_adds_gated_rows_to_an_earlier_run():
    """A run of the gated ops merged after one of the delta rule on the same configuration keeps both families
    (each family's ratios still compare rows of one process); a later gated run replaces the earlier gated rows;
    the merged rows are in IMPLS order."""
    def row(impl, config, ms):
        return dict(impl=impl, config=config, fwd_ms=ms)

    meta = dict(date="d")
    delta = dict(meta=meta, rows=[row("deltatron.chunk", "b8", 1.0), row("fla.chunk", "b8", 2.0),
                                  row("deltatron.fused_recurrent", "b8", 9.0)])
    gated = dict(meta=meta, rows=[row("deltatron.chunk_gated", "b8", 3.0), row("fla.chunk_gated", "b8", 4.0),
                                  row("deltatron.chunk_gated", "qwen", 5.0)])
    again = dict(meta=meta, rows=[row("fla.chunk_gated", "b8", 6.0)])
    merged = report.merge_runs([delta, gated, again])["rows"]
    assert [(r["impl"], r["config"], r["fwd_ms"]) for r in merged] == [
        ("deltatron.chunk", "b8", 1.0), ("fla.chunk", "b8", 2.0), ("deltatron.chunk_gated", "qwen", 5.0),
        ("fla.chunk_gated", "b8", 6.0), ("deltatron.fused_recurrent", "b8", 9.0)]


def test_verify_rows(smoke):
    """The speculative verify step (deltatron.verify_gated) is timed on the verify configurations only, from a pool
    with a slot per token and accepted tokens in [1, T]; its floor reads one state a sequence and writes one a token."""
    _, results = smoke
    cfg = next(c for c in configs.SMOKE_CONFIGS if c.verify)
    rows = [r for r in results["rows"] if r["config"] == cfg.name]
    assert [r["impl"] for r in rows] == list(configs.VERIFY)
    row = rows[0]
    assert "error" not in row and row["verify"] is True and row["decode"] is True and row["step_us"] > 0
    B, T, H, Hk, K, V = cfg.B, cfg.T, cfg.H, cfg.Hk, cfg.K, cfg.V
    assert row["bytes_fwd"] == (B * H + B * T * H) * 4 * K * V + B * T * H * (2 * 2 * V + 4) + B * T * Hk * 2 * 2 * K
    x = configs.make_inputs(cfg, torch.device("cpu"), seed=0, gated=True)
    assert x["pool"].shape == (B * T, H, K, V) and x["slots"].tolist() == [[b * T + t for t in range(T)]
                                                                           for b in range(B)]
    assert x["accepted"].dtype == torch.int32 and ((x["accepted"] >= 1) & (x["accepted"] <= T)).all()
    assert "h" not in x and x["g"].shape == (B, T, H)
    assert "verify: 3 tokens per sequence" in report.table_cells(rows)[0][-1]
    assert report.speedup(results["rows"], row, "fla", "fwd") is None
