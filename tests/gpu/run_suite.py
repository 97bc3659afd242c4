"""Runs the GPU suite and `deltatron check` on the current GPU and writes a summary (LAST_RUN.md).

    python tests/gpu/run_suite.py [--out DIR] [--no-check] [--paths PATH ...] [--skip-passed FILE ...]
                                  [pytest args...]

The GPU tests live beside the CPU tests of what they test (tests/kernels/chunk/test_forward_gpu.py,
tests/kernels/chunk/hopper/test_walk_gpu.py, ...), marked `gpu`; the suite is `pytest tests -m gpu`, which
selects them from the whole tree (this folder holds only this script and LAST_RUN.md).

--every-test runs every test of the paths rather than those marked gpu: the CPU tests, written for the
interpreter's small and awkward shapes, then run compiled on the GPU (`--every-test --paths tests/kernels`: the
kernels' tests), which is where narrow-tile miscompiles have shown.

--paths runs part of the suite (default: the whole tests tree), e.g. one half per GPU of a two-GPU machine; the
a split in two (6 workers on an H200): tests/kernels/chunk/test_backward_gpu.py,
tests/kernels/chunk/test_forward_gpu.py, tests/kernels/test_fused_recurrent_gpu.py,
tests/kernels/chunk/hopper/test_reverse_gpu.py (261 s) against tests/kernels/test_parallel_gpu.py,
tests/kernels/test_fused_chunk_gpu.py, tests/test_layers_gpu.py, tests/kernels/chunk/hopper/test_walk_gpu.py
(297 s).

The summary (date, GPU, torch, triton, pass/fail counts, failures, the check table) goes to DIR/LAST_RUN.md
(default tests/gpu/LAST_RUN.md); the full pytest log, the junit XML, failures.txt (each failure's traceback,
written as it happens) and passed.txt (the id of each test that passed, written as it happens) go beside it.

--skip-passed resumes a suite cut by a time limit: the tests listed in those passed.txt files (an earlier call's)
are deselected, and the summary counts them apart.

Workers (`-n`) share the GPU, and each keeps PyTorch's cache of freed blocks. On one 141 GiB H200, 6 workers
ran clean (288 s). With 14, eight tests ended in CUDA out-of-memory errors."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tree() -> str:
    """The commit the suite ran on: SUITE_TREE where the copy has no git history, else git's HEAD."""
    if os.environ.get("SUITE_TREE"):
        return os.environ["SUITE_TREE"]
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return out.stdout.strip() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(ROOT, "tests", "gpu"))
    parser.add_argument("--no-check", action="store_true", help="skip deltatron check after the suite")
    parser.add_argument("--paths", nargs="+", default=["tests"],
                        help="test files or folders, relative to the repository (default: tests, all of it: "
                             "-m gpu selects the GPU tests)")
    parser.add_argument("--every-test", action="store_true",
                        help="every test of the paths, not only those marked gpu: the CPU tests' small, awkward "
                             "shapes (partial chunks, T = 1, heads of 16-48) compiled for the GPU, where a "
                             "miscompile shows that the interpreter cannot")
    parser.add_argument("--skip-passed", nargs="+", default=[], metavar="FILE",
                        help="passed.txt files of earlier runs: their tests are deselected")
    args, pytest_args = parser.parse_known_args()
    for path in args.skip_passed:
        if not os.path.isfile(path):
            parser.error(f"--skip-passed: no file {path}")
    skipped_before = len({line.strip() for path in args.skip_passed for line in open(path) if line.strip()})
    os.makedirs(args.out, exist_ok=True)
    junit = os.path.join(args.out, "junit.xml")
    log_path = os.path.join(args.out, "gpu_suite.log")
    paths = [os.path.join(ROOT, p) for p in args.paths]
    marker = [] if args.every_test else ["-m", "gpu"]
    cmd = [sys.executable, "-m", "pytest", *paths, *marker, "-q", "-rf", f"--junitxml={junit}", *pytest_args]
    failures, passed_log = os.path.join(args.out, "failures.txt"), os.path.join(args.out, "passed.txt")
    for path in (failures, passed_log):
        open(path, "w").close()  # this run's reports only, appended as they come
    env = dict(os.environ, DELTATRON_FAILURE_LOG=failures, DELTATRON_PASSED_LOG=passed_log,
               DELTATRON_SKIP_PASSED=os.pathsep.join(os.path.abspath(p) for p in args.skip_passed))
    with open(log_path, "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    check = None if args.no_check else subprocess.run([sys.executable, "-m", "deltatron", "check"],
                                                      capture_output=True, text=True, cwd=ROOT)

    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    lines = [
        "# GPU suite: last run",
        "",
        f"- tree: {tree()}",
        f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}",
        f"- command: `python tests/gpu/run_suite.py {' '.join(sys.argv[1:])}` "
        f"(pytest {' '.join(args.paths + marker)}"
        f"{'' if check is None else ', then deltatron check'})",
        f"- pytest: {passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
        f"{counts['skipped']} skipped (exit code {rc}); time {float(suite.get('time', 0)):.0f} s"
        + (f"; not run: {skipped_before} tests passed before ({', '.join(args.skip_passed)})" if skipped_before
           else ""),
        f"- deltatron check: {'not run (--no-check)' if check is None else f'exit code {check.returncode}'}",
    ]
    if failed:
        lines += ["", "## Failures", ""] + [f"- `{f}`" for f in failed]
    if check is not None:
        lines += ["", "## deltatron check", "", "```", check.stdout.rstrip(), check.stderr.rstrip()[-3000:], "```"]
    lines.append("")
    with open(os.path.join(args.out, "LAST_RUN.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines[:8]))
    return 0 if rc == 0 and (check is None or check.returncode == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
