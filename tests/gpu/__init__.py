"""GPU-only tests (marked gpu; skipped without CUDA). Realistic sizes; run them with tests/gpu/run_suite.py."""
import os
import subprocess
import sys
from typing import Optional

import pytest
import torch

# (B, T, H, head size K = V, chunk size) of the chunk pipeline's fixed-length tests, forward and backward:
# long and short sequences, B*H up to 64, every head size class (16, 64, 128, 256 and 100), every chunk size
CHUNK_SHAPES = [
    (2, 8192, 4, 128, 64),
    (4, 2048, 16, 64, 64),
    (1, 4096, 8, 256, 64),
    (8, 1000, 8, 100, 32),
    (2, 777, 32, 128, 16),
    (8, 128, 4, 16, 64),  # 16-wide heads (deltatron train's CPU preset), where the fused WY kernel once failed on the GPU
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GLUON_SMOKE_TIMEOUT_S = 240  # compiles (seconds) and runs a small call (microseconds)


def gluon_smoke(code: str, *args: str) -> Optional[str]:
    """Runs code (python -c, args after it: a small call of a Gluon kernel) in a child process under
    GLUON_SMOKE_TIMEOUT_S and returns why it failed, or None. The Gluon kernels' partitions wait on each other
    through mbarriers: a wrong phase hangs the GPU rather than failing a test, and would take the whole suite
    with it, so each Gluon test file runs its kernel here before any launch in its own process. Skips the
    calling test off sm_90 or without Gluon."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are written for sm_90 (wgmma, TMA, setmaxnreg)")
    pytest.importorskip("triton.experimental.gluon")
    try:
        proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=GLUON_SMOKE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        return (f"did not finish in {GLUON_SMOKE_TIMEOUT_S} s (a hang: mbarrier phases?); its output: "
                f"{e.stdout!r} {e.stderr!r}")
    print(proc.stdout.strip())
    return f"failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}" if proc.returncode else None


def smoke_both_widths(code: str, kernel: str) -> None:
    """gluon_smoke at both V-block widths (block_v 128 and 64) before a test of another file launches the kernel;
    fails the calling test with the first failure."""
    for block_v in ("128", "64"):
        failure = gluon_smoke(code, block_v)
        if failure:
            pytest.fail(f"{kernel}'s smoke call (block_v {block_v}) " + failure, pytrace=False)


def require_smoke_passed(smoke_failures: dict, request, widths, kernel: str) -> None:
    """Fails the calling test unless the smoke calls (smoke_failures: {block_v: gluon_smoke's result}) of the
    V-block widths it runs passed: its block_v parameter, or every width for a test without one."""
    callspec = getattr(request.node, "callspec", None)
    runs = [callspec.params["block_v"]] if callspec is not None and "block_v" in callspec.params else widths
    failed = [f"block_v {block_v}: {smoke_failures[block_v]}" for block_v in runs if smoke_failures[block_v]]
    if failed:
        pytest.fail(f"{kernel}'s smoke call " + "\n".join(failed), pytrace=False)
