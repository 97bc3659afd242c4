"""tests/bounds_check.py: the interpreter's loads and stores checked against the launch's tensor arguments."""
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from . import bounds_check
from .helpers import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="checks the loads and stores of Triton's interpreter")


@triton.jit
def copy_kernel(x, y, LOADS: tl.constexpr, STORES: tl.constexpr):
    r = tl.arange(0, 16)
    tl.store(y + r, tl.load(x + r, mask=r < LOADS, other=0.0), mask=r < STORES)


def test_out_of_bounds_loads_and_stores_fail(monkeypatch):
    for cls, name in ((interpreter.GridExecutor, "_init_args_hst"), (interpreter.InterpreterBuilder,
                                                                     "create_masked_load"),
                      (interpreter.InterpreterBuilder, "create_masked_store")):
        monkeypatch.setattr(cls, name, getattr(cls, name))  # restored after the test
    bounds_check.install()
    memory = torch.arange(64, dtype=torch.float32)
    x, y = memory[8:16], torch.zeros(16)  # x's neighbours are memory's, no argument's
    copy_kernel[(1,)](x, y, 8, 16)  # masked to x's 8 elements: in bounds
    assert torch.equal(y[:8], x) and not y[8:].any()
    with pytest.raises(Exception, match="copy_kernel: 4 addresses of a load outside every tensor argument"):
        copy_kernel[(1,)](x, y, 12, 16)
    with pytest.raises(Exception, match="copy_kernel: 8 addresses of a store outside every tensor argument"):
        copy_kernel[(1,)](y, x, 16, 16)
