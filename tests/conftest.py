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
