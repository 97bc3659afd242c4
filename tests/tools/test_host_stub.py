"""tools/host_stub.py (the host's own work in the benchmark's calls with every launch stubbed) runs its smoke mode:
a row per (deltatron row, smoke configuration), each with its launches and torch operations counted and its
Python time; and refuses rows that are not deltatron's."""

from . import run_tool


def run(*args):
    return run_tool("host_stub", *args)


def test_smoke_rows():
    proc = run("--smoke", "--configs", "b2-t40-h1-k16", "b2-t40-hk1-hv2-k16")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["deltatron.chunk", "b2-t40-h1-k16"], ["deltatron.chunk_gated", "b2-t40-h1-k16"],
                                     ["deltatron.chunk_kda", "b2-t40-h1-k16"],
                                     ["deltatron.chunk_gated", "b2-t40-hk1-hv2-k16"]]
    for r in rows:  # fwd µs, launches, ops, fwd+bwd µs, launches, ops
        fwd_us, fwd_launches, fwd_ops, fb_us, fb_launches, fb_ops = (float(c) for c in r[2:])
        # Smoke mode times two calls on a shared CPU, so only the counts are ordered; the times need only exist.
        assert fwd_us > 0 and fb_us > 0
        assert 0 < fwd_launches < fb_launches and 0 < fwd_ops < fb_ops


def test_refuses_other_rows():
    proc = run("--smoke", "--impls", "fla.chunk")
    assert proc.returncode == 2 and "not one of deltatron's benchmark rows" in proc.stderr
