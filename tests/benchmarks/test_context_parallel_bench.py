"""The context-parallel scaling benchmark (benchmarks/context_parallel.py) cannot rot: 2 gloo processes on the CPU at
tiny sizes run every measurement the two-GPU run makes and write its JSON and table; bad options are refused before
any process starts."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "context_parallel.py"
TINY = ["--device", "cpu", "--heads-k", "1", "--heads-v", "2", "--head-dim", "16", "--warmup", "1", "--reps", "2"]


def bench(*args, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})})


def test_two_gloo_processes(tmp_path):
    out = tmp_path / "cp.json"
    run = bench("--world", "2", "--tokens", "32", "48", "--out", str(out), *TINY)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())
    assert (results["world"], results["Hk"], results["Hv"], results["K"], results["dtype"]) == (2, 1, 2, 16, "bf16")
    rows = results["rows"]
    assert [(r["T"], r["mode"]) for r in rows] == [(32, "fwd"), (32, "fwdbwd"), (48, "fwd"), (48, "fwdbwd")]
    for r in rows:
        assert r["single_error"] is None
        for part in ("local", "sharded"):
            assert len(r[f"{part}_ms_per_rank"]) == 2 and all(ms > 0 for ms in r[f"{part}_ms_per_rank"])
            assert r[f"{part}_ms"] == max(r[f"{part}_ms_per_rank"])
        assert r["speedup"] == pytest.approx(r["single_ms"] / r["sharded_ms"])
        both = r["allgather_ms"] + (r["reduce_scatter_ms"] if r["mode"] == "fwdbwd" else 0)
        assert r["collective_ms"] == pytest.approx(both) and r["allgather_ms"] > 0
        assert (r["reduce_scatter_ms"] is None) == (r["mode"] == "fwd")
        assert all(math.isfinite(r[k]) for k in ("single_ms", "sharded_ms", "local_ms", "collective_ms"))
    table = run.stdout.strip().splitlines()[-5:]
    assert table[0].split()[:3] == ["T", "mode", "1"], run.stdout
    assert [line.split()[:2] for line in table[1:]] == [["32", "fwd"], ["32", "fwdbwd"], ["48", "fwd"],
                                                        ["48", "fwdbwd"]]


@pytest.mark.parametrize("args, env, message", [
    (["--world", "2", "--tokens", "33"], {}, "--tokens 33: each must be a positive multiple of the 2 processes"),
    (["--world", "2", "--tokens", "0"], {}, "--tokens 0: each must be a positive multiple"),
    (["--world", "0"], {}, "--world must be at least 1, got 0"),
    (["--world", "2", "--heads-k", "3", "--heads-v", "4"], {}, "--heads-v 4 must be a multiple of --heads-k 3"),
    (["--world", "2", "--reps", "0"], {}, "--reps must be at least 1"),
    (["--world", "2", "--warmup", "-1"], {}, "--warmup must be at least 0"),
    (["--tokens", "64"], {}, "run under torchrun --nproc-per-node N, or give --world N"),
    (["--world", "2"], {"WORLD_SIZE": "2"}, "leave it out under torchrun"),
    (["--world", "2", "--device", "cuda"], {"CUDA_VISIBLE_DEVICES": ""}, "--device cuda needs 2 GPUs on this node"),
    (["--world", "2", "--modes", "bwd"], {}, "invalid choice: 'bwd'"),
])
def test_refusals(args, env, message):
    run = bench(*args, env=env)
    assert run.returncode == 2 and message in run.stderr, run.stderr
