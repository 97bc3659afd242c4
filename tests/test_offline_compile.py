"""Every Triton launch of the four forms (forward and backward, bf16) compiles for the H200 (sm_90) within
its shared memory, checked on this machine without a GPU (benchmarks/diagnostics/offline_compile.py, with
the installed triton: the compile errors and shared-memory overflows that otherwise first show on the GPU)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnostics" / "offline_compile.py"


def compile_rows(*args):
    """The script's rows (one per compiled launch) for these arguments; fails on any failed compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real kernels, not the interpreter
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if " regs " in line]
    assert all(" regs  -1" not in line for line in rows), proc.stdout
    return rows


@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_all_forms_compile_for_sm90(head_size):
    # chunk: 9 launches (the state pass twice); fused_chunk 3; fused_recurrent 2; parallel 5
    assert len(compile_rows("--heads", str(head_size))) == 19


def test_fp32_chunk_at_head_size_256_fits_shared_memory():
    # fp32 tiles are twice the size: the reverse state pass at K = 256 needs its narrower V-block (it used
    # 237,568 bytes of shared memory at BV = 32, over sm_90's 232,448, with 16 sequences x heads or more)
    rows = compile_rows("--dtype", "fp32", "--heads", "256", "--forms", "chunk")
    assert len(rows) == 9 and any("state_bwd_kernel" in row and "BV=16" in row for row in rows)
