"""KDA's per-channel decays as the chunk stages form them (portable/gate.py: the gate's sums within sub-chunks by
channel_sums_stage, then channel_decays and channel_scores on chip; DESIGN.md §12), one chunk at a time in a test
kernel, against float64.

The gate that tells the two ways of forming an exponent apart: every channel strong (uniform in [-20, 0]) for the
first half of the chunk and nearly none (about -5e-4) after, so the factors between late tokens are near 1 while the
chunk's cumulative sums are near -320. Differences of those sums in fp32 put about 1e-5 of relative error into the
scores; the sums within sub-chunks keep them within 1e-6 (DESIGN.md §12's error analysis)."""
import pytest
import torch
import triton
import triton.language as tl

from deltatron.kernels.chunk.portable.gate import (FACTOR_BOUND, SUM_PLANES, channel_decays, channel_scores,
                                                   channel_sums, channel_sums_stage, factored)
from deltatron.kernels.utils import seq_info

from ....helpers import DEVICE, INTERPRET, random_cu_seqlens, rel_rms

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")


@triton.jit
def one_chunk_kernel(x, k, g, scores, gam, rest, total, n, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                     DIAG: tl.constexpr):
    r = tl.arange(0, C)
    c = tl.arange(0, BK)
    GS: tl.constexpr = SUM_PLANES * K
    tl.store(scores + r[:, None] * C + r[None, :], channel_scores(x, k, g, n, K, K, GS, K, C, DIAG, "ieee"))
    b_gam, b_rest, b_total = channel_decays(g, n, GS, 0, K, C, BK)
    tl.store(gam + r[:, None] * BK + c[None, :], b_gam)
    tl.store(rest + r[:, None] * BK + c[None, :], b_rest)
    tl.store(total + c, b_total)


def planes(g, n, C):
    """The gate's planes (channel_sums_stage) of g's first n rows [n, K], as one sequence of one head, chunk C."""
    cu = torch.tensor([0, n], dtype=torch.int32)
    info = seq_info(1, n, torch.device(DEVICE), cu.to(DEVICE), cu)
    return channel_sums_stage(g[:n].to(DEVICE)[None, :, None], info, C)


def strong_then_weak(C, K, gen):
    g = -5e-4 * torch.rand(C, K, generator=gen)
    g[:C // 2] = -20 * torch.rand(C // 2, K, generator=gen)
    return g


def near_factor_bound(C, K, gen):
    """Sub-chunks of 16 tokens whose totals reach just above -FACTOR_BOUND: the factored within-sub-chunk products at
    their largest exponents."""
    return -(FACTOR_BOUND.value / 16) * (0.9 + 0.1 * torch.rand(C, K, generator=gen))


GATES = {"strong_then_weak": strong_then_weak, "near_factor_bound": near_factor_bound}


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("C, n, K, diag", [(64, 64, 32, False), (64, 64, 24, True), (64, 41, 40, True),
                                           (32, 32, 32, False), (16, 9, 8, True)])
def test_channel_sums_match_float64(C, n, K, diag, gate):
    gen = torch.Generator().manual_seed(C + n + K)
    x, k = torch.randn(C, K, generator=gen), torch.randn(C, K, generator=gen)
    g = GATES[gate](C, K, gen)
    BK = triton.next_power_of_2(K)
    outs = torch.full((C, C), float("nan")), torch.empty(C, BK), torch.empty(C, BK), torch.empty(BK)
    outs = tuple(t.to(DEVICE) for t in outs)  # written on the device, compared on the host
    one_chunk_kernel[(1,)](x.to(DEVICE), k.to(DEVICE), planes(g, n, C), *outs, n, K, C, BK, diag)
    scores, gam, rest, total = (t.cpu() for t in outs)
    xd, kd, G = x.double()[:n], k.double()[:n], g.double()[:n].cumsum(0)
    keep = torch.tril(torch.ones(n, n, dtype=torch.bool), 0 if diag else -1)
    decay = torch.where(keep[..., None], G[:, None] - G[None], -torch.inf).exp()
    want = (xd[:, None] * kd[None] * decay).sum(-1)
    # the running sums to ~eps; the factored products to ~eps FACTOR_BOUND (DESIGN.md §12)
    assert rel_rms(scores[:n, :n], want) <= (1e-6 if gate == "strong_then_weak" else 1e-5)
    assert torch.all(scores[n:] == 0) and torch.all(scores[:n, n:] == 0)
    # Γ, the rest of the chunk and the chunk's total, each to fp32's relative accuracy
    assert rel_rms(gam[:n, :K], G) <= 1e-6
    assert rel_rms(rest[:n, :K], G[-1] - G) <= 1e-6
    assert rel_rms(total[:K], G[-1]) <= 1e-6


@triton.jit
def factored_kernel(g, out, n, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    _, _, t = channel_sums(g, n, SUM_PLANES * K, 0, K, C, BK)
    tl.store(out, factored(t).to(tl.int32))


@pytest.mark.parametrize("gate, expected", [("strong_then_weak", 0), ("near_factor_bound", 1)])
def test_factored_path_taken_where_every_sub_chunk_is_within_the_bound(gate, expected):
    gen = torch.Generator().manual_seed(3)
    g = GATES[gate](64, 32, gen)
    out = torch.full((1,), -1, dtype=torch.int32)
    factored_kernel[(1,)](planes(g, 64, 64), out := out.to(DEVICE), 64, 32, 64, 32)
    assert out.item() == expected
    # one sub-chunk past the bound in one channel sends the whole tile to the running sums
    g[20:36, 7] = -FACTOR_BOUND.value / 15
    factored_kernel[(1,)](planes(g, 64, 64), out, 64, 32, 64, 32)
    assert out.item() == 0


@pytest.mark.parametrize("C", [16, 32, 64])
def test_channel_sums_stage_over_packed_sequences(C, poison):
    # the planes (g, P, X) of packed sequences against float64 sums within each sequence's sub-chunks of 16 tokens:
    # partial chunks and sub-chunks, an empty sequence, one token, a partial channel tile (K = 72 > 64), a bf16 gate;
    # sub-chunks start at multiples of 16 from each sequence's start whatever the chunk size, so the planes are the
    # same at every C
    lengths, H, K = [70, 0, 1, 33, 16], 3, 72
    gen = torch.Generator().manual_seed(5)
    g = (-20 * torch.rand(1, sum(lengths), H, K, generator=gen)).to(torch.bfloat16)
    cu = random_cu_seqlens(lengths)
    planes = channel_sums_stage(g.to(DEVICE), seq_info(1, sum(lengths), torch.device(DEVICE), cu.to(DEVICE), cu), C)
    assert planes.shape == (1, sum(lengths), H, SUM_PLANES.value, K) and planes.dtype == torch.float32
    got = planes[0].cpu().double()
    gd = g[0].double()
    want_p, want_x = torch.empty_like(gd), torch.empty_like(gd)
    for bos, L in zip(cu.tolist(), lengths):
        for s0 in range(bos, bos + L, 16):
            blk = gd[s0:min(s0 + 16, bos + L)]
            want_p[s0:s0 + len(blk)] = blk.cumsum(0)
            want_x[s0:s0 + len(blk)] = blk.sum(0) - blk.cumsum(0)  # the rows after each, in float64
    assert torch.equal(got[:, :, 0], gd)
    assert rel_rms(got[:, :, 1], want_p) <= 1e-6
    assert rel_rms(got[:, :, 2], want_x) <= 1e-6
