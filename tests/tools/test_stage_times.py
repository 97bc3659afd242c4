"""tools/stage_times.py (each stage of the chunk forward and backward, and the decode step, timed apart on the
GPU) runs its smoke mode: every stage of the forward (both walks) and backward timed (and the backward's unfused
local dV' and reverse state pass), the forward's sum over the walk it runs, and the decode step."""
import json

import pytest

from benchmarks import configs

from . import run_tool


def test_stage_times_smoke(tmp_path):
    out = tmp_path / "stages.json"
    proc = run_tool("stage_times", "--smoke", "--out", out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    times = json.loads(out.read_text())
    dense = times[configs.SMOKE_CONFIGS[0].name]
    # the backward's recompute is one stage (W, U on chip) or two (recompute W, U; state pass), the other
    # listed as unfused, beside the unfused local dV' and reverse pass
    on_chip = "bwd: state pass again, W, U on chip" in dense
    assert sum(name.startswith("fwd:") for name in dense) == 1
    assert sum(name.startswith("bwd:") for name in dense) == (4 if on_chip else 5)
    assert sum(name.startswith("fwd, fused walk:") for name in dense) == 1
    assert sum(name.startswith("unfused:") for name in dense) == (4 if on_chip else 3)
    plain = [t for name, t in dense.items() if name.startswith("fwd, plain walk:")]
    assert len(plain) == 2  # at K = 16 the forward runs the plain walk: the sum counts it
    assert dense["sum of forward stages"] == pytest.approx(dense["fwd: wy_fwd (A, Tinv, W, U)"] + sum(plain))
    assert all(t > 0 for t in dense.values())
    assert "API call" in times[configs.SMOKE_CONFIGS[2].name]
