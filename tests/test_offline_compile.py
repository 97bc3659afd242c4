"""Every Triton launch of the four forms (forward and backward, bf16) compiles for the H200 (sm_90) within
its shared memory, checked on this machine without a GPU (benchmarks/diagnostics/offline_compile.py, with
the installed triton: the compile errors and shared-memory overflows that otherwise first show on the GPU)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnostics" / "offline_compile.py"


@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_all_forms_compile_for_sm90(head_size):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real kernels, not the interpreter
    proc = subprocess.run([sys.executable, str(SCRIPT), "--heads", str(head_size)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if " regs " in line]
    # chunk: 9 launches (the state pass twice); fused_chunk 3; fused_recurrent 2; parallel 5
    assert len(rows) == 19, proc.stdout
    assert all(" regs  -1" not in line for line in rows), proc.stdout
