"""tools/kernel_breakdown.py (each implementation's kernels timed under torch.profiler, for the GPU) runs its smoke
mode: our forward and forward+backward on the CPU, their ops listed and saved, the competitors said to be
unavailable."""
import json

from . import run_tool


def test_kernel_breakdown_smoke(tmp_path):
    out = tmp_path / "kb.json"
    proc = run_tool("kernel_breakdown", "--smoke", "--out", out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "deltatron.chunk fwd:" in proc.stdout and "deltatron.chunk fwdbwd:" in proc.stdout
    results = json.loads(out.read_text())
    assert sorted(results) == ["b2-t40-h1-k16 deltatron.chunk fwd", "b2-t40-h1-k16 deltatron.chunk fwdbwd"]
    assert all(ms >= 0 and launches > 0 for rows in results.values() for ms, launches in rows.values())
