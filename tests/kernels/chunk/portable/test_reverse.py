"""portable/reverse.py: the reverse state pass computing dV'_local itself (dv_local=None, the backward's path) against
the unfused pair grads.dv_local + state_bwd (its gradients against autograd: test_grads.py)."""
import pytest
import torch

from deltatron.kernels.chunk.portable import grads, reverse

from ....helpers import DEVICE, rel_rms
from ..helpers import DTYPES, ONE_ROUNDING_BWD, needs_triton, packed_growing

pytestmark = needs_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C, lengths, K, V, with_dht", [
    (16, [0, 1, 17, 33, 0], 24, 40, True),  # empty sequences, a 1-token one, partial last chunks
    (32, [1], 40, 24, True),  # T = 1
    (16, [20, 40], 24, 72, False),  # two V-blocks, the second partial
])
def test_state_bwd_fused_matches_unfused(dtype, C, lengths, K, V, with_dht, poison):
    """The reverse state pass computing dV'_local itself (dv_local=None, the backward's path) against the
    unfused pair grads.dv_local + state_bwd on the same inputs. They round A^T alike; the fused pass
    keeps dV'_local in fp32 where the unfused store rounds it, so they differ by about one rounding of the
    dtype (none in fp32) and the order of fp32 sums."""
    H = 2
    inp, info, _ = packed_growing(lengths, H, K, V, dtype, seed=C + K + V)
    N, TT = len(lengths), sum(lengths)
    g = torch.Generator().manual_seed(5)
    w = (0.3 * torch.randn(1, TT, H, K, generator=g)).to(device=DEVICE, dtype=dtype)
    do = torch.randn(1, TT, H, V, generator=g).to(device=DEVICE, dtype=dtype)
    dht = torch.randn(N, H, K, V, generator=g).to(DEVICE) if with_dht else None
    scale = 0.4
    dv_loc = grads.dv_local(inp["q"], inp["k"], do, scale, info, C)
    unfused = reverse.state_bwd(inp["q"], inp["k"], w, do, dv_loc, dht, scale, True, info, C)
    fused = reverse.state_bwd(inp["q"], inp["k"], w, do, None, dht, scale, True, info, C)
    close = ONE_ROUNDING_BWD[dtype]
    for name, got, want in zip(("dh", "dv", "dh0"), fused, unfused):
        assert got.dtype == want.dtype, name
        assert rel_rms(got, want) <= close, f"{name}: rel RMS {rel_rms(got, want):.2e}"
