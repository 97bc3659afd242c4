"""Benchmark deltatron against fla-core and FlashQLA: `python benchmarks/run.py --plot` on a GPU writes
benchmarks/results/<gpu>.json, .md and .png.

A thin entry for a checkout where deltatron may not be installed: it puts the repository first on sys.path and
calls benchmarks/harness.py's main. `--help` lists the options."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
