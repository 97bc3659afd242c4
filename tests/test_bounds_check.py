"""tests/bounds_check.py: the interpreter's loads and stores checked against the launch's tensors' storages."""
import pytest
import torch
import triton
import triton.language as tl

from . import bounds_check
from .helpers import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="checks the loads and stores of Triton's interpreter")


@triton.jit
def increment_kernel(x, LOADS: tl.constexpr, STORES: tl.constexpr):
    r = tl.arange(0, 16)
    tl.store(x + r, tl.load(x + r, mask=r < LOADS, other=0.0) + 1, mask=r < STORES)


@pytest.fixture
def checked(monkeypatch):
    for cls, name in bounds_check.HOOKS:
        monkeypatch.setattr(cls, name, getattr(cls, name))  # restored after the test
    bounds_check.install()


def test_accesses_outside_the_storage_fail(checked):
    x = torch.zeros(8)  # the launch's only tensor: every address past its 8 elements is outside
    increment_kernel[(1,)](x, 8, 8)
    assert torch.equal(x, torch.ones(8))
    with pytest.raises(Exception, match="increment_kernel: 4 addresses of a load outside every tensor argument's"):
        increment_kernel[(1,)](x, 12, 8)
    with pytest.raises(Exception, match="increment_kernel: 8 addresses of a store outside every tensor argument's"):
        increment_kernel[(1,)](x, 8, 16)


def test_a_view_may_be_read_within_its_storage(checked):
    storage = torch.zeros(16)
    increment_kernel[(1,)](storage[:8], 16, 16)  # past the view, inside its storage
    assert torch.equal(storage, torch.ones(16))
