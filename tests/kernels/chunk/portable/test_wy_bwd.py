"""portable/wy_bwd.py: dK, dV, dbeta through W = T~ (beta K), U = T~ (beta V) against autograd of intra_chunk_wy."""
import pytest
import torch

from deltatron.kernels.chunk.portable import wy_bwd
from deltatron.kernels.utils import seq_info

from ....helpers import BOUNDS, DEVICE, nearly_parallel_keys, random_cu_seqlens, rel_rms
from ..helpers import DTYPES, group_sums, needs_triton, packed_growing, to_dev, wy_model

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



@pytest.mark.parametrize("rule", ["delta", "gated", "kda"])
@pytest.mark.parametrize("key_heads, H", [(1, 2), (2, 6)])
def test_wy_bwd_grouped_heads(rule, key_heads, H, poison):
    """Grouped value heads: wy_bwd on k of key_heads heads gives dV, dbeta and the decays' share of the same stage on
    k repeated per value head, bit for bit, and dK as that stage's dK summed over each group in head order (fp32:
    the same fp32 sums). Partial chunks, an empty sequence, K and V not powers of two."""
    C, lengths, K, V = 32, [33, 0, 1, 40], 40, 24
    TT = sum(lengths)
    cu = random_cu_seqlens(lengths, DEVICE)
    info = seq_info(1, TT, torch.device(DEVICE), cu, cu.cpu())
    gen = torch.Generator().manual_seed(9 + H)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE)
    k, v, beta = rand(1, TT, key_heads, K), rand(1, TT, H, V), torch.rand(1, TT, H, generator=gen).to(DEVICE)
    tinv = (rand(1, TT, H, C) / 4).to(DEVICE)  # the kernel reads its lower triangle only
    dw, du, dk_direct = rand(1, TT, H, K), rand(1, TT, H, V), rand(1, TT, H, K)
    gates = {"delta": {}, "gated": {"gam": (-torch.rand(1, TT, H, generator=gen)).cumsum(1).to(DEVICE)},
             "kda": {"gk": (-torch.rand(1, TT, H, K, generator=gen) / 4).to(DEVICE)}}[rule]
    G = H // key_heads
    got = wy_bwd.wy_bwd(k, v, beta, tinv, dw, du, dk_direct, info, C, **gates)
    want = wy_bwd.wy_bwd(k.repeat_interleave(G, 2), v, beta, tinv, dw, du, dk_direct, info, C, **gates)
    assert got[0].shape == k.shape and torch.equal(got[0], group_sums(want[0], key_heads))
    assert all(torch.equal(a, b) for a, b in zip(got[1:3], want[1:3]))
    if rule != "delta":
        assert torch.equal(got[3], want[3])

# ---------------------------------------------------------------------------------------------------
# the whole backward, through the public API, against autograd through the float64 recurrence
