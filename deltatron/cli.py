"""The deltatron command line: `deltatron <command> [options]` (also `python -m deltatron`)."""
from __future__ import annotations

import sys

COMMANDS = {
    "check": ("deltatron.check", "every implementation and backend on this device against the float64 oracle"),
    "bench": ("deltatron.bench", "time deltatron against fla-core and FlashQLA, with a roofline"),
    "train": ("deltatron.train", "train a small DeltaNet LM on associative recall (MQAR), or a linear baseline"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: deltatron <command> [options]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<8} {help_text}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    import importlib

    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])
