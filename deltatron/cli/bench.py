"""`deltatron bench`: runs the benchmark harness of a source checkout, benchmarks/harness.py (its
`--help` lists the options). The harness and its results live in the repository, not in the installed
package: from a non-editable install this command says so and exits 2."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

from . import fail


def benchmarks_dir() -> Path:
    """The checkout's benchmarks/ folder: next to the deltatron package folder in an editable install."""
    import deltatron

    return Path(deltatron.__file__).resolve().parents[1] / "benchmarks"


def main(argv=None) -> int:
    folder = benchmarks_dir()
    if not (folder / "harness.py").is_file():
        return fail("bench", f"needs a source checkout of deltatron (pip install -e . in a clone); "
                             f"no benchmarks/harness.py at {folder}")
    root = str(folder.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    harness = importlib.import_module("benchmarks.harness")
    return harness.main([] if argv is None else list(argv))
