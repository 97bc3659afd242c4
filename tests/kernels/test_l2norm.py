"""deltatron/kernels/l2norm.py: the row-wise L2 norm and its backward against the float64 oracle
(reference.common.l2norm and its autograd), one tensor or two (q and k) by one launch: the same bits either way."""
import pytest
import torch

from deltatron.kernels.l2norm import l2norm_bwd, l2norm_fwd
from deltatron.reference.common import l2norm

from ..helpers import BOUNDS, rel_rms


def _rows(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 3, 20), (1, 1, 1, 32), (1, 37, 2, 16)])
def test_pair_is_two_singles_and_the_oracle(dtype, shape):
    q, k = _rows(shape, dtype, 0), _rows(shape, dtype, 1)
    dq, dk = _rows(shape, torch.float32, 2), _rows(shape, torch.float32, 3)
    yq, rq, yk, rk = l2norm_fwd(q, k)
    for x, y, r, dy in ((q, yq, rq, dq), (k, yk, rk, dk)):
        y1, r1 = l2norm_fwd(x)
        assert torch.equal(y1, y) and torch.equal(r1, r) and r.dtype == torch.float32 and r.shape == x.shape[:-1]
        x64 = x.double().requires_grad_(True)
        y64 = l2norm(x64)
        assert rel_rms(y, y64) < BOUNDS[dtype]
        assert rel_rms(r, torch.rsqrt((x64 * x64).sum(-1) + 1e-6)) < 1e-6
        assert rel_rms(l2norm_bwd(y1, r1, dy), torch.autograd.grad(y64, x64, dy.double())[0]) < BOUNDS[dtype]
    got_q, got_k = l2norm_bwd(yq, rq, dq, yk, rk, dk)
    assert torch.equal(got_q, l2norm_bwd(yq, rq, dq)) and torch.equal(got_k, l2norm_bwd(yk, rk, dk))
    # gradients of two dtypes: one launch each, each in its own dtype
    got_q, got_k = l2norm_bwd(yq, rq, dq, yk, rk, dk.to(dtype))
    assert got_q.dtype == torch.float32 and got_k.dtype == dtype
    assert torch.equal(got_k, l2norm_bwd(yk, rk, dk.to(dtype)))


def test_pair_is_one_launch(monkeypatch):
    import deltatron.kernels.l2norm as module
    grids = []
    real = module.launch

    def recording(kernel, grid, *args, **kwargs):
        grids.append(grid)
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(module, "launch", recording)
    q, k = _rows((1, 40, 2, 16), torch.float32, 0), _rows((1, 40, 2, 16), torch.float32, 1)
    yq, rq, yk, rk = l2norm_fwd(q, k)
    l2norm_bwd(yq, rq, q, yk, rk, k)
    l2norm_fwd(q)
    assert grids == [(5, 2), (5, 2), (5, 1)]
