"""Benchmark deltatron against fla-core and FlashQLA: `python benchmarks/run.py --out benchmarks/results/`.

A thin entry for a checkout where deltatron may not be installed; the suite is deltatron.bench (also
`deltatron bench`). `--help` lists the options."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltatron.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
