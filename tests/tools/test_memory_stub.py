"""tools/memory_stub.py (the tensors alive in the benchmark's calls with every launch stubbed) runs its smoke mode: a
row per (deltatron row, smoke configuration) whose peaks hold at least what the call returns (o; o and the
gradients), at a line of deltatron; and refuses rows that are not deltatron's."""
import json

from . import run_tool


def test_smoke_rows(tmp_path):
    out = tmp_path / "rows.json"
    proc = run_tool("memory_stub", "--smoke", "--configs", "b2-t40-h1-k16", "b2-t40-hk1-hv2-k16", "--live",
                    "--json", out)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert [(r["impl"], r["config"]) for r in rows] == [
        ("deltatron.chunk", "b2-t40-h1-k16"), ("deltatron.chunk_gated", "b2-t40-h1-k16"),
        ("deltatron.chunk_kda", "b2-t40-h1-k16"), ("deltatron.chunk_gated", "b2-t40-hk1-hv2-k16")]
    for r in rows:
        Hk, Hv = (1, 2) if "hv2" in r["config"] else (1, 1)
        tokens, K = 2 * 40, 16
        o = tokens * Hv * K * 2  # bf16
        grads = 2 * tokens * Hk * K * 2 + tokens * Hv * K * 2 + tokens * Hv * 2  # dq, dk, dv, dbeta
        assert r["inputs"] >= 4 * tokens * Hk * K * 2  # at least q, k, v, do
        assert r["fwd"] >= o and r["fwdbwd"] >= o + grads
        assert r["fwdbwd_line"].startswith(("kernels/", "api.py", "autograd.py", "l2norm.py"))
    assert "input q" in proc.stdout  # --live lists the tensors alive at the peak


def test_refuses_other_rows():
    proc = run_tool("memory_stub", "--smoke", "--impls", "fla.chunk")
    assert proc.returncode == 2 and "not one of deltatron's benchmark rows" in proc.stderr
