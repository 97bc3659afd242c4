"""portable/wy_bwd.py: dK, dV, dbeta through W = T~ (beta K), U = T~ (beta V) against autograd of intra_chunk_wy."""
import pytest
import torch

from deltatron.kernels.chunk.portable import wy_bwd

from ....helpers import BOUNDS, DEVICE, nearly_parallel_keys, rel_rms
from ..helpers import DTYPES, needs_triton, packed_growing, to_dev, wy_model

pytestmark = needs_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C, lengths, K, V, parallel_keys", [
    (16, [0, 1, 17, 33], 24, 40, False), (64, [64, 65], 40, 24, False), (32, [31], 16, 16, False),
    (64, [128, 40], 32, 32, True),
])
def test_wy_bwd(dtype, C, lengths, K, V, parallel_keys, poison):
    """dK, dV, dbeta through W = T~ (beta K), U = T~ (beta V) against autograd of intra_chunk_wy."""
    H = 2
    inp, info, ref = packed_growing(lengths, H, K, V, dtype, seed=3 * C + K)
    if parallel_keys:
        inp["k"], inp["beta"] = nearly_parallel_keys(inp["k"].shape, 1.95, dtype, DEVICE, seed=C + K)
        ref["k"], ref["beta"] = (inp[n][0].cpu().double() for n in ("k", "beta"))
    k, v, beta = (ref[n].clone().requires_grad_() for n in ("k", "v", "beta"))
    w, u, tinv = wy_model(k, v, beta, lengths, C)
    g = torch.Generator().manual_seed(11)
    dw, du = (torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype).double() for x in (w, u))
    dk_direct = torch.randn(k.shape, generator=g, dtype=torch.float64).to(dtype).double()  # as dqkw stores it
    ((w * dw).sum() + (u * du).sum() + (k * dk_direct).sum()).backward()

    dk, dv, dbeta, _ = wy_bwd.wy_bwd(inp["k"], inp["v"], inp["beta"], to_dev(tinv.detach(), torch.float32),
                                  to_dev(dw, dtype), to_dev(du, dtype), to_dev(dk_direct, dtype), info, C)
    bound = BOUNDS[dtype]
    assert dk.dtype == dtype and dv.dtype == dtype and dbeta.dtype == inp["beta"].dtype
    assert rel_rms(dk[0], k.grad) <= bound
    assert rel_rms(dv[0], v.grad) <= bound
    assert rel_rms(dbeta[0], beta.grad) <= bound


# ---------------------------------------------------------------------------------------------------
# the whole backward, through the public API, against autograd through the float64 recurrence
