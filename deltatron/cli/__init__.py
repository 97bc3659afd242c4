"""The deltatron command line: `deltatron <command> [options]` (also `python -m deltatron`).

This module and the commands' modules import nothing that imports triton at import time: `deltatron check`
decides whether the Triton kernels run in Triton's interpreter (TRITON_INTERPRET, read once when
deltatron.kernels is first imported) before any kernel module is loaded."""
from __future__ import annotations

import importlib
import sys

# command: (module with main(argv) -> int, one line of help)
COMMANDS = {
    "check": ("deltatron.cli.check", "every implementation and backend on this device against the float64 oracle"),
    "explain": ("deltatron.cli.explain",
                "print which kernels chunk_delta_rule runs for a shape (the plan), on any machine"),
    "train": ("deltatron.cli.train",
              "train a small DeltaNet (or Gated DeltaNet, or linear-attention) LM on associative recall (MQAR)"),
    "bench": ("deltatron.cli.bench", "time deltatron against fla-core and FlashQLA, with a roofline (source checkout)"),
}

USAGE_ERROR = 2  # the exit code of a bad command line, as argparse's


def usage() -> str:
    lines = ["usage: deltatron <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "`deltatron <command> --help` lists a command's options."]
    return "\n".join(lines)


def fail(command: str, message: str) -> int:
    """A user error found after argument parsing (a device that is not there, settings that do not fit
    together): one line on stderr, no traceback; returns the exit code of a usage error."""
    print(f"deltatron {command}: {message}", file=sys.stderr)
    return USAGE_ERROR


def parse_device(name):
    """The --device option of a command as a torch.device (default: cuda if available, else cpu); a ValueError
    naming the option when the device cannot be used on this machine."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name} but no CUDA device is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(usage(), file=sys.stderr)
        return USAGE_ERROR
    if argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"deltatron: unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return USAGE_ERROR
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])
