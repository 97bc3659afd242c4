"""Tests of tools/: each tool run as a script, as a user runs it (run_tool)."""
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def run_tool(name: str, *args, timeout: int = 600, **kwargs) -> subprocess.CompletedProcess:
    """tools/<name>.py run with these arguments by this Python, its output captured as text; kwargs go to
    subprocess.run (cwd, env)."""
    return subprocess.run([sys.executable, str(TOOLS / f"{name}.py"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kwargs)
