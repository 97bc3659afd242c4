"""tools/decode_launch_sweep.py (the gated decode step's launch configurations timed, for the GPU) runs its smoke mode:
the kernel in the interpreter under the plan's configuration and two forced ones, every time and floor positive, on
[K, V] states and on [V, K] ones (--v-first)."""
import json

import pytest

from . import run_tool


@pytest.mark.parametrize("v_first", [False, True])
def test_decode_launch_sweep_smoke(tmp_path, v_first):
    out = tmp_path / "sweep.json"
    proc = run_tool("decode_launch_sweep", "--smoke", "--out", out, *(["--v-first"] if v_first else []), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())
    assert sorted(results) == ["decode-smoke-b1", "decode-smoke-b2", "fixed_cost_us", "impl"]
    assert results.pop("impl") == "deltatron.fused_recurrent_gated" + ("_v_first" if v_first else "")
    assert results.pop("fixed_cost_us") > 0
    for r in results.values():
        labels = list(r["times"])
        assert labels[0].startswith("plan ") and labels[1:] == ["8/1", "16/1"]
        assert r["floor_us"] > 0 and all(us > 0 and pct > 0 for us, pct in r["times"].values())
