"""Without a GPU the Triton kernels run in Triton's interpreter: TRITON_INTERPRET must be set before the
first kernel is defined, so it is set here, before any test module imports deltatron's kernels."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a GPU test, a CUDA error left behind (an illegal memory access poisons the whole CUDA context)
    ends this process: every later test in it would fail with the same error and hide its own result. Under
    pytest-xdist the worker is replaced and the test is reported as having crashed it."""
    if "gpu" not in item.keywords or not torch.cuda.is_available():
        return
    try:
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 (any CUDA error: the context cannot be trusted any more)
        print(f"\n{item.nodeid} left a CUDA error, ending this test process: {error}", flush=True)
        os._exit(3)


def pytest_runtest_logreport(report):
    """With DELTATRON_FAILURE_LOG set, each failure's report goes to that file as it happens (from the controlling
    process under pytest-xdist), so that a run cut short by a time limit keeps its tracebacks: pytest prints them only
    at the end."""
    path = os.environ.get("DELTATRON_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as log:
            log.write(f"{report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
