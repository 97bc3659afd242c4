"""Without a GPU the Triton kernels run in Triton's interpreter: TRITON_INTERPRET must be set before the
first kernel is defined, so it is set here, before any test module imports deltatron's kernels. There,
DELTATRON_BOUNDS_CHECK=1 checks every kernel's loads and stores against its tensors' storages
(tests/bounds_check.py)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("DELTATRON_BOUNDS_CHECK") == "1":
        from tests import bounds_check
        bounds_check.install()


@pytest.fixture
def poison(monkeypatch):
    """Every uninitialized float allocation (torch.empty, torch.empty_like, Tensor.new_empty) comes back
    NaN-filled, so a kernel that skips a write cannot pass."""
    originals = {"empty": torch.empty, "empty_like": torch.empty_like}
    new_empty = torch.Tensor.new_empty

    def nan_filled(out):
        return out.fill_(float("nan")) if out.is_floating_point() else out

    for name, fn in originals.items():
        monkeypatch.setattr(torch, name, lambda *a, _fn=fn, **kw: nan_filled(_fn(*a, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda *a, **kw: nan_filled(new_empty(*a, **kw)))


def _passed_before() -> set:
    """The test ids listed in the files DELTATRON_SKIP_PASSED names (os.pathsep apart): an earlier run's passes."""
    passed = set()
    for path in filter(None, os.environ.get("DELTATRON_SKIP_PASSED", "").split(os.pathsep)):
        with open(path) as f:
            passed.update(line.strip() for line in f if line.strip())
    return passed


def pytest_collection_modifyitems(config, items):
    """With DELTATRON_SKIP_PASSED set, the tests an earlier run passed are deselected: a GPU suite longer than one
    machine's call resumes where the last call stopped (tests/gpu/run_suite.py --skip-passed). Without CUDA the GPU
    tests are skipped."""
    passed = _passed_before()
    if passed:
        done = [item for item in items if item.nodeid in passed]
        if done:
            config.hook.pytest_deselected(items=done)
            items[:] = [item for item in items if item.nodeid not in passed]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """On a CUDA machine, after every test (the GPU tests and the others, which run there on the GPU too), a CUDA
    error left behind (an illegal memory access poisons the whole CUDA context) ends this process: every later test
    in it would fail with the same error and hide its own result. Under pytest-xdist the worker is replaced and the
    test is reported as having crashed it."""
    if not torch.cuda.is_available():
        return
    try:
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 (any CUDA error: the context cannot be trusted any more)
        print(f"\n{item.nodeid} left a CUDA error, ending this test process: {error}", flush=True)
        os._exit(3)


_call_passed = set()  # tests whose call phase passed, awaiting their teardown's report


def pytest_runtest_logreport(report):
    """As reports arrive (in the controlling process under pytest-xdist), so that a run cut short by a time limit
    keeps them: with DELTATRON_FAILURE_LOG set, each failure's report goes to that file (pytest prints them only at the
    end); with DELTATRON_PASSED_LOG set, each test that passed (its call and its teardown) gets a line with its id,
    which DELTATRON_SKIP_PASSED takes."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    path = os.environ.get("DELTATRON_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as log:
            log.write(f"{report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
    path = os.environ.get("DELTATRON_PASSED_LOG")
    if path and report.when == "call" and report.passed:
        _call_passed.add(report.nodeid)
    elif path and report.when == "teardown" and report.nodeid in _call_passed:
        _call_passed.discard(report.nodeid)
        if report.passed:
            with open(path, "a") as log:
                log.write(report.nodeid + "\n")
