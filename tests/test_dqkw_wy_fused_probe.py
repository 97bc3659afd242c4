"""benchmarks/diagnostics/dqkw_wy_fused.py cannot rot: its smoke mode (CPU, interpreter, tiny sizes) runs and
finds the fused kernel's outputs equal to the pair's."""
import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnostics" / "dqkw_wy_fused.py"


def test_probe_smoke():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [float(e) for e in re.findall(r"rel RMS \w+ \(fused vs pair\) +(\S+)", proc.stdout)]
    assert len(errors) == 8 and max(errors) <= 1e-6, proc.stdout
    assert proc.stdout.count("FUSED_DQKW_WY=True") == 2, proc.stdout
