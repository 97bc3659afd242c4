"""benchmarks/gpu_call.sh (one call of a GPU machine: stage times, the GPU suite, check and train, the
benchmark, context parallelism on two GPUs) is valid bash, runs only scripts that exist, writes under a folder of
the checkout by default and brings no compile cache into the checkout."""
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_call.sh"


def test_parses_and_names_real_files():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    text = SCRIPT.read_text()
    scripts = set(re.findall(r"\b((?:tools|benchmarks|examples)/\w+\.py)", text))
    assert scripts == {"tools/stage_times.py", "benchmarks/run.py", "benchmarks/context_parallel.py",
                       "examples/train_context_parallel.py"}
    assert all((ROOT / path).exists() for path in scripts)
    assert "-m gpu" in text and "device_cache" not in text
    assert re.search(r"^OUT=\$\{OUT:-out\}$", text, re.M)


def test_unknown_step_is_refused(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    proc = subprocess.run(["bash", str(SCRIPT), "no-such-step"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown step: no-such-step" in proc.stdout


def test_suite_command_is_configurable(tmp_path):
    """SUITE_CMD replaces the suite's command and SUITE_ARGS adds to it; its log is gpu_suite.log, packed into
    logs.tgz with the summary naming the exit status."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), SUITE_CMD="echo suite-ran", SUITE_ARGS="tests/a.py")
    proc = subprocess.run(["bash", str(SCRIPT), "suite"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "suite: exit 0 (suite-ran tests/a.py)" in proc.stdout
    assert (out / "logs.tgz").exists() and not (out / "gpu_suite.log").exists()


def test_cp2_needs_two_gpus(tmp_path):
    """cp2 runs only where there are two GPUs; elsewhere its summary line says why and no log is written."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", str(SCRIPT), "cp2"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert "cp2: not run, it needs 2 GPUs (found 0)" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 0
    assert not any(out.iterdir())


def test_suite_resumes_from_passed_logs(tmp_path):
    """The suite's command sees SKIP_PASSED as DELTATRON_SKIP_PASSED and writes the passed tests' ids to
    DELTATRON_PASSED_LOG ($OUT/passed.txt: kept out of logs.tgz, counted in the summary), as tests/conftest.py does."""
    out, fake = tmp_path / "out", tmp_path / "suite.sh"
    fake.write_text('printf "t.py::a\\nt.py::b\\n" > "$DELTATRON_PASSED_LOG"; echo "skip: $DELTATRON_SKIP_PASSED"\n')
    env = dict(os.environ, OUT=str(out), SUITE_CMD=f"bash {fake}", SKIP_PASSED="one.txt:two.txt")
    proc = subprocess.run(["bash", str(SCRIPT), "suite"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "suite: exit 0 (skip: one.txt:two.txt)" in proc.stdout and "-- suite: 2 tests passed" in proc.stdout
    assert (out / "passed.txt").read_text().split() == ["t.py::a", "t.py::b"] and (out / "logs.tgz").exists()
