"""The GPU suite's resumption (tests/conftest.py, tests/gpu/run_suite.py --skip-passed): each test that passed is
logged as it happens (DELTATRON_PASSED_LOG), and a later run given that log (DELTATRON_SKIP_PASSED) deselects those
tests and runs the rest. Checked on a throwaway test file run by pytest in a subprocess, in one process and under
pytest-xdist (whose controlling process writes the log)."""
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = '''
import pytest


def test_passes():
    pass


def test_passes_too():
    pass


def test_fails():
    assert False


@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown fails")


def test_teardown_fails(broken_teardown):
    pass


def test_skipped():
    pytest.skip("skipped")
'''


@pytest.fixture
def probe():
    """A test file inside tests/ (so that tests/conftest.py applies), removed afterwards."""
    path = ROOT / "tests" / f"resume_probe_{uuid.uuid4().hex}.py"
    path.write_text(PROBE)
    try:
        yield path
    finally:
        path.unlink()


def run(probe, workers, **env):
    """pytest's counts on the probe ({"passed": 2, ...}; a test whose teardown fails counts as passed and error)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(probe), *workers]
    # an outer run's logs stay its own, and an outer pytest-xdist worker's variables would make the inner run's
    # controlling process take itself for a worker
    logs = ("DELTATRON_FAILURE_LOG", "DELTATRON_PASSED_LOG", "DELTATRON_SKIP_PASSED")
    base = {name: value for name, value in os.environ.items()
            if name not in logs and not name.startswith("PYTEST_XDIST")}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(base, **env), timeout=300)
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    counts = {name: int(n) for n, name in re.findall(r"(\d+) (\w+)", last.split(" in ")[0])}
    assert counts, out.stdout + out.stderr
    return counts


@pytest.mark.parametrize("workers", [["-p", "no:xdist"], ["-n", "2"]], ids=["one process", "xdist"])
def test_passed_tests_logged_then_deselected(probe, workers, tmp_path):
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    assert run(probe, workers, DELTATRON_PASSED_LOG=str(first)) == dict(failed=1, passed=3, skipped=1, error=1)
    name = probe.relative_to(ROOT).as_posix()
    assert sorted(first.read_text().split()) == [f"{name}::test_passes", f"{name}::test_passes_too"]
    # resumed: the two that passed are not run again; the failure, the failed teardown and the skip are
    resumed = run(probe, workers, DELTATRON_SKIP_PASSED=str(first), DELTATRON_PASSED_LOG=str(second))
    # (under pytest-xdist the workers deselect, and the controller's summary does not count them)
    assert resumed == dict(failed=1, passed=1, skipped=1, error=1, **({} if "-n" in workers else dict(deselected=2)))
    assert not second.exists() or second.read_text() == ""


def test_run_suite_refuses_a_missing_passed_log(tmp_path):
    cmd = [sys.executable, str(ROOT / "tests" / "gpu" / "run_suite.py"), "--skip-passed", str(tmp_path / "none.txt")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--skip-passed: no file" in out.stderr
